"""HAMi's metrics, as its dashboards and alerts read them: names, units (percent), labels,
zone="vGPU", the legacy names behind legacyNames, and no compute limit of 0 for uncapped
containers. The expected names and labels are the table in hami_table.py (from HAMi's docs)."""

from __future__ import annotations

from hami_table import HAMI, LEGACY, TWINS, check_labels, label_sets
from metrics_testkit import (
    MIB,
    Exposition,
    allocation,
    container_usage,
    ledger,
    registration,
    usage,
)
from prometheus_client import generate_latest
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.models import HostDeviceUsage, QuotaAmount, QuotaCharge, QuotaState
from tessera.settings import TesseraSettings

NOW = 1_800_000_000.0


def cluster() -> ClusterView:
    """One node, two GPUs: GPU 0 holds a 50 % / 20 000 MiB slice and an uncapped 4 000 MiB one;
    the usage sample reports both containers and the host; team-a has a quota."""
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=2))
    capped = allocation("n1", "team-a", "train", [[("GPU-n1-0", 20_000, 50)]], names=["main"])
    free = allocation("n1", "team-b", "notebook", [[("GPU-n1-0", 4_000, 0)]], names=["nb"])
    view.put_ledger("n1", ledger("n1", capped, free))
    view.put_usage(usage("n1", NOW - 1, [
        container_usage(capped, "main", "GPU-n1-0", 12_000, 20_000, 45.0, 50,
                        last_kernel_at=NOW - 2),
        container_usage(free, "nb", "GPU-n1-0", 1_000, 4_000, 30.0, 0),
    ], [HostDeviceUsage(uuid="GPU-n1-0", used_bytes=13_500 * MIB, total_bytes=80 * 1024 * MIB,
                        utilization=75.0)]), received_at=NOW - 1)
    view.put_quota("team-a", QuotaState(
        namespace="team-a", limits=QuotaAmount(memory_mib=40_000, cores=200),
        charges={"u": QuotaCharge(pod_uid="u", memory_mib=20_000, cores=50, gpus=1)},
    ))
    return view


def scrape(view: ClusterView, legacy: bool) -> str:
    settings = TesseraSettings(legacy_names=legacy)
    return generate_latest(build_registry(view, settings, lambda: NOW)).decode()


def test_ratios_are_percent_and_series_carry_hami_labels() -> None:
    text = scrape(cluster(), legacy=False)
    m = Exposition(text)
    gpu0 = {"node": "n1", "device_uuid": "GPU-n1-0", "device_index": "0",
            "device_type": "NVIDIA-H200", "zone": "vGPU"}
    # An alert `hami_gpu_core_allocated_ratio > 80` must see 50 for a 50 % slice.
    assert m.value("hami_gpu_core_limit_ratio", **gpu0) == 100
    assert m.value("hami_gpu_core_allocated_ratio", **gpu0) == 50
    assert m.value("hami_vgpu_core_allocated_ratio", pod="train", **gpu0) == 50
    assert m.value("hami_vgpu_core_allocated_ratio", pod="notebook", **gpu0) == 0
    assert m.value("hami_host_gpu_utilization_ratio", **gpu0) == 75
    ctr = {"namespace": "team-a", "pod": "train", "container": "main", "vdevice_index": "0"}
    assert m.value("hami_container_device_utilization_ratio", **ctr) == 45
    # device_cores on the allocated-memory series; the overview's HAMi labels.
    assert m.value("hami_gpu_memory_allocated_bytes", device_cores="50", **gpu0) == 24_000 * MIB
    assert m.value("hami_node_gpu_overview", device_cores="50", device_memory_limit="81920",
                   shared_containers="2", **gpu0) == 24_000 * MIB
    assert m.value("hami_node_gpu_memory_allocated_ratio", **gpu0) == 24_000 / 81_920
    # Quota series: HAMi's labels, the limit as a label too; cores in percent of a card.
    assert m.value("hami_resource_quota_used", quota_name="nvidia.com/gpucores",
                   namespace="team-a", limit="200", zone="vGPU") == 50
    assert m.value("hami_resource_quota_limit", quota_name="nvidia.com/gpumem",
                   namespace="team-a") == 40_000
    problems = check_labels(label_sets(text), HAMI)
    assert not problems, problems
    for name in HAMI:
        assert m.samples(name), f"{name} not published"
    assert not any(m.samples(name) for name in LEGACY), "legacy names are off by default"


def test_uncapped_container_publishes_no_compute_limit() -> None:
    m = Exposition(scrape(cluster(), legacy=False))
    capped = {"pod": "train", "container": "main"}
    uncapped = {"pod": "notebook", "container": "nb"}
    assert m.value("tessera_container_compute_ratio", kind="limit", **capped) == 0.5
    assert m.value("tessera_container_compute_ratio", kind="achieved", **uncapped) == 0.3
    # No limit is not a limit of 0: `achieved > limit` must not fire on uncapped containers.
    assert m.value("tessera_container_compute_ratio", kind="limit", **uncapped) is None
    assert all(s.value > 0 for s in m.samples("tessera_container_compute_ratio", kind="limit"))


def test_legacy_names_behind_one_switch_same_values() -> None:
    text = scrape(cluster(), legacy=True)
    m = Exposition(text)
    samples = label_sets(text)
    problems = check_labels(samples, LEGACY)
    assert not problems, problems
    for name in LEGACY:
        assert m.samples(name), f"{name} not published with legacyNames"
    assert m.value("GPUDeviceCoreLimit", deviceidx="0", deviceuuid="GPU-n1-0", nodeid="n1",
                   zone="vGPU") == 100
    assert m.value("GPUDeviceCoreAllocated", deviceuuid="GPU-n1-0") == 50
    assert m.value("GPUDeviceMemoryAllocated", deviceuuid="GPU-n1-0",
                   devicecores="50") == 24_000 * MIB
    assert m.value("vGPUCoreAllocated", podname="train", podnamespace="team-a",
                   containeridx="0", nodename="n1") == 50
    assert m.value("QuotaUsed", quotaName="nvidia.com/gpumem", quotanamespace="team-a",
                   limit="40000") == 20_000
    assert m.value("HostCoreUtilization", deviceuuid="GPU-n1-0") == 75
    assert m.value("Device_utilization_desc_of_container", ctrname="main", podname="train",
                   vdeviceid="0") == 45
    assert m.value("vGPU_device_memory_usage_in_bytes", ctrname="nb") == 1_000 * MIB
    # Same values as the hami_ twins, series for series (counted by value multiset).
    for hami_name, legacy_name in TWINS.items():
        ours = sorted(s["__value__"] for s in samples.get(hami_name, []))
        theirs = sorted(s["__value__"] for s in samples.get(legacy_name, []))
        assert ours == theirs and ours, (hami_name, legacy_name, ours, theirs)
