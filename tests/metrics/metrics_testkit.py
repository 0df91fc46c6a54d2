"""Builders for bus messages, a parsed exposition, and starting a metrics service."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import msgpack
from nats.aio.client import Client as NatsClient
from prometheus_client.parser import text_string_to_metric_families
from tessera.metrics.service import MetricsService

from tessera.bus import Buckets
from tessera.models import (
    Allocation,
    AllocationState,
    ContainerUsage,
    DeviceGrant,
    DeviceInfo,
    DeviceUsage,
    HostDeviceUsage,
    NodeLedger,
    NodeRegistration,
    UsageSample,
)
from tessera.settings import TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats, free_port

GIB_MIB = 1024
MIB = 1024 * 1024


def registration(node: str, gpus: int = 2, memory_mib: int = 80 * GIB_MIB) -> NodeRegistration:
    return NodeRegistration(
        node=node,
        devices=[
            DeviceInfo(uuid=f"GPU-{node}-{i}", index=i, type="NVIDIA-H200", memory_mib=memory_mib,
                       physical_memory_mib=memory_mib, cores=100, split_count=10)
            for i in range(gpus)
        ],
    )


def allocation(
    node: str, namespace: str, name: str, grants: list[list[tuple[str, int, int]]],
    *, state: AllocationState = AllocationState.ALLOCATED, names: list[str] | None = None,
    init_count: int = 0, init_done: bool = False,
) -> Allocation:
    return Allocation(
        pod_uid=f"uid-{namespace}-{name}",
        namespace=namespace,
        name=name,
        node=node,
        containers=[
            [DeviceGrant(uuid=u, type="NVIDIA-H200", memory_mib=m, cores=c) for u, m, c in ctr]
            for ctr in grants
        ],
        container_names=names or [f"c{i}" for i in range(len(grants))],
        state=state,
        init_count=init_count,
        init_done=init_done,
    )


def ledger(node: str, *allocations: Allocation) -> NodeLedger:
    return NodeLedger(node=node, allocations={a.pod_uid: a for a in allocations})


def usage(node: str, at: float, containers: list[ContainerUsage],
          hosts: list[HostDeviceUsage] | None = None) -> UsageSample:
    return UsageSample(node=node, at=at, containers=containers, devices=hosts or [])


def container_usage(alloc: Allocation, container: str, uuid: str, used_mib: int, limit_mib: int,
                    sm_util: float, sm_limit: int, last_kernel_at: float | None = None
                    ) -> ContainerUsage:
    return ContainerUsage(
        pod_uid=alloc.pod_uid, namespace=alloc.namespace, pod=alloc.name, container=container,
        devices=[DeviceUsage(uuid=uuid, used_bytes=used_mib * MIB, limit_bytes=limit_mib * MIB,
                             sm_util=sm_util, sm_limit=sm_limit, last_kernel_at=last_kernel_at)],
    )


def envelope(schema: str, version: int, data: dict) -> bytes:
    """A message as a future (or broken) publisher would write it."""
    return msgpack.packb({"schema": schema, "version": version, "data": data}, use_bin_type=True)


@dataclass
class Exposition:
    """Parsed /metrics text: value lookups by sample name and labels."""

    text: str

    def __post_init__(self) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}

    def value(self, sample_name: str, **labels: str) -> float | None:
        for family in self.families.values():
            for sample in family.samples:
                if sample.name == sample_name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return sample.value
        return None

    def samples(self, sample_name: str, **labels: str) -> list:
        return [
            s for f in self.families.values() for s in f.samples
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
        ]


@dataclass
class Bus:
    server: EmbeddedNats
    nc: NatsClient
    buckets: Buckets
    settings: TesseraSettings

    @property
    def js(self):  # type: ignore[no-untyped-def]
        return self.nc.jetstream()




async def start_service(bus: Bus, port: int | None = None) -> MetricsService:
    service = MetricsService(bus.nc, bus.js, bus.buckets, bus.settings,
                             listen=f"127.0.0.1:{port or free_port()}")
    await service.start()
    assert await service.feeds.wait_synced(timeout=10.0), "metrics service never synced"
    return service


async def scrape(service: MetricsService) -> Exposition:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{service.url}/metrics", timeout=5.0)
    response.raise_for_status()
    return Exposition(response.text)
