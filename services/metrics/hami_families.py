"""HAMi's metric families, with HAMi's names, units and labels, computed from the view. Pure.

Facts used (HAMi's public documentation, not its code):
- HAMi website, docs/userguide/monitoring/device-allocation.md and real-time-device-usage.md
  (v2.9/v2.10, Project-HAMi/website PR #498): `hami_*` names, `zone="vGPU"` on every series,
  core and utilisation `*_ratio` series in percent (a whole card's compute limit reads 100),
  `device_cores` on the allocated-memory series, quota series labelled
  `{quota_name, namespace, limit}` with `quota_name` the resource name (`nvidia.com/gpucores`).
- The same pages' older versions and HAMi issues #555, #1417 and volcano-vgpu-device-plugin PR
  #25 for the pre-`hami_` names (`GPUDeviceCoreLimit{deviceidx,deviceuuid,nodeid,zone}`,
  `vGPUCoreAllocated{containeridx,deviceuuid,nodename,podname,podnamespace,zone}`,
  `QuotaUsed{quotaName,quotanamespace,limit,zone}`, `HostCoreUtilization{deviceidx,deviceuuid}`,
  `Device_utilization_desc_of_container{ctrname,deviceuuid,podname,podnamespace,vdeviceid}`...).
- ../shared/specs/hami-compat.md ("Metrics HAMi users already chart").

Differences, all additive: HAMi's node monitor is scraped per node, Tessera's metrics service
serves every node at once, so the node-side `hami_*` series also carry `node` (and the legacy
host series `nodeid`); the scheduler-side GPU series carry `device_type` (hami-compat.md).
`hami_node_gpu_memory_allocated_ratio` stays a fraction 0..1, as in HAMi (memory, not compute).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from tessera.settings import TesseraSettings

from .summary import MIB, GpuSummary, NodeSummary
from .view import ClusterView

ZONE = "vGPU"

GPU = ("node", "device_uuid", "device_index", "device_type")
VGPU_ALLOC = (*GPU, "namespace", "pod", "container_index")
CONTAINER = ("node", "namespace", "pod", "container", "vdevice_index", "device_uuid")
OVERVIEW = (*GPU, "device_cores", "device_memory_limit", "shared_containers")
QUOTA = ("quota_name", "namespace", "limit")

# Pre-hami_ names (legacyNames).
L_GPU = ("deviceidx", "deviceuuid", "nodeid")
L_VGPU = ("containeridx", "deviceuuid", "nodename", "podname", "podnamespace")
L_HOST = ("deviceidx", "deviceuuid", "nodeid")
L_CONTAINER = ("ctrname", "deviceuuid", "podname", "podnamespace", "vdeviceid")
L_MEMORY_DESC = ("context", "ctrname", "data", "deviceuuid", "module", "offset", "podname",
                 "podnamespace", "vdeviceid")


@dataclass(frozen=True)
class FamilySpec:
    name: str
    doc: str
    labels: tuple[str, ...]
    legacy: bool = False


SPECS: dict[str, FamilySpec] = {s.name: s for s in (
    # scheduler side
    FamilySpec("hami_gpu_memory_limit_bytes", "GPU memory the node advertises (bytes)", GPU),
    FamilySpec("hami_gpu_core_limit_ratio", "GPU compute the node advertises (percent; 100 = "
               "a whole card)", GPU),
    FamilySpec("hami_gpu_memory_allocated_bytes", "GPU memory granted to pods (bytes)",
               (*GPU, "device_cores")),
    FamilySpec("hami_gpu_shared_count", "containers sharing the GPU", GPU),
    FamilySpec("hami_gpu_core_allocated_ratio", "GPU compute granted to pods (percent)", GPU),
    FamilySpec("hami_node_gpu_overview", "GPU memory granted to pods (bytes), one series per "
               "GPU", OVERVIEW),
    FamilySpec("hami_node_gpu_memory_allocated_ratio", "granted / advertised memory (0..1)", GPU),
    FamilySpec("hami_vgpu_memory_allocated_bytes", "GPU memory granted to one container (bytes)",
               VGPU_ALLOC),
    FamilySpec("hami_vgpu_core_allocated_ratio", "GPU compute granted to one container "
               "(percent)", VGPU_ALLOC),
    FamilySpec("hami_resource_quota_used", "namespace quota used (MiB for gpumem, percent of a "
               "card for gpucores, cards for gpu)", QUOTA),
    FamilySpec("hami_resource_quota_limit", "namespace quota limit, same units", QUOTA),
    # node side
    FamilySpec("hami_host_gpu_memory_used_bytes", "GPU memory used on the host (NVML, bytes)",
               GPU),
    FamilySpec("hami_host_gpu_utilization_ratio", "GPU utilisation on the host (percent)", GPU),
    FamilySpec("hami_vgpu_memory_used_bytes", "GPU memory a container uses (bytes)", CONTAINER),
    FamilySpec("hami_vgpu_memory_limit_bytes", "GPU memory limit of a container (bytes)",
               CONTAINER),
    FamilySpec("hami_container_device_utilization_ratio", "compute a container achieves "
               "(percent of the card)", CONTAINER),
    FamilySpec("hami_container_last_kernel_elapsed_seconds", "seconds since the container's "
               "last kernel launch on the GPU", CONTAINER),
    # legacy scheduler side
    FamilySpec("GPUDeviceCoreLimit", "Device core limit for a certain GPU", L_GPU, True),
    FamilySpec("GPUDeviceMemoryLimit", "Device memory limit for a certain GPU", L_GPU, True),
    FamilySpec("GPUDeviceCoreAllocated", "Device core allocated for a certain GPU", L_GPU, True),
    FamilySpec("GPUDeviceMemoryAllocated", "Device memory allocated for a certain GPU",
               ("devicecores", *L_GPU), True),
    FamilySpec("GPUDeviceSharedNum", "Number of containers sharing this GPU", L_GPU, True),
    FamilySpec("vGPUCoreAllocated", "vGPU core allocated from a container", L_VGPU, True),
    FamilySpec("vGPUMemoryAllocated", "vGPU memory allocated from a container", L_VGPU, True),
    FamilySpec("QuotaUsed", "resourcequota usage for a certain device",
               ("quotaName", "quotanamespace", "limit"), True),
    # legacy node monitor
    FamilySpec("HostGPUMemoryUsage", "GPU device memory usage", L_HOST, True),
    FamilySpec("HostCoreUtilization", "GPU core utilization", L_HOST, True),
    FamilySpec("vGPU_device_memory_usage_in_bytes", "vGPU device usage", L_CONTAINER, True),
    FamilySpec("vGPU_device_memory_limit_in_bytes", "vGPU device limit", L_CONTAINER, True),
    FamilySpec("Device_memory_desc_of_container", "Container device memory description",
               L_MEMORY_DESC, True),
    FamilySpec("Device_utilization_desc_of_container", "Container device utilization "
               "description", L_CONTAINER, True),
)}


class Families:
    """The families of one scrape; `add` appends zone="vGPU" to every series."""

    def __init__(self, legacy: bool) -> None:
        self.families = {
            name: GaugeMetricFamily(name, spec.doc, labels=[*spec.labels, "zone"])
            for name, spec in SPECS.items()
            if legacy or not spec.legacy
        }

    def add(self, name: str, labels: tuple[str, ...] | list[str], value: float) -> None:
        family = self.families.get(name)
        if family is not None:
            family.add_metric([*labels, ZONE], value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self.families.values())


def _add_gpu(out: Families, gpu: GpuSummary) -> None:
    device = gpu.device
    labels = (gpu.node, device.uuid, str(device.index), device.type)
    legacy = (str(device.index), device.uuid, gpu.node)
    limit_bytes = device.memory_mib * MIB
    allocated_bytes = gpu.allocated_mib * MIB
    cores = gpu.allocated_cores
    out.add("hami_gpu_memory_limit_bytes", labels, limit_bytes)
    out.add("hami_gpu_core_limit_ratio", labels, device.cores)
    out.add("hami_gpu_memory_allocated_bytes", (*labels, str(cores)), allocated_bytes)
    out.add("hami_gpu_shared_count", labels, len(gpu.slices))
    out.add("hami_gpu_core_allocated_ratio", labels, cores)
    out.add("hami_node_gpu_overview",
            (*labels, str(cores), str(device.memory_mib), str(len(gpu.slices))), allocated_bytes)
    out.add("hami_node_gpu_memory_allocated_ratio", labels,
            allocated_bytes / limit_bytes if limit_bytes else 0.0)
    out.add("GPUDeviceCoreLimit", legacy, device.cores)
    out.add("GPUDeviceMemoryLimit", legacy, limit_bytes)
    out.add("GPUDeviceCoreAllocated", legacy, cores)
    out.add("GPUDeviceMemoryAllocated", (str(cores), *legacy), allocated_bytes)
    out.add("GPUDeviceSharedNum", legacy, len(gpu.slices))
    for piece in gpu.slices:
        index = str(piece.container_index)
        out.add("hami_vgpu_memory_allocated_bytes", (*labels, piece.namespace, piece.pod, index),
                piece.memory_mib * MIB)
        out.add("hami_vgpu_core_allocated_ratio", (*labels, piece.namespace, piece.pod, index),
                piece.cores)
        vlegacy = (index, device.uuid, gpu.node, piece.pod, piece.namespace)
        out.add("vGPUCoreAllocated", vlegacy, piece.cores)
        out.add("vGPUMemoryAllocated", vlegacy, piece.memory_mib * MIB)


def _add_node_usage(out: Families, view: ClusterView, now: float) -> None:
    for node, sample in sorted(view.fresh_usage(now).items()):
        registration = view.nodes.get(node)
        devices = {d.uuid: d for d in registration.devices} if registration else {}
        for host in sample.devices:
            device = devices.get(host.uuid)
            index = str(device.index) if device else ""
            labels = (node, host.uuid, index, device.type if device else "")
            out.add("hami_host_gpu_memory_used_bytes", labels, host.used_bytes)
            out.add("hami_host_gpu_utilization_ratio", labels, host.utilization)
            out.add("HostGPUMemoryUsage", (index, host.uuid, node), host.used_bytes)
            out.add("HostCoreUtilization", (index, host.uuid, node), host.utilization)
        for container in sample.containers:
            for vindex, usage in enumerate(container.devices):
                labels = (node, container.namespace, container.pod, container.container,
                          str(vindex), usage.uuid)
                legacy = (container.container, usage.uuid, container.pod, container.namespace,
                          str(vindex))
                out.add("hami_vgpu_memory_used_bytes", labels, usage.used_bytes)
                out.add("hami_vgpu_memory_limit_bytes", labels, usage.limit_bytes)
                out.add("hami_container_device_utilization_ratio", labels, usage.sm_util)
                if usage.last_kernel_at is not None:
                    out.add("hami_container_last_kernel_elapsed_seconds", labels,
                            max(0.0, sample.at - usage.last_kernel_at))
                out.add("vGPU_device_memory_usage_in_bytes", legacy, usage.used_bytes)
                out.add("vGPU_device_memory_limit_in_bytes", legacy, usage.limit_bytes)
                # Tessera does not split context/module memory out: all of it is `data`.
                out.add("Device_memory_desc_of_container",
                        ("0", container.container, str(usage.used_bytes), usage.uuid, "0", "0",
                         container.pod, container.namespace, str(vindex)), usage.used_bytes)
                out.add("Device_utilization_desc_of_container", legacy, usage.sm_util)


def _add_quotas(out: Families, view: ClusterView, settings: TesseraSettings) -> None:
    """Only resources the namespace limits, as HAMi (it reports ResourceQuota entries)."""
    for namespace, state in sorted(view.quotas.items()):
        current = state.used()
        for resource, used, limit in (
            (settings.resource_mem, current.memory_mib, state.limits.memory_mib),
            (settings.resource_cores, current.cores, state.limits.cores),
            (settings.resource_name, current.gpus, state.limits.gpus),
        ):
            if limit is None:
                continue
            labels = (resource, namespace, str(limit))
            out.add("hami_resource_quota_used", labels, used or 0)
            out.add("hami_resource_quota_limit", labels, limit)
            out.add("QuotaUsed", labels, used or 0)


def hami_families(
    view: ClusterView, nodes: list[NodeSummary], now: float, settings: TesseraSettings
) -> Iterator[Metric]:
    out = Families(settings.legacy_names)
    for node in nodes:
        for gpu in node.gpus:
            _add_gpu(out, gpu)
    _add_node_usage(out, view, now)
    _add_quotas(out, view, settings)
    yield from out
