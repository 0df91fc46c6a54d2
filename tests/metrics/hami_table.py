"""HAMi's metrics as its users chart them: name -> label set (zone included) and unit.

Written from HAMi's documentation, not from Tessera's code: the HAMi website's monitoring pages
(docs/userguide/monitoring/device-allocation.md and real-time-device-usage.md, v2.9/v2.10
names per Project-HAMi/website PR #498; the pre-hami_ names from the same pages' earlier
versions, HAMi issues #555 and #1417 and volcano-vgpu-device-plugin PR #25) and
../shared/specs/hami-compat.md. Where Tessera adds a label (one metrics service for every node:
`node` on node-side series, `nodeid` on legacy host series; `device_type` from hami-compat.md)
the README says so.

Units: "percent" = 0..100 (a whole card's compute is 100, a 50 % slice reads 50); "bytes";
"MiB"; "count"; "fraction" = 0..1; "seconds".
"""

from __future__ import annotations

GPU = {"node", "device_uuid", "device_index", "device_type", "zone"}
VGPU = GPU | {"namespace", "pod", "container_index"}
CONTAINER = {"node", "namespace", "pod", "container", "vdevice_index", "device_uuid", "zone"}
L_GPU = {"deviceidx", "deviceuuid", "nodeid", "zone"}
L_VGPU = {"containeridx", "deviceuuid", "nodename", "podname", "podnamespace", "zone"}
L_CONTAINER = {"ctrname", "deviceuuid", "podname", "podnamespace", "vdeviceid", "zone"}

HAMI: dict[str, tuple[set[str], str]] = {
    "hami_gpu_memory_limit_bytes": (GPU, "bytes"),
    "hami_gpu_core_limit_ratio": (GPU, "percent"),
    "hami_gpu_memory_allocated_bytes": (GPU | {"device_cores"}, "bytes"),
    "hami_gpu_shared_count": (GPU, "count"),
    "hami_gpu_core_allocated_ratio": (GPU, "percent"),
    "hami_node_gpu_overview": (GPU | {"device_cores", "device_memory_limit",
                                      "shared_containers"}, "bytes"),
    "hami_node_gpu_memory_allocated_ratio": (GPU, "fraction"),
    "hami_vgpu_memory_allocated_bytes": (VGPU, "bytes"),
    "hami_vgpu_core_allocated_ratio": (VGPU, "percent"),
    "hami_resource_quota_used": ({"quota_name", "namespace", "limit", "zone"}, "quota units"),
    "hami_resource_quota_limit": ({"quota_name", "namespace", "limit", "zone"}, "quota units"),
    "hami_host_gpu_memory_used_bytes": (GPU, "bytes"),
    "hami_host_gpu_utilization_ratio": (GPU, "percent"),
    "hami_vgpu_memory_used_bytes": (CONTAINER, "bytes"),
    "hami_vgpu_memory_limit_bytes": (CONTAINER, "bytes"),
    "hami_container_device_utilization_ratio": (CONTAINER, "percent"),
    "hami_container_last_kernel_elapsed_seconds": (CONTAINER, "seconds"),
}

LEGACY: dict[str, tuple[set[str], str]] = {
    "GPUDeviceCoreLimit": (L_GPU, "percent"),
    "GPUDeviceMemoryLimit": (L_GPU, "bytes"),
    "GPUDeviceCoreAllocated": (L_GPU, "percent"),
    "GPUDeviceMemoryAllocated": (L_GPU | {"devicecores"}, "bytes"),
    "GPUDeviceSharedNum": (L_GPU, "count"),
    "vGPUCoreAllocated": (L_VGPU, "percent"),
    "vGPUMemoryAllocated": (L_VGPU, "bytes"),
    "QuotaUsed": ({"quotaName", "quotanamespace", "limit", "zone"}, "quota units"),
    "HostGPUMemoryUsage": (L_GPU, "bytes"),
    "HostCoreUtilization": (L_GPU, "percent"),
    "vGPU_device_memory_usage_in_bytes": (L_CONTAINER, "bytes"),
    "vGPU_device_memory_limit_in_bytes": (L_CONTAINER, "bytes"),
    "Device_memory_desc_of_container": (L_CONTAINER | {"context", "data", "module", "offset"},
                                        "bytes"),
    "Device_utilization_desc_of_container": (L_CONTAINER, "percent"),
}

# hami_* name -> its legacy twin (same value).
TWINS = {
    "hami_gpu_core_limit_ratio": "GPUDeviceCoreLimit",
    "hami_gpu_memory_limit_bytes": "GPUDeviceMemoryLimit",
    "hami_gpu_core_allocated_ratio": "GPUDeviceCoreAllocated",
    "hami_gpu_memory_allocated_bytes": "GPUDeviceMemoryAllocated",
    "hami_gpu_shared_count": "GPUDeviceSharedNum",
    "hami_vgpu_core_allocated_ratio": "vGPUCoreAllocated",
    "hami_vgpu_memory_allocated_bytes": "vGPUMemoryAllocated",
    "hami_resource_quota_used": "QuotaUsed",
    "hami_host_gpu_memory_used_bytes": "HostGPUMemoryUsage",
    "hami_host_gpu_utilization_ratio": "HostCoreUtilization",
    "hami_vgpu_memory_used_bytes": "vGPU_device_memory_usage_in_bytes",
    "hami_vgpu_memory_limit_bytes": "vGPU_device_memory_limit_in_bytes",
    "hami_container_device_utilization_ratio": "Device_utilization_desc_of_container",
}

# The scheduler's own /metrics.
SCHEDULER = {
    "hami_scheduler_filter_total": {"result"},
    "hami_scheduler_filter_duration_seconds_bucket": {"le"},
    "hami_scheduler_bind_total": {"result"},
    "hami_scheduler_allocation_failures_total": {"reason"},
    "hami_build_info": {"version", "implementation"},
}


def label_sets(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label dicts of its samples, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append({**sample.labels, "__value__": sample.value})
    return out


def check_labels(samples: dict[str, list[dict[str, str]]],
                 table: dict[str, tuple[set[str], str]]) -> list[str]:
    """Every series of a tabled name has exactly the tabled labels and zone="vGPU"."""
    problems = []
    for name, (labels, _unit) in table.items():
        for sample in samples.get(name, []):
            got = set(sample) - {"__value__"}
            if got != labels:
                problems.append(f"{name}: labels {sorted(got)} != {sorted(labels)}")
            if sample.get("zone") != "vGPU":
                problems.append(f"{name}: zone={sample.get('zone')!r}")
    return problems
