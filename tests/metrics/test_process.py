"""`python -m tessera.metrics` as it ships: serves, becomes ready, stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tessera_cli.nats_embedded import EmbeddedNats, free_port


def test_service_process_serves_and_stops_on_sigterm(fresh_nats: EmbeddedNats) -> None:
    port = free_port()
    env = dict(os.environ, NATS_URL=fresh_nats.url, TESSERA_LISTEN=f"127.0.0.1:{port}")
    proc = subprocess.Popen([sys.executable, "-m", "tessera.metrics"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60  # imports alone took 5 s at load 8
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5.0)
                if ready.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert ready is not None and ready.status_code == 200
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text
        assert "tessera_metrics_synced 1.0" in metrics
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10.0)
        assert "<title>Tessera" in page.text
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # Inside Kubernetes' default 30 s grace period, even on a loaded host (1.4 s at load 8).
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 20
        lines = [json.loads(line) for line in proc.stdout.read().decode().splitlines()
                 if line.startswith("{")]
        assert any(entry.get("msg") == "stopped" for entry in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
