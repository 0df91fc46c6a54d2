"""CLI fixtures: kube-sim alone (the real API server double, no GPUs, no webhook) for the
kubectl-habit tests, and the CLI run in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera_cli.app import build_app
from tessera_cli.nats_embedded import free_port


@dataclass
class KubeSim:
    url: str
    kubeconfig: Path

    def cli(self, *args: str, input: str | None = None):
        """`tessera ARGS --kubeconfig <kube-sim's>`, in-process."""
        return CliRunner().invoke(build_app(), [*args, "--kubeconfig", str(self.kubeconfig)],
                                  input=input)

    def get(self, path: str) -> dict:
        import json

        with urllib.request.urlopen(self.url + path, timeout=5) as reply:
            return json.loads(reply.read())


@pytest.fixture(scope="module")
def kube_sim() -> Iterator[KubeSim]:
    root = Path(tempfile.mkdtemp(prefix="tessera-cli-"))
    port = free_port()
    env = {
        **os.environ,
        "TESSERA_KUBE_SIM_LISTEN": f"127.0.0.1:{port}",
        "TESSERA_KUBE_SIM_KUBECONFIG": str(root / "kubeconfig"),
        "TESSERA_KUBE_SIM_NODES": "[]",
        "TESSERA_KUBE_SIM_WEBHOOK_URL": "",
        "TESSERA_KUBE_SIM_EXTENDER_URL": "",
        "TESSERA_KUBE_SIM_KUBELET_ROOT": str(root / "kl"),
    }
    log = (root / "kube-sim.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tessera.kube_sim"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=1):
                    if (root / "kubeconfig").is_file():
                        break
            except OSError:
                pass
            assert proc.poll() is None, (root / "kube-sim.log").read_text()
            assert time.monotonic() < deadline, "kube-sim did not start"
            time.sleep(0.1)
        yield KubeSim(url, root / "kubeconfig")
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
