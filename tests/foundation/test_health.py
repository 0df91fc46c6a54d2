"""Health probes of the services without an HTTP face (quota, node agent)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tessera.health import answer
from tessera_cli.nats_embedded import free_port


def test_probe_answers() -> None:
    assert answer(b"GET /healthz HTTP/1.1", lambda: False).startswith(b"HTTP/1.1 200")
    assert answer(b"GET /readyz HTTP/1.1", lambda: True).startswith(b"HTTP/1.1 200")
    not_ready = answer(b"GET /readyz?verbose HTTP/1.1", lambda: False)
    assert not_ready.startswith(b"HTTP/1.1 503") and b"NATS" in not_ready
    assert answer(b"GET /other HTTP/1.1", lambda: True).startswith(b"HTTP/1.1 404")
    assert answer(b"POST /healthz HTTP/1.1", lambda: True).startswith(b"HTTP/1.1 405")
    for garbage in (b"", b"\x00\xff", b"GET", b"GET /healthz SPDY/9 extra"):
        assert answer(garbage, lambda: True).startswith(b"HTTP/1.1 400")


@pytest.mark.parametrize("module", ["tessera.quota", "tessera.node_agent"])
def test_service_serves_probes_on_tessera_listen(nats_url: str, module: str, tmp_path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "NATS_URL": nats_url,
        "TESSERA_CLUSTER": "none",
        "TESSERA_LISTEN": f"127.0.0.1:{port}",
        "TESSERA_NODE_NAME": f"probe-{port}",
        "TESSERA_DEVICE_SOURCE": "static",
        "TESSERA_DEVICE_PLUGIN_DIR": str(tmp_path / "dp"),
        "TESSERA_REGION_HOST_DIR": str(tmp_path / "regions"),
        "TESSERA_POD_RESOURCES_SOCKET": str(tmp_path / "pr.sock"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        ready = None
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                if ready.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert ready is not None and ready.status_code == 200, "readyz never answered 200"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).text == "ok\n"
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(b"\x00garbage\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 400")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        proc.send_signal(signal.SIGTERM)
        # Inside Kubernetes' 30 s grace period; 10 s was missed at load ~22.
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
