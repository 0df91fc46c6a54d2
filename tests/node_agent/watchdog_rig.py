"""What the watchdog tests share: a fake NVML that reports processes, a fake /proc with their
cgroups, real processes standing for a tenant's, and admitted pods with sealed limits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent_rig import grants, make_pod, rig_settings, running_rig
from tessera.node_agent.nvidia_source import StaticSource
from tessera.node_agent.nvml_processes import NvmlProcessProbe

from tessera.events import subscribe
from tessera.models import LimitBreachedEvent

MIB = 1 << 20


@dataclass
class WatchEnv:
    base: Path
    lib: Path
    node: str
    uuids: list[str]
    proc_root: Path
    procs_file: Path
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def probe(self, lib: Path | None = None) -> NvmlProcessProbe:
        return NvmlProcessProbe(str(lib or self.lib))

    def spawn(self, cgroup: str | None) -> subprocess.Popen[bytes]:
        """A real process (a tenant's, as far as the GPU knows) with this cgroup in the fake
        /proc; None = no /proc entry at all."""
        child = subprocess.Popen(["sleep", "600"])
        self.children.append(child)
        if cgroup is not None:
            entry = self.proc_root / str(child.pid)
            entry.mkdir(parents=True, exist_ok=True)
            (entry / "cgroup").write_text(cgroup)
        return child

    def spawn_in_pod(self, pod_uid: str) -> subprocess.Popen[bytes]:
        scope = f"cri-containerd-{uuid.uuid4().hex}.scope"
        slice_ = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
        return self.spawn(f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}/{scope}\n")

    def gpu_holds(self, *entries: tuple[int, subprocess.Popen[bytes], int, int]) -> None:
        """What NVML shows: (GPU index, process, MiB used, SM %) per line."""
        tmp = self.procs_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{gpu} {p.pid} {mib} {sm}\n" for gpu, p, mib, sm in entries))
        os.replace(tmp, self.procs_file)

    def cleanup(self) -> None:
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            with contextlib.suppress(Exception):
                child.wait(5)


def make_env(base: Path, lib: Path, monkeypatch: Any) -> WatchEnv:
    node = f"node-{uuid.uuid4().hex[:8]}"
    uuids = [g.uuid for g in StaticSource(rig_settings(base), node).discover()]
    config = base / "nvml.conf"
    config.write_text("".join(
        f"gpu {u} 16000 0 00000000:{0x17 + i:02x}:00.0 0 NVIDIA A100-SXM4-80GB\n"
        for i, u in enumerate(uuids)
    ))
    procs = base / "procs"
    procs.write_text("")
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(config))
    monkeypatch.setenv("FAKE_NVML_PROCESSES", str(procs))
    proc_root = base / "proc"
    proc_root.mkdir()
    return WatchEnv(base, lib, node, uuids, proc_root, procs)


@contextlib.asynccontextmanager
async def watched_rig(env: WatchEnv, nc: Any, buckets: Any, *, probe: Any = None,
                      **overrides: Any):
    # Processes here never run libvgpu: without leases (memory_leases=True: every one of them
    # would be unattested and killed at first sight, test_watchdog_leases.py) the rules of the
    # usage region and the grace period apply.
    settings = {"watchdog": "on", "watchdog_proc_root": str(env.proc_root),
                "memory_leases": False}
    settings.update(overrides)
    async with running_rig(env.base, nc, buckets, node=env.node,
                           process_probe=probe or env.probe(), **settings) as rig:
        yield rig


async def admit(
    rig: Any, name: str, memory_mib: int, cores: int = 30, gpu: int = 0,
    core_policy: str = "default",
):
    """A pod with a real UUID, bound and started through kubelet: its limits are sealed.
    Returns (pod uid, path of its usage region on the host)."""
    pod = make_pod(name, [("main", 1)])
    pod["metadata"]["uid"] = str(uuid.uuid4())
    await rig.bind(pod, [grants((rig.gpus[gpu], memory_mib, cores))], core_policy=core_policy)
    admission = await rig.kubelet.admit_pod(pod)
    assert admission.ok, admission.error
    region = admission.containers[0].mount("/run/tessera/region").host_path + "/usage"
    return pod["metadata"]["uid"], region


class Breaches:
    """limit.breached events of one node, as a consumer of the stream sees them."""

    def __init__(self, nc: Any, node: str) -> None:
        self._queue: asyncio.Queue[LimitBreachedEvent] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(nc, node))
        self.seen: list[LimitBreachedEvent] = []

    async def _pump(self, nc: Any, node: str) -> None:
        async for received in subscribe(nc, f"tessera.events.limit.{node}.breached"):
            assert isinstance(received.event, LimitBreachedEvent)
            await self._queue.put(received.event)

    async def next(self, timeout: float = 15.0) -> LimitBreachedEvent:
        event = await asyncio.wait_for(self._queue.get(), timeout)
        self.seen.append(event)
        return event

    async def none_within(self, seconds: float) -> bool:
        try:
            await self.next(timeout=seconds)
        except TimeoutError:
            return True
        return False

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


async def wait_exit(child: subprocess.Popen[bytes], timeout: float) -> float | None:
    """Seconds until the process ends (reaped), or None if it still runs after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if child.poll() is not None:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None
