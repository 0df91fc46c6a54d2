"""kube-sim stops within seconds of SIGTERM while a pod waits in its scheduler's backoff (it
used to hang about every second time: a cancel racing `asyncio.wait_for`'s timeout on 3.11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tessera_cli.stack import StackPorts

pytestmark = pytest.mark.timeout(120)


def start(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = StackPorts.free().kube_sim
    env = {**os.environ, "TESSERA_KUBE_SIM_LISTEN": f"127.0.0.1:{port}",
           "TESSERA_KUBE_SIM_KUBECONFIG": str(root / "kubeconfig"), "TESSERA_KUBE_SIM_NODES": "[]",
           "TESSERA_KUBE_SIM_WEBHOOK_URL": "", "TESSERA_KUBE_SIM_EXTENDER_URL": "",
           "TESSERA_KUBE_SIM_KUBELET_ROOT": str(root / "kl")}
    proc = subprocess.Popen([sys.executable, "-m", "tessera.kube_sim"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1):
                return proc, url
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "kube-sim did not start"
            time.sleep(0.1)


def test_sigterm_with_a_pending_pod_stops_promptly() -> None:
    pod = {"metadata": {"name": "waiting"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    for _ in range(4):
        proc, url = start(Path(tempfile.mkdtemp(prefix="ks-stop-")))
        try:
            request = urllib.request.Request(
                f"{url}/api/v1/namespaces/default/pods", data=json.dumps(pod).encode(),
                method="POST", headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request).read()
            proc.terminate()
            proc.wait(8)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
