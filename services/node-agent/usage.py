"""Sampling the usage regions: tessera.usage.<node>, OOM events, contention flags, cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from tessera.node_agent.containers import ContainerDir, ContainerStore
from tessera.node_agent.devices import DeviceSource
from tessera.node_agent.lending import ComputeLending
from tessera.node_agent.state import DeviceState

from tessera import bus
from tessera.codec import encode
from tessera.elastic_compute import LendingMember
from tessera.models import (
    ContainerUsage,
    DeviceUsage,
    HostDeviceUsage,
    NodeLedger,
    OomEvent,
    UsageSample,
)
from tessera.region import (
    ContainerActivity,
    DeviceLimit,
    RegionFormatError,
    RegionUsage,
    activity_flags,
    read_limits,
    read_region,
    set_device_flags,
)

GC_EVERY_S = 10.0


def _read(cdir: ContainerDir) -> tuple[RegionUsage | None, object]:
    try:
        usage = read_region(cdir.region_file)
    except (RegionFormatError, OSError):
        usage = None
    try:
        limits = read_limits(cdir.limits_dir)
    except (RegionFormatError, OSError):
        limits = None
    return usage, limits


class UsageSampler:
    """Once a second: read every live container's region, publish, flag contention."""

    def __init__(
        self,
        *,
        node: str,
        store: ContainerStore,
        state: DeviceState,
        ledger_kv: KeyValue,
        nc: NatsClient,
        js: JetStreamContext,
        source: DeviceSource,
        log: logging.Logger,
        interval_s: float = 1.0,
        pod_listing: Callable[[], Awaitable[set[tuple[str, str]] | None]] | None = None,
        lending: ComputeLending | None = None,
    ) -> None:
        self.node = node
        self.store = store
        self.state = state
        self.ledger_kv = ledger_kv
        self.nc = nc
        self.js = js
        self.source = source
        self.log = log
        self.interval_s = interval_s
        self.pod_listing = pod_listing
        self.lending = lending
        self.started_at = time.time()
        self._oom_seen: dict[tuple[str, str], int] = {}
        self._last_gc = 0.0

    async def _ledger(self) -> NodeLedger | None:
        current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        return current.value if current else None

    async def sample_once(self) -> UsageSample:
        ledger = await self._ledger()
        allocations = ledger.allocations if ledger else {}
        containers: list[ContainerUsage] = []
        activity: dict[str, list[tuple[ContainerDir, ContainerActivity]]] = {}
        ooms: list[OomEvent] = []
        members: dict[str, list[LendingMember]] = {}  # per GPU, for compute lending
        elastic: set[str] = set()  # GPUs holding an elastic container
        names: dict[str, tuple[str, str, str]] = {}  # container key -> namespace, pod, container
        for cdir in await asyncio.to_thread(self.store.all):
            p = cdir.prepared
            allocation = allocations.get(p.pod_uid)
            if allocation is None or not allocation.active:
                continue
            usage, limits = await asyncio.to_thread(_read, cdir)
            grants = allocation.containers[p.index] if p.index < len(allocation.containers) else []
            devices = []
            oom_total = 0
            for g in grants:
                du = usage.device(g.uuid) if usage else None
                limit = limits.device(g.uuid) if limits else None
                used = du.used_bytes if du else 0
                oom = du.oom_count if du else 0
                oom_total += oom
                devices.append(DeviceUsage(
                    uuid=g.uuid,
                    used_bytes=used,
                    limit_bytes=limit.mem_limit_bytes if limit else g.memory_mib << 20,
                    sm_util=(du.achieved_sm_pct or 0.0) if du else 0.0,
                    sm_limit=limit.sm_limit_pct if limit else min(g.cores, 100),
                    last_kernel_at=du.last_kernel_ns / 1e9 if du and du.last_kernel_ns else None,
                    **_elastic_memory(limit, used),
                    **_elastic_compute(limit),
                ))
                ooms.extend(self._oom_events(cdir, g.uuid, oom))
                if limits is not None:
                    activity.setdefault(g.uuid, []).append((cdir, ContainerActivity(
                        cdir.key, limits.priority, du.last_kernel_ns if du else 0
                    )))
                    members.setdefault(g.uuid, []).append(
                        LendingMember(cdir.key, cdir.limits_dir, cdir.region_file))
                    names[cdir.key] = (p.namespace, p.pod, p.container)
                    if limit is not None and limit.sm_elastic:
                        elastic.add(g.uuid)
            containers.append(ContainerUsage(
                pod_uid=p.pod_uid, namespace=p.namespace, pod=p.pod, container=p.container,
                devices=devices, oom_count=oom_total,
                spilled_bytes=usage.spilled_bytes if usage else 0,  # docs/elastic.md, spill
                spill_limit_bytes=limits.spill_bytes if limits else 0,
            ))
        await asyncio.to_thread(self._flag_contention, activity)
        if self.lending is not None:
            self.lending.set_members({u: ms for u, ms in members.items() if u in elastic}, names)
        sample = UsageSample(node=self.node, containers=containers,
                             devices=await self._host_devices(containers))
        for event in ooms:
            try:
                await bus.publish_event(self.js, event)
            except Exception as exc:
                self.log.warning("oom event not published", extra={"err": str(exc)})
        return sample

    def _oom_events(self, cdir: ContainerDir, uuid: str, count: int) -> list[OomEvent]:
        key = (cdir.key, uuid)
        previous = self._oom_seen.get(key)
        self._oom_seen[key] = count
        if previous is None:
            # First sight: announce only OOMs of containers prepared since we started.
            previous = 0 if cdir.prepared.prepared_at >= self.started_at else count
        if count <= previous:
            return []
        p = cdir.prepared
        return [OomEvent(
            event_id=f"{p.pod_uid}:{p.index}:{uuid}:oom:{count}",
            node=self.node, pod_uid=p.pod_uid, namespace=p.namespace, pod=p.pod,
            container=p.container, device_uuid=uuid, oom_count=count,
            reason=f"{count - previous} allocation(s) refused at the memory limit",
            source=f"node-agent/{self.node}",
        )]

    @staticmethod
    def _flag_contention(
        activity: dict[str, list[tuple[ContainerDir, ContainerActivity]]],
    ) -> None:
        """libvgpu's `default` policy limits compute only while another container is active."""
        now_ns = time.time_ns()
        for uuid, entries in activity.items():
            flags = activity_flags([a for _, a in entries], now_ns=now_ns)
            for cdir, a in entries:
                with contextlib.suppress(FileNotFoundError, KeyError, RegionFormatError, OSError):
                    set_device_flags(
                        cdir.limits_dir, uuid, contended=flags[a.key].contended,
                        yield_=flags[a.key].yield_,
                    )

    async def _host_devices(self, containers: list[ContainerUsage]) -> list[HostDeviceUsage]:
        host = await asyncio.to_thread(self.source.host_usage)
        out = []
        for d in self.state.devices():
            if d.uuid in host:
                used, total, util = host[d.uuid]
            else:  # simulated GPUs: what the containers charge
                used = sum(x.used_bytes for c in containers for x in c.devices if x.uuid == d.uuid)
                total = (d.physical_memory_mib or d.memory_mib) << 20
                util = sum(x.sm_util for c in containers for x in c.devices if x.uuid == d.uuid)
            out.append(HostDeviceUsage(uuid=d.uuid, used_bytes=used, total_bytes=total,
                                       utilization=min(util, 100.0)))
        return out

    async def collect_garbage(self) -> list[str]:
        """Remove directories of pods that are gone (ledger inactive and kubelet lists none).
        A pod kubelet prepared for after those facts were read is left to the next pass (the
        facts predate its bind: removing its directory failed its Allocate)."""
        judged_at = self.store.changes
        ledger = await self._ledger()
        active = {u for u, a in (ledger.allocations.items() if ledger else []) if a.active}
        listed = await self.pod_listing() if self.pod_listing else None
        removed = []
        for cdir_pod in await asyncio.to_thread(self.store.pod_uids):
            if cdir_pod in active:
                continue
            owners = {(c.prepared.namespace, c.prepared.pod)
                      for c in await asyncio.to_thread(self.store.for_pod, cdir_pod)}
            if listed is not None and owners & listed:
                continue
            if await asyncio.to_thread(self.store.remove_pod_unless, cdir_pod, judged_at):
                removed.append(cdir_pod)
        if removed:
            self.log.info("removed container dirs of gone pods", extra={"pods": removed})
        return removed

    async def run(self, stop: asyncio.Event) -> None:
        subject = bus.usage_subject(self.node)
        while not stop.is_set():
            try:
                sample = await self.sample_once()
                await self.nc.publish(subject, encode(sample))
                if time.monotonic() - self._last_gc >= GC_EVERY_S:
                    self._last_gc = time.monotonic()
                    await self.collect_garbage()
            except Exception as exc:
                self.log.warning("usage sampling failed", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def _elastic_compute(limit: DeviceLimit | None) -> dict[str, float]:
    """Elastic compute (docs/elastic.md): the burst limit and the allowance in force (what the
    lender lets it use now; above the guarantee = lent)."""
    if limit is None or not limit.sm_elastic:
        return {}
    allowance = limit.sm_allow_x100 / 100 if limit.sm_allow_x100 else limit.sm_limit_pct
    return {"sm_burst_limit": limit.sm_burst_limit_pct, "sm_allowance": min(allowance, 100.0)}


def _elastic_memory(limit: DeviceLimit | None, used: int) -> dict[str, int]:
    """Elastic memory (docs/elastic.md): the burst limit and what is used beyond the guarantee."""
    if limit is None or not limit.mem_elastic:
        return {}
    return {"burst_limit_bytes": limit.mem_burst_limit_bytes,
            "borrowed_bytes": max(0, used - limit.mem_limit_bytes)}
