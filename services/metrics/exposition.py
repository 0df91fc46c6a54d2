"""Prometheus metric families computed from the view at scrape time (a custom collector).

HAMi's scheduler metrics (hami_gpu_*, hami_node_*, hami_resource_quota_*, hami_vgpu_*) and its
node metrics (hami_host_*, hami_vgpu_memory_*, hami_container_*) keep their names and labels so
existing dashboards and alerts work; Tessera's own metrics carry the tessera_ prefix.
Ratios are 0..1 (100 % of a card's compute = 1.0); memory is bytes.
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

from tessera.models import DeviceInfo
from tessera.settings import TesseraSettings

from .latency import STAGES
from .summary import MIB, GpuSummary, summarise
from .view import ClusterView

GPU_LABELS = ["node", "device_uuid", "device_index", "device_type"]
VGPU_ALLOC_LABELS = [*GPU_LABELS, "namespace", "pod", "container_index"]
CONTAINER_LABELS = ["node", "namespace", "pod", "container", "vdevice_index", "device_uuid"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _gpu_labels(node: str, device: DeviceInfo) -> list[str]:
    return [node, device.uuid, str(device.index), device.type]


def scheduler_families(view: ClusterView, now: float) -> Iterator[Metric]:
    """HAMi's scheduler-side metrics and Tessera's per-GPU memory ledgers."""
    nodes = summarise(view, now)
    gpus: list[GpuSummary] = [gpu for node in nodes for gpu in node.gpus]

    mem_limit = _gauge("hami_gpu_memory_limit_bytes", "GPU memory the node advertises", GPU_LABELS)
    core_limit = _gauge("hami_gpu_core_limit_ratio", "GPU compute the node advertises "
                        "(1 = a whole card)", GPU_LABELS)
    mem_alloc = _gauge("hami_gpu_memory_allocated_bytes", "GPU memory granted to pods",
                       GPU_LABELS)
    shared = _gauge("hami_gpu_shared_count", "containers sharing the GPU", GPU_LABELS)
    core_alloc = _gauge("hami_gpu_core_allocated_ratio", "GPU compute granted to pods",
                        GPU_LABELS)
    overview = _gauge("hami_node_gpu_overview", "GPU memory granted to pods, one series per GPU "
                      "of every node", GPU_LABELS)
    mem_ratio = _gauge("hami_node_gpu_memory_allocated_ratio", "granted / advertised memory",
                       GPU_LABELS)
    vgpu_mem = _gauge("hami_vgpu_memory_allocated_bytes", "GPU memory granted to one container",
                      VGPU_ALLOC_LABELS)
    vgpu_core = _gauge("hami_vgpu_core_allocated_ratio", "GPU compute granted to one container",
                       VGPU_ALLOC_LABELS)
    memory = _gauge("tessera_gpu_memory_bytes", "GPU memory by kind: physical (the card), "
                    "advertised (× scaling), allocated (granted), used (measured on the host), "
                    "containers_used (sum of what containers report)", [*GPU_LABELS, "kind"])
    healthy = _gauge("tessera_gpu_healthy", "1 when the node reports the GPU healthy", GPU_LABELS)
    slots = _gauge("tessera_gpu_slots", "replica slots (pods) the GPU can hold", GPU_LABELS)

    for gpu in gpus:
        labels = _gpu_labels(gpu.node, gpu.device)
        limit_bytes = gpu.device.memory_mib * MIB
        allocated_bytes = gpu.allocated_mib * MIB
        mem_limit.add_metric(labels, limit_bytes)
        core_limit.add_metric(labels, gpu.device.cores / 100)
        mem_alloc.add_metric(labels, allocated_bytes)
        shared.add_metric(labels, len(gpu.slices))
        core_alloc.add_metric(labels, gpu.allocated_cores / 100)
        overview.add_metric(labels, allocated_bytes)
        mem_ratio.add_metric(labels, allocated_bytes / limit_bytes if limit_bytes else 0.0)
        healthy.add_metric(labels, 1.0 if gpu.device.healthy else 0.0)
        slots.add_metric(labels, gpu.device.split_count)
        memory.add_metric([*labels, "physical"], gpu.physical_mib * MIB)
        memory.add_metric([*labels, "advertised"], limit_bytes)
        memory.add_metric([*labels, "allocated"], allocated_bytes)
        if gpu.host is not None:
            memory.add_metric([*labels, "used"], gpu.host.used_bytes)
        if gpu.containers_used_bytes is not None:
            memory.add_metric([*labels, "containers_used"], gpu.containers_used_bytes)
        for piece in gpu.slices:
            slice_labels = [*labels, piece.namespace, piece.pod, str(piece.container_index)]
            vgpu_mem.add_metric(slice_labels, piece.memory_mib * MIB)
            vgpu_core.add_metric(slice_labels, piece.cores / 100)
    yield from (mem_limit, core_limit, mem_alloc, shared, core_alloc, overview, mem_ratio,
                vgpu_mem, vgpu_core, memory, healthy, slots)

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
    """HAMi's node-side metrics, from the latest usage sample of each node."""
    host_mem = _gauge("hami_host_gpu_memory_used_bytes", "GPU memory used on the host (NVML)",
                      GPU_LABELS)
    host_util = _gauge("hami_host_gpu_utilization_ratio", "GPU utilization on the host",
                       GPU_LABELS)
    used = _gauge("hami_vgpu_memory_used_bytes", "GPU memory a container uses", CONTAINER_LABELS)
    limit = _gauge("hami_vgpu_memory_limit_bytes", "GPU memory limit of a container",
                   CONTAINER_LABELS)
    util = _gauge("hami_container_device_utilization_ratio", "compute a container achieves",
                  CONTAINER_LABELS)
    kernel = _gauge("hami_container_last_kernel_elapsed_seconds", "seconds since the "
                    "container's last kernel launch on the GPU", CONTAINER_LABELS)
    compute = _gauge("tessera_container_compute_ratio", "container compute: achieved (last "
                     "window) and limit", [*CONTAINER_LABELS, "kind"])
    age = _gauge("tessera_usage_sample_age_seconds", "age of the node's latest usage sample",
                 ["node"])
    for node, sample in sorted(view.fresh_usage(now).items()):
        registration = view.nodes.get(node)
        devices = {d.uuid: d for d in registration.devices} if registration else {}
        age.add_metric([node], max(0.0, now - view.usage[node].received_at))
        for host in sample.devices:
            device = devices.get(host.uuid)
            labels = [node, host.uuid, str(device.index) if device else "",
                      device.type if device else ""]
            host_mem.add_metric(labels, host.used_bytes)
            host_util.add_metric(labels, host.utilization / 100)
        for container in sample.containers:
            for vindex, device_usage in enumerate(container.devices):
                labels = [node, container.namespace, container.pod, container.container,
                          str(vindex), device_usage.uuid]
                used.add_metric(labels, device_usage.used_bytes)
                limit.add_metric(labels, device_usage.limit_bytes)
                util.add_metric(labels, device_usage.sm_util / 100)
                compute.add_metric([*labels, "achieved"], device_usage.sm_util / 100)
                compute.add_metric([*labels, "limit"], device_usage.sm_limit / 100)
                if device_usage.last_kernel_at is not None:
                    kernel.add_metric(labels, max(0.0, sample.at - device_usage.last_kernel_at))
    yield from (host_mem, host_util, used, limit, util, kernel, compute, age)


def quota_families(view: ClusterView, settings: TesseraSettings) -> Iterator[Metric]:
    """Namespace quotas, under HAMi's names (resource = the quota key) and Tessera's."""
    hami_used = _gauge("hami_resource_quota_used", "quota used by namespace and resource",
                       ["namespace", "resource"])
    hami_limit = _gauge("hami_resource_quota_limit", "quota limit by namespace and resource",
                        ["namespace", "resource"])
    used = _gauge("tessera_quota_used", "quota used: memory_bytes, cores (1 = a card), gpus",
                  ["namespace", "resource"])
    limit = _gauge("tessera_quota_limit", "quota limit (absent = unlimited)",
                   ["namespace", "resource"])
    for namespace, state in sorted(view.quotas.items()):
        current = state.used()
        for hami_name, own_name, scale, used_value, limit_value in (
            (f"limits.{settings.resource_mem}", "memory_bytes", MIB, current.memory_mib,
             state.limits.memory_mib),
            (f"limits.{settings.resource_cores}", "cores", 0.01, current.cores,
             state.limits.cores),
            (f"limits.{settings.resource_name}", "gpus", 1, current.gpus, state.limits.gpus),
        ):
            hami_used.add_metric([namespace, hami_name], used_value or 0)
            used.add_metric([namespace, own_name], (used_value or 0) * scale)
            if limit_value is not None:
                hami_limit.add_metric([namespace, hami_name], limit_value)
                limit.add_metric([namespace, own_name], limit_value * scale)
    yield from (hami_used, hami_limit, used, limit)


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
        yield from scheduler_families(self.view, now)
        yield from node_families(self.view, now)
        yield from quota_families(self.view, self.settings)
        yield from event_families(self.view, now)
