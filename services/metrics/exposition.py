"""Prometheus metric families computed from the view at scrape time (a custom collector).

HAMi's metrics (names, units, labels, legacy names) are in hami_families.py; Tessera's own
metrics here carry the tessera_ prefix: their ratios are 0..1 (a card's compute = 1.0), memory
is bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tessera.device_kinds import registry
from tessera.models import DeviceInfo
from tessera.settings import TesseraSettings

from .hami_families import hami_families
from .latency import STAGES
from .summary import MIB, GpuSummary, NodeSummary, summarise
from .view import ClusterView

# vendor / device_kind: the device kind serving the card (tessera.device_kinds, its
# `metric_labels`), so that every family shows every kind apart.
GPU_LABELS = ["node", "device_uuid", "device_index", "device_type", "vendor", "device_kind"]
CONTAINER_LABELS = ["node", "namespace", "pod", "container", "vdevice_index", "device_uuid"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _gpu_labels(node: str, device: DeviceInfo) -> list[str]:
    kind = registry.kind_of(device)
    labels = kind.metric_labels(device) if kind is not None else {}
    return [node, device.uuid, str(device.index), device.type, labels.get("vendor", ""),
            labels.get("kind", device.mode)]


def scheduler_families(nodes: list[NodeSummary], view: ClusterView) -> Iterator[Metric]:
    """Tessera's per-GPU ledgers (HAMi's names are in hami_families)."""
    gpus: list[GpuSummary] = [gpu for node in nodes for gpu in node.gpus]
    memory = _gauge("tessera_gpu_memory_bytes", "GPU memory by kind: physical (the card), "
                    "advertised (× scaling), allocated (granted), used (measured on the host), "
                    "containers_used (sum of what containers report)", [*GPU_LABELS, "kind"])
    healthy = _gauge("tessera_gpu_healthy", "1 when the node reports the GPU healthy", GPU_LABELS)
    slots = _gauge("tessera_gpu_slots", "replica slots (pods) the GPU can hold", GPU_LABELS)

    for gpu in gpus:
        labels = _gpu_labels(gpu.node, gpu.device)
        limit_bytes = gpu.device.memory_mib * MIB
        healthy.add_metric(labels, 1.0 if gpu.device.healthy else 0.0)
        slots.add_metric(labels, gpu.device.split_count)
        memory.add_metric([*labels, "physical"], gpu.physical_mib * MIB)
        memory.add_metric([*labels, "advertised"], limit_bytes)
        memory.add_metric([*labels, "allocated"], gpu.allocated_mib * MIB)
        if gpu.host is not None:
            memory.add_metric([*labels, "used"], gpu.host.used_bytes)
        if gpu.containers_used_bytes is not None:
            memory.add_metric([*labels, "containers_used"], gpu.containers_used_bytes)
    yield from (memory, healthy, slots)

    node_up = _gauge("tessera_node_registered", "1 while the node heartbeats its registration",
                     ["node"])
    allocations = _gauge("tessera_allocations", "allocations in the ledger by state",
                         ["node", "state"])
    for node in nodes:
        node_up.add_metric([node.name], 1.0 if node.registered else 0.0)
        ledger = view.ledgers.get(node.name)
        states: dict[str, int] = {}
        for allocation in ledger.allocations.values() if ledger else []:
            states[str(allocation.state)] = states.get(str(allocation.state), 0) + 1
        for state, count in sorted(states.items()):
            allocations.add_metric([node.name, state], count)
    yield node_up
    yield allocations


def node_families(view: ClusterView, now: float) -> Iterator[Metric]:
    """Tessera's per-container compute and sample ages (HAMi's names are in hami_families)."""
    memory = _gauge("tessera_container_memory_bytes", "container GPU memory: guaranteed (what "
                    "it was packed by), burst_limit (elastic: the most it may hold), used, "
                    "borrowed (used beyond the guarantee); a hard slice has no burst_limit or "
                    "borrowed series", [*CONTAINER_LABELS, "kind"])
    compute = _gauge("tessera_container_compute_ratio", "container compute: achieved (last "
                     "window) and limit, 1 = a whole card; an uncapped container has no limit "
                     "series", [*CONTAINER_LABELS, "kind"])
    spill = _gauge("tessera_container_spill_bytes", "host memory a container's GPU allocations "
                   "spilled to (tessera.io/gpumem-spill; all its GPUs, in no device's used): "
                   "spilled, and limit; a container that may not spill has no series",
                   [*CONTAINER_LABELS[:4], "kind"])
    age = _gauge("tessera_usage_sample_age_seconds", "age of the node's latest usage sample",
                 ["node"])
    for node, sample in sorted(view.fresh_usage(now).items()):
        age.add_metric([node], max(0.0, now - view.usage[node].received_at))
        for container in sample.containers:
            if container.spill_limit_bytes:
                who = [node, container.namespace, container.pod, container.container]
                spill.add_metric([*who, "spilled"], container.spilled_bytes)
                spill.add_metric([*who, "limit"], container.spill_limit_bytes)
            for vindex, device_usage in enumerate(container.devices):
                labels = [node, container.namespace, container.pod, container.container,
                          str(vindex), device_usage.uuid]
                memory.add_metric([*labels, "guaranteed"], device_usage.limit_bytes)
                memory.add_metric([*labels, "used"], device_usage.used_bytes)
                if device_usage.burst_limit_bytes:
                    memory.add_metric([*labels, "burst_limit"], device_usage.burst_limit_bytes)
                    memory.add_metric([*labels, "borrowed"], device_usage.borrowed_bytes)
                compute.add_metric([*labels, "achieved"], device_usage.sm_util / 100)
                if device_usage.sm_limit > 0:  # 0 = uncapped: no limit, not a limit of 0
                    compute.add_metric([*labels, "limit"], device_usage.sm_limit / 100)
    yield from (memory, compute, spill, age)


def quota_families(view: ClusterView) -> Iterator[Metric]:
    """Namespace quotas under Tessera's names (HAMi's are in hami_families)."""
    used = _gauge("tessera_quota_used", "quota used: memory_bytes, cores (1 = a card), gpus",
                  ["namespace", "resource"])
    limit = _gauge("tessera_quota_limit", "quota limit (absent = unlimited)",
                   ["namespace", "resource"])
    for namespace, state in sorted(view.quotas.items()):
        current = state.used()
        for own_name, scale, used_value, limit_value in (
            ("memory_bytes", MIB, current.memory_mib, state.limits.memory_mib),
            ("cores", 0.01, current.cores, state.limits.cores),
            ("gpus", 1, current.gpus, state.limits.gpus),
        ):
            used.add_metric([namespace, own_name], (used_value or 0) * scale)
            if limit_value is not None:
                limit.add_metric([namespace, own_name], limit_value * scale)
    yield from (used, limit)


def _counter(name: str, doc: str, labels: list[str],
             values: Iterable[tuple[Iterable[str], float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family


def event_families(view: ClusterView, now: float) -> Iterator[Metric]:
    """Counters and histograms folded from the event stream (rebuilt by replay on restart)."""
    latency = HistogramMetricFamily(
        "tessera_scheduling_latency_seconds",
        "time between steps of a pod's placement, from event timestamps (admission → bound → "
        "allocated → running; running = first usage sample, observed live only)",
        labels=["stage"],
    )
    for stage in STAGES:
        histogram = view.latency.histograms[stage]
        latency.add_metric([stage], histogram.cumulative(), histogram.total)
    yield latency
    yield _counter("tessera_scheduling_failures", "pods the scheduler could not place",
                   ["namespace"], (([ns], n) for ns, n in sorted(view.sched_failures.items())))
    yield _counter("tessera_scheduling_refusals", "node refusals by reason (one per node and "
                   "reason in each failed attempt)", ["reason"],
                   (([r], n) for r, n in sorted(view.refusals.items())))
    yield _counter("tessera_memory_reclaim_events", "elastic memory taken back from borrowers "
                   "for a guarantee (reclaimed) and borrowers evicted (evicted)",
                   ["node", "action"],
                   ((list(k), n) for k, n in sorted(view.memory_reclaims.items())))
    yield _counter("tessera_compute_reclaims", "elastic compute lent beyond a guarantee "
                   "taken back because neighbours woke (summed from the coalesced "
                   "ComputeReclaimEvents)", ["node"],
                   (([node], n) for node, n in sorted(view.compute_reclaims.items())))
    yield _counter("tessera_oom_events", "containers that hit their GPU memory limit",
                   ["node", "namespace", "pod", "container"],
                   ((list(k), n) for k, n in sorted(view.ooms.items())))
    yield _counter("tessera_limit_breaches", "the node agents' watchdog saw a slice beyond its "
                   "limits on the GPU itself (NVML), by reason: memory, compute, tampered",
                   ["reason"], (([r], n) for r, n in sorted(view.limit_breaches.items())))
    yield _counter("tessera_allocation_events", "allocation events by node and action",
                   ["node", "action"],
                   ((list(k), n) for k, n in sorted(view.alloc_events.items())))
    yield _counter("tessera_admission_events", "admission decisions by namespace and action",
                   ["namespace", "action"],
                   ((list(k), n) for k, n in sorted(view.admission_events.items())))
    yield _counter("tessera_quota_events", "quota events by namespace and action",
                   ["namespace", "action"],
                   ((list(k), n) for k, n in sorted(view.quota_events.items())))
    yield _counter("tessera_node_events", "node events by node and action", ["node", "action"],
                   ((list(k), n) for k, n in sorted(view.node_events.items())))
    yield _counter("tessera_bus_bad_messages", "bus messages that could not be decoded, by "
                   "source (garbage, unknown schema or version)", ["source"],
                   (([s], n) for s, n in sorted(view.bad_messages.items())))
    yield _counter("tessera_bus_rejected", "bus values that decoded but failed validation "
                   "(never applied), by source and reason", ["source", "reason"],
                   ((list(k), n) for k, n in sorted(view.rejected.items())))
    pending = _gauge("tessera_pods_pending", "pods refused by the scheduler and not placed yet",
                     ["namespace"])
    by_namespace: dict[str, int] = {}
    for pod in view.pending_pods(now):
        by_namespace[pod.namespace] = by_namespace.get(pod.namespace, 0) + 1
    for namespace, count in sorted(by_namespace.items()):
        pending.add_metric([namespace], count)
    yield pending
    synced = GaugeMetricFamily("tessera_metrics_synced", "1 once the KV buckets are loaded and "
                               "the event stream is replayed")
    synced.add_metric([], 1.0 if view.synced else 0.0)
    yield synced
    applied = CounterMetricFamily("tessera_metrics_events_applied", "events folded into the view")
    applied.add_metric([], view.events_applied)
    yield applied


class ViewCollector(Collector):
    """Registered in a private CollectorRegistry; computes everything at scrape time."""

    def __init__(
        self, view: ClusterView, settings: TesseraSettings, clock: Callable[[], float]
    ) -> None:
        self.view = view
        self.settings = settings
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        nodes = summarise(self.view, now)
        yield from hami_families(self.view, nodes, now, self.settings)
        yield from scheduler_families(nodes, self.view)
        yield from node_families(self.view, now)
        yield from quota_families(self.view)
        yield from event_families(self.view, now)
