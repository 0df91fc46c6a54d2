"""A node agent and a kubelet stand-in wired together over real unix-socket gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.kube_sim.kubelet import SimKubelet
from tessera.node_agent.agent import NodeAgent
from tessera.node_agent.devices import HealthEvent
from tessera.node_agent.nvidia_source import StaticSource

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    InFlightClaim,
    NodeLedger,
    now,
)
from tessera.settings import TesseraSettings

GPU_TYPE = "NVIDIA-NVIDIA A100-SXM4-80GB"


class InjectableSource(StaticSource):
    """Static GPUs whose driver events the test injects."""

    def __init__(self, settings: TesseraSettings, node: str) -> None:
        super().__init__(settings, node)
        self.events: queue.Queue[HealthEvent] = queue.Queue()

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None


def rig_settings(base: Path, **overrides: Any) -> TesseraSettings:
    values: dict[str, Any] = {
        "device_source": "static",
        "static_gpu_count": 2,
        "static_gpu_memory_mib": 16000,
        "static_numa_nodes": 2,
        "device_split_count": 4,
        "device_plugin_dir": str(base / "dp"),
        "pod_resources_socket": str(base / "pr.sock"),
        "region_host_dir": str(base / "regions"),
        "node_heartbeat_s": 0.5,
        "usage_interval_s": 0.2,
        "health_recovery_s": 60.0,
    }
    values.update(overrides)
    return TesseraSettings(**values)


def make_pod(name: str, containers: list[tuple[str, int]], init: list[tuple[str, int]] = ()):
    def spec(items):
        return [
            {"name": n, "resources": {"limits": {"nvidia.com/gpu": c}} if c else {}}
            for n, c in items
        ]

    return {
        "metadata": {
            "name": name, "namespace": "team", "uid": f"uid-{name}-{uuid.uuid4().hex[:6]}"
        },
        "spec": {"initContainers": spec(init), "containers": spec(containers)},
    }


def grants(*items: tuple[str, int, int]) -> list[DeviceGrant]:
    return [DeviceGrant(uuid=u, type=GPU_TYPE, memory_mib=m, cores=c) for u, m, c in items]


async def bind(
    ledger_kv: object,
    node: str,
    pod: dict[str, Any],
    containers: list[list[DeviceGrant]],
    *,
    init_count: int = 0,
    claim: bool = True,
    core_policy: str = "default",
    sidecars: list[int] | None = None,
) -> Allocation:
    """What the scheduler writes at bind: a bound allocation and the node's in-flight claim."""
    meta = pod["metadata"]
    spec = pod["spec"]
    names = [c["name"] for c in spec.get("initContainers", [])] + [
        c["name"] for c in spec["containers"]
    ]
    allocation = Allocation(
        pod_uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], node=node,
        containers=containers, init_count=init_count, state=AllocationState.BOUND,
        container_names=names, core_policy=core_policy, sidecars=sidecars or [],
    )

    def mutate(ledger: NodeLedger | None) -> NodeLedger:
        ledger = ledger.model_copy(deep=True) if ledger else NodeLedger(node=node)
        ledger.allocations[allocation.pod_uid] = allocation
        if claim:
            ledger.claims[allocation.pod_uid] = InFlightClaim(
                pod_uid=allocation.pod_uid, namespace=allocation.namespace,
                name=allocation.name, expires_at=now() + 60,
            )
        return ledger

    await bus.cas_update(ledger_kv, node, NodeLedger, mutate)
    return allocation


async def ledger_of(ledger_kv: object, node: str) -> NodeLedger:
    current = await bus.read(ledger_kv, node, NodeLedger)
    assert current is not None
    return current.value


@dataclass
class Rig:
    settings: TesseraSettings
    node: str
    nc: Any
    buckets: Buckets
    kubelet: SimKubelet
    source: InjectableSource
    cluster: InMemoryCluster
    agent: NodeAgent | None = None
    process_probe: Any = None  # the watchdog's NVML stand-in, when a test gives one
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def gpus(self) -> list[str]:
        return [d.uuid for d in self.source.discover()]

    async def start_agent(self) -> NodeAgent:
        self.stop = asyncio.Event()
        self.agent = NodeAgent(
            settings=self.settings, node=self.node, nc=self.nc, js=self.nc.jetstream(),
            buckets=self.buckets, source=self.source, cluster=self.cluster,
            process_probe=self.process_probe,
        )
        self.task = asyncio.create_task(self.agent.run(self.stop))
        await asyncio.wait_for(self.agent.ready.wait(), 10)
        return self.agent

    async def stop_agent(self) -> None:
        if self.task is not None:
            self.stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.task, 10)
            self.task = None

    async def bind(self, pod, containers, **kw) -> Allocation:
        self.cluster.add_pod(pod)
        return await bind(self.buckets.ledger, self.node, pod, containers, **kw)

    async def ledger(self) -> NodeLedger:
        return await ledger_of(self.buckets.ledger, self.node)


@contextlib.asynccontextmanager
async def running_rig(
    base: Path, nc: Any, buckets: Buckets, *, node: str | None = None, process_probe: Any = None,
    lists_admitting: bool = True, **overrides: Any,
):
    """`lists_admitting=False`: kubelet's pod-resources List shows a pod only once it holds
    devices, so the agent cannot read which pod is under admission and must guess."""
    settings = rig_settings(base, **overrides)
    node = node or f"node-{uuid.uuid4().hex[:8]}"
    kubelet = SimKubelet(settings.device_plugin_dir, settings.pod_resources_socket,
                         lists_admitting=lists_admitting)  # fmt: skip
    await kubelet.start()
    rig = Rig(settings, node, nc, buckets, kubelet, InjectableSource(settings, node),
              InMemoryCluster(), process_probe=process_probe)
    try:
        await rig.start_agent()
        await kubelet.wait_registered(settings.resource_name)
        yield rig
    finally:
        await rig.stop_agent()
        await kubelet.stop()
