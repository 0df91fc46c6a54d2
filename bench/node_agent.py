"""Node agent figures: the kubelet handshake per pod, re-registration after a kubelet restart,
and one usage-sampling tick, over real unix-socket gRPC and a real NATS server.

    .venv/bin/python bench/node_agent.py
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from record import record_section
from tessera.kube_sim.kubelet import SimKubelet
from tessera.node_agent.agent import NodeAgent
from tessera.node_agent.nvidia_source import StaticSource

from tessera import bus
from tessera.bus import connect, ensure_bus
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    InFlightClaim,
    NodeLedger,
    now,
)
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats

PODS = 200
LIVE_FOR_SAMPLING = 60
RESTARTS = 10


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(base: Path, url: str) -> str:
    settings = TesseraSettings(
        device_source="static", static_gpu_count=8, static_gpu_memory_mib=81920,
        device_split_count=10, device_plugin_dir=str(base / "dp"),
        pod_resources_socket=str(base / "pr.sock"), region_host_dir=str(base / "regions"),
        usage_interval_s=3600, node_heartbeat_s=5,
    )
    nc = await connect(NatsSettings(NATS_URL=url), name="bench-node-agent")
    buckets = await ensure_bus(nc.jetstream(), settings)
    node = "bench-node"
    kubelet = SimKubelet(settings.device_plugin_dir, settings.pod_resources_socket)
    await kubelet.start()
    source = StaticSource(settings, node)
    gpus = [g.uuid for g in source.discover()]
    agent = NodeAgent(settings=settings, node=node, nc=nc, js=nc.jetstream(), buckets=buckets,
                      source=source)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await kubelet.wait_registered(settings.resource_name, timeout=30)

    async def bind(i: int) -> dict:
        uid = f"bench-{i}"
        pod = {"metadata": {"name": f"p{i}", "namespace": "bench", "uid": uid},
               "spec": {"containers": [{"name": "main",
                                        "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
        grant = DeviceGrant(uuid=gpus[i % len(gpus)], type="NVIDIA-x", memory_mib=1000, cores=10)

        def mutate(ledger: NodeLedger | None) -> NodeLedger:
            ledger = ledger.model_copy(deep=True) if ledger else NodeLedger(node=node)
            ledger.allocations[uid] = Allocation(
                pod_uid=uid, namespace="bench", name=f"p{i}", node=node, containers=[[grant]],
                state=AllocationState.BOUND, container_names=["main"],
            )
            ledger.claim = InFlightClaim(pod_uid=uid, namespace="bench", name=f"p{i}",
                                         expires_at=now() + 60)
            return ledger

        await bus.cas_update(buckets.ledger, node, NodeLedger, mutate)
        return pod

    async def release(uid: str) -> None:
        def mutate(ledger: NodeLedger | None) -> NodeLedger:
            ledger = ledger.model_copy(deep=True)
            del ledger.allocations[uid]
            return ledger

        await bus.cas_update(buckets.ledger, node, NodeLedger, mutate)
        kubelet.remove_pod(uid)

    handshake: list[float] = []
    live: list[str] = []
    for i in range(PODS):
        pod = await bind(i)
        started = time.perf_counter()
        admission = await kubelet.admit_pod(pod)
        handshake.append((time.perf_counter() - started) * 1000)
        assert admission.ok, admission.error
        live.append(pod["metadata"]["uid"])
        if len(live) > LIVE_FOR_SAMPLING:
            await release(live.pop(0))

    ticks = []
    for _ in range(10):
        started = time.perf_counter()
        sample = await agent.sampler.sample_once()
        ticks.append((time.perf_counter() - started) * 1000)
    assert len(sample.containers) == len(live)

    reregister = []
    for _ in range(RESTARTS):
        count = kubelet.registration_count(settings.resource_name)
        started = time.perf_counter()
        await kubelet.restart()
        await kubelet.wait_registered(settings.resource_name, after=count, timeout=10)
        reregister.append((time.perf_counter() - started) * 1000)

    stop.set()
    await task
    await kubelet.stop()
    await nc.close()
    return "\n".join([
        "| figure | value |",
        "|---|---|",
        f"| handshake per pod (GetPreferredAllocation + Allocate + PreStartContainer, "
        f"{PODS} pods, 8 GPUs × 10 replicas) | p50 {statistics.median(handshake):.1f} ms, "
        f"p95 {pct(handshake, 0.95):.1f} ms, max {max(handshake):.1f} ms |",
        f"| re-registration after a kubelet restart ({RESTARTS} restarts, 250 ms socket poll) "
        f"| p50 {statistics.median(reregister):.0f} ms, max {max(reregister):.0f} ms |",
        f"| one usage tick, {len(live)} live containers (ledger read, regions, flags) "
        f"| p50 {statistics.median(ticks):.1f} ms, max {max(ticks):.1f} ms |",
    ])


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="tsr-bench-"))
    server = EmbeddedNats()
    server.start()
    try:
        table = asyncio.run(run(base, server.url))
    finally:
        server.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    print(table)
    record_section("node-agent", table)


if __name__ == "__main__":
    main()
