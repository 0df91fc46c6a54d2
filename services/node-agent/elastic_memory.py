"""Elastic memory in the node agent (issue 33, docs/elastic.md): what the lease service needs
from the rest of the agent — each card's physical memory, and what happens when borrowed memory
is reclaimed (a MemoryReclaimEvent on the bus, a Warning event on the borrower's pod, and, for a
borrower that opted in or kept the memory past the node's grace bound, its eviction through the
cluster API)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from nats.js import JetStreamContext
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera import bus
from tessera.cluster.port import ClusterError, ClusterPort, ObjectRef
from tessera.models import DeviceInfo, MemoryReclaimEvent

from .leases import LeaseService, ReclaimNotice

MiB = 1 << 20


def card_memory(devices: Callable[[], list[DeviceInfo]]) -> Callable[[str], int]:
    """uuid -> the card's physical memory in bytes (0: not one of this node's cards)."""

    def of(uuid: str) -> int:
        for d in devices():
            if d.uuid == uuid:
                return (d.physical_memory_mib or d.memory_mib) * MiB
        return 0

    return of


class ReclaimReporter:
    """The lease service's `on_reclaim`: say so on the bus and on the pod; evict when asked."""

    def __init__(self, *, node: str, js: JetStreamContext | None, cluster: ClusterPort | None,
                 log: logging.Logger, source: str, evict_grace_s: int) -> None:  # fmt: skip
        self.node, self.js, self.cluster, self.log = node, js, cluster, log
        self.source, self.evict_grace_s = source, evict_grace_s

    async def __call__(self, notice: ReclaimNotice) -> None:
        p = notice.borrower.prepared
        namespace, pod, container = (p.namespace, p.pod, p.container) if p else ("", "", "")
        gib = notice.borrowed_bytes / (1 << 30)
        if notice.action == "evicted" and notice.by_node:
            reason, message = "GpuMemoryBorrowerEvicted", (
                f"evicted: it held {gib:.2f} GiB beyond its guarantee on {notice.device_uuid}, "
                f"which {notice.for_pod or 'a guaranteed neighbour'} needed, and did not give "
                f"it back within {notice.after_s:.0f} s (the node's policy: "
                "TESSERA_MEMORY_RECLAIM_ENFORCEMENT=evict)")
        elif notice.action == "evicted":
            reason, message = "GpuMemoryBorrowerEvicted", (
                f"evicted: it held {gib:.2f} GiB beyond its guarantee on {notice.device_uuid}, "
                f"which {notice.for_pod or 'a guaranteed neighbour'} needed "
                "(tessera.io/gpumem-reclaim: evict)")
        else:
            reason, message = "GpuMemoryReclaimed", (
                f"{gib:.2f} GiB held beyond its guarantee on {notice.device_uuid} are needed by "
                f"{notice.for_pod or 'a guaranteed neighbour'}: allocations beyond the guarantee "
                "fail until it frees memory")
        if self.js is not None:
            try:
                await bus.publish_event(self.js, MemoryReclaimEvent(
                    action=notice.action, node=self.node, device_uuid=notice.device_uuid,
                    pod_uid=notice.borrower.pod_uid, namespace=namespace, pod=pod,
                    container=container, borrowed_bytes=notice.borrowed_bytes,
                    short_bytes=max(0, notice.short_bytes), for_pod=notice.for_pod,
                    by_node=notice.by_node, source=self.source, reason=message))  # fmt: skip
            except Exception as exc:
                self.log.warning("memory event not published", extra={"err": str(exc)})
        if self.cluster is None or not pod:
            return
        ref = ObjectRef(namespace=namespace, name=pod, uid=notice.borrower.pod_uid)
        if notice.action == "evicted":
            try:
                await self.cluster.evict_pod(namespace, pod, notice.borrower.pod_uid,
                                             grace_period_s=self.evict_grace_s)  # fmt: skip
            except ClusterError as exc:
                message = f"{message}; the eviction failed: {exc}"
                self.log.warning("borrower not evicted", extra={"pod": f"{namespace}/{pod}",
                                                                "err": str(exc)})  # fmt: skip
        try:
            await self.cluster.record_event(ref, reason, message, "Warning")
        except Exception as exc:  # best effort, as every Event
            self.log.warning("pod event not recorded", extra={"err": str(exc)})


class LeaseCollector(Collector):
    """The lease service at scrape time: per container and GPU what is guaranteed, the burst
    limit, what is leased and borrowed (leased beyond the guarantee), and the service's
    counters (reclaims, borrowers evicted, requests that waited, refused beyond a guarantee)."""

    def __init__(self, leases: LeaseService) -> None:
        self.leases = leases

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "pod", "container", "device_uuid", "kind"]
        memory = GaugeMetricFamily(
            "tessera_node_agent_lease_bytes", "the lease service's account per container and "
            "GPU: guaranteed, limit (burst limit; = guaranteed for a hard slice), leased, "
            "borrowed (leased beyond the guarantee)", labels=labels)
        waits = refused = 0
        for c, uuid, h in self.leases.memory_view():
            p = c.prepared
            who = [p.namespace, p.pod, p.container] if p else ["", c.key, ""]
            for kind, value in (("guaranteed", h.guarantee), ("limit", h.limit),
                                ("leased", h.leased), ("borrowed", h.borrowed)):
                memory.add_metric([*who, uuid, kind], value)
        for c in self.leases.served.values():
            waits += c.waits
            refused += c.refused_borrow
        yield memory
        for name, doc, value in (
            ("tessera_node_agent_lease_reclaims", "guaranteed requests that found borrowers "
             "holding their GPU's memory (a reclaim began)", self.leases.reclaims),
            ("tessera_node_agent_lease_evictions", "borrowing pods evicted for a guarantee "
             "(tessera.io/gpumem-reclaim: evict, or past the grace bound under "
             "TESSERA_MEMORY_RECLAIM_ENFORCEMENT=evict)", len(self.leases.evicted)),
            ("tessera_node_agent_lease_waits", "lease requests that waited (a reclaim, or "
             "tessera.io/gpumem-wait-seconds)", waits),
            ("tessera_node_agent_lease_borrow_refusals", "requests beyond a guarantee refused: "
             "no memory to lend on the GPU", refused),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], value)
            yield counter
