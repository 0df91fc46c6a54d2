"""Every vendor's devices in HAMi's metric families and on the dashboard: an Ascend NPU, a
Cambricon MLU and a Hygon DCU registered beside an NVIDIA GPU, each holding a grant, show under
HAMi's names with their own device type."""

from __future__ import annotations

from metrics_testkit import ledger
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, NodeRegistration
from tessera.settings import TesseraSettings

NOW = 1_800_000_000.0
DEVICES = {  # node -> (type, memory MiB, cores, mode, granted MiB, granted cores)
    "gpu": ("NVIDIA-A10", 24576, 100, "hami-core", 3000, 30),
    "npu": ("Ascend910B3", 65536, 20, "ascend910b3-vnpu", 16384, 5),
    "mlu": ("MLU370-X4", 24576, 100, "smlu", 4096, 50),
    "dcu": ("DCU-Z100L", 32768, 100, "vdcu", 2000, 60),
}


def view() -> ClusterView:
    v = ClusterView()
    for node, (kind, memory, cores, mode, granted, share) in DEVICES.items():
        v.put_node(node, NodeRegistration(node=node, heartbeat_at=NOW, devices=[DeviceInfo(
            uuid=f"{node}-0", index=0, type=kind, memory_mib=memory, cores=cores,
            split_count=4, mode=mode)]))
        v.put_ledger(node, ledger(node, Allocation(
            pod_uid=f"uid-{node}", namespace="ns", name=f"pod-{node}", node=node,
            containers=[[DeviceGrant(uuid=f"{node}-0", type=kind, memory_mib=granted,
                                     cores=share)]],
            container_names=["main"], state=AllocationState.ALLOCATED)))
    return v


def test_every_vendor_under_hamis_metric_names() -> None:
    text = generate_latest(build_registry(view(), TesseraSettings(), lambda: NOW)).decode()
    samples = {(s.name, s.labels.get("device_type")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    for kind, memory, _, _, granted, _ in DEVICES.values():
        assert samples[("hami_gpu_memory_limit_bytes", kind)] == memory << 20, kind
        assert samples[("hami_vgpu_memory_allocated_bytes", kind)] == granted << 20, kind


def test_the_dashboard_shows_every_vendors_devices() -> None:
    state = dashboard_state(view(), NOW)
    types = {n["name"]: [g["type"] for g in n["gpus"]] for n in state["nodes"]}
    assert types == {node: [spec[0]] for node, spec in DEVICES.items()}
    # each labelled as its vendor calls it ("NPU 0 · Ascend910B3", not "GPU 0")
    words = {n["name"]: [(g["device_word"], g["vendor"]) for g in n["gpus"]]
             for n in state["nodes"]}  # fmt: skip
    assert words == {"gpu": [("GPU", "NVIDIA")], "npu": [("NPU", "Huawei")],
                     "mlu": [("MLU", "Cambricon")], "dcu": [("DCU", "Hygon")]}
