"""The local stack: embedded NATS plus every service as a child process.

Used by `tessera up` and by end-to-end tests. Each service is started exactly as in production
(`python -m tessera.<service>`, configured by env vars), so what runs here is what ships.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera.nats_embedded import EmbeddedNats


@dataclass
class ServiceSpec:
    """One child process of the stack."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)


def default_services(node_names: list[str] | None = None) -> list[ServiceSpec]:
    """Every service once, plus one node agent per simulated node."""
    specs = [
        ServiceSpec("quota", "tessera.quota"),
        ServiceSpec("scheduler", "tessera.scheduler"),
        ServiceSpec("admission", "tessera.admission"),
        ServiceSpec("metrics", "tessera.metrics"),
    ]
    for node in node_names or ["sim-node-0"]:
        specs.append(
            ServiceSpec(f"node-agent/{node}", "tessera.node_agent", {"TESSERA_NODE_NAME": node})
        )
    return specs


@dataclass
class RunningService:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def status(self) -> str:
        code = self.proc.poll()
        return "running" if code is None else f"exited ({code})"


class LocalStack:
    """Start NATS (unless a URL is given) and the services; stop them all, in reverse order."""

    def __init__(
        self,
        state_dir: Path,
        services: list[ServiceSpec],
        nats_url: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.services = services
        self.extra_env = extra_env or {}
        self.nats: EmbeddedNats | None = None
        self.nats_url = nats_url
        self.running: list[RunningService] = []

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        if self.nats_url is None:
            self.nats = EmbeddedNats(data_dir=self.state_dir / "nats").start()
            self.nats_url = self.nats.url
        for spec in self.services:
            self.start_service(spec)

    def start_service(self, spec: ServiceSpec) -> RunningService:
        env = {**os.environ, **self.extra_env, **spec.env, "NATS_URL": str(self.nats_url)}
        log_path = self.state_dir / "logs" / f"{spec.name.replace('/', '-')}.log"
        log_file = log_path.open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", spec.module],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the CLI only; it stops children itself
        )
        log_file.close()
        running = RunningService(spec, proc, log_path, time.time())
        self.running.append(running)
        return running

    def stop_service(self, running: RunningService, timeout_s: float = 8.0) -> None:
        if running.proc.poll() is None:
            running.proc.send_signal(signal.SIGTERM)
            try:
                running.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()

    def stop(self) -> None:
        for running in reversed(self.running):
            if running.proc.poll() is None:
                running.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 8.0
        for running in reversed(self.running):
            try:
                running.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()
        if self.nats is not None:
            self.nats.stop()
