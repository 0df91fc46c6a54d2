"""The watchdog on a real GPU (run by native/libvgpu/gpu-check.sh when a GPU is lent).

A child process that never loads libvgpu (the loader-copy bypass) creates a CUDA context on
GPU 0 through the real libcuda and holds HOLD_MIB; its "pod" (a fake cgroup under a temporary
proc root) was sealed LIMIT_MIB. The real watchdog loop, on the system's NVML, must see the
process with at least HOLD_MIB, judge a memory breach and end it (policy kill) within grace +
a poll. Prints one JSON line: {"ok": ..., "entry_point", "utilization", "seen_mib",
"killed_after_s", ...}; exit status 0 when the check passed.

    .venv/bin/python tests/node_agent/gpu_watchdog_check.py
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tessera.node_agent.containers import ContainerStore, PreparedContainer
from tessera.node_agent.nvml_processes import NvmlProcessProbe
from tessera.node_agent.watchdog import Watchdog
from tessera.node_agent.watchdog_rules import WatchdogPolicy

from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger
from tessera.region import ContainerLimits, DeviceLimit, seal_limits

HOLD_MIB = 2048
LIMIT_MIB = 1024
MIB = 1 << 20

HOLDER = f"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t({HOLD_MIB} << 20)) == 0
print("holding", flush=True)
time.sleep(120)
"""


class RecordingStream:
    """Stands for JetStream (no bus on the GPU box): keeps what would be published."""

    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes, **_: object) -> None:
        self.published.append(subject)


async def check(base: Path) -> dict[str, object]:
    probe = NvmlProcessProbe(None)
    result: dict[str, object] = {
        "entry_point": probe.list_entry_point, "utilization": probe.has_utilization,
    }
    gpu = next(iter(probe.gpus), None)
    if gpu is None:
        return {**result, "ok": False, "why": "NVML lists no GPU"}
    pod_uid = str(uuid.uuid4())
    grant = DeviceGrant(uuid=gpu, type="gpu", memory_mib=LIMIT_MIB, cores=100)
    store = ContainerStore(base / "regions")
    cdir = store.prepare(PreparedContainer(
        pod_uid=pod_uid, namespace="check", pod="bypass", container="main", index=0,
        device_ids=[f"{gpu}-0"], grants=[grant]))
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit(gpu, LIMIT_MIB * MIB),)))
    ledger = NodeLedger(node="gpu-check", allocations={pod_uid: Allocation(
        pod_uid=pod_uid, namespace="check", name="bypass", node="gpu-check",
        containers=[[grant]], container_names=["main"], state=AllocationState.ALLOCATED)})

    async def read_ledger() -> NodeLedger:
        return ledger

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout is None or holder.stdout.readline().strip() != "holding":
            return {**result, "ok": False, "why": "the CUDA holder did not start"}
        proc_root = base / "proc"
        (proc_root / str(holder.pid)).mkdir(parents=True)
        (proc_root / str(holder.pid) / "cgroup").write_text(
            f"0::/kubepods/burstable/pod{pod_uid}/{uuid.uuid4().hex}\n")
        stream = RecordingStream()
        watchdog = Watchdog(
            node="gpu-check", store=store, ledger=read_ledger, probe=probe,
            js=stream,  # type: ignore[arg-type]
            policy=WatchdogPolicy(), enforcement="kill", proc_root=proc_root,
            log=logging.getLogger("gpu-check"),
        )
        seen = [p for p in probe.poll() if p.pid == holder.pid]
        result["seen_mib"] = round((seen[0].used_bytes or 0) / MIB) if seen else None
        stop = asyncio.Event()
        task = asyncio.create_task(watchdog.run(stop))
        started = time.monotonic()
        while holder.poll() is None and time.monotonic() - started < 15:
            await asyncio.sleep(0.05)
        result["killed_after_s"] = (round(time.monotonic() - started, 2)
                                    if holder.poll() is not None else None)
        stop.set()
        await task
        result["events"] = stream.published
        result["ok"] = bool(
            seen and (seen[0].used_bytes or 0) >= HOLD_MIB * MIB
            and result["killed_after_s"] is not None
            and any(s.endswith(".breached") for s in stream.published))
        return result
    finally:
        holder.kill()
        holder.wait()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tsr-wd-gpu-") as base:
        result = asyncio.run(check(Path(base)))
    print(json.dumps(result))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
