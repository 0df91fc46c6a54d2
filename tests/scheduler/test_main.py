"""`python -m tessera.scheduler` starts, gets ready once synced, answers, stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_service_entry_serves_and_stops_on_sigterm(nats_url: str) -> None:
    port = free_port()
    env = {**os.environ, "NATS_URL": nats_url, "TESSERA_LISTEN": f"127.0.0.1:{port}",
           "TESSERA_CLUSTER": "none", "TESSERA_QUOTA_ENABLED": "false"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "tessera.scheduler"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert ready, "never ready"
        pod = {"metadata": {"name": "p", "uid": "u"}, "spec": {"containers": [
            {"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}  # fmt: skip
        answer = httpx.post(f"http://127.0.0.1:{port}/filter",
                            json={"pod": pod, "nodenames": ["nowhere"]}).json()  # fmt: skip
        assert answer["failedNodes"]["nowhere"].startswith("NodeUnregistered")
        assert "tessera_scheduler_ready 1.0" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b'"started"' in (proc.stdout.read() if proc.stdout else b"")
