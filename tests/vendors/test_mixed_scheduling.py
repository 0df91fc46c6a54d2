"""The scheduler's decision over a mixed cluster (NVIDIA, Ascend, MLU, DCU nodes registered as
their node agents register them): each vendor's pod lands only on a fitting device of its own
vendor, an Ascend request takes the smallest covering template and fills chips without overlap,
a request no template covers is refused on every node with the reason, and a released
allocation frees its room."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rules import parse_pod_options

from tessera.device_kinds import registry
from tessera.device_kinds.ascend import FAMILIES
from tessera.device_kinds.ascend.node import AscendNode
from tessera.device_kinds.cambricon.node import CambriconNode
from tessera.device_kinds.hygon.node import HygonNode
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.hami import PodRequest
from tessera.models import Allocation, AllocationState, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
NODES = ("gpu-a10", "npu-910b3", "mlu-370", "dcu-z100")


def vendor_devices(node_family, model: str, count: int, memory: int, tmp: str) -> list:
    settings = TesseraSettings(device_source="static", static_gpu_count=count,
                               static_gpu_model=model, static_gpu_memory_mib=memory,
                               region_host_dir=tmp)
    return node_family.advertise(node_family.backend(settings, "n").discover(),
                                 NodeDeviceConfig())


def cluster(tmp: str) -> ClusterIndex:
    index = ClusterIndex()
    gpus = [DeviceInfo(uuid=f"GPU-{i}", index=i, type="NVIDIA-A10", memory_mib=24576)
            for i in range(2)]
    devices = {
        "gpu-a10": gpus,
        "npu-910b3": vendor_devices(AscendNode(FAMILIES["ascend910b3"]), "Ascend910B3", 2, 1,
                                    tmp),
        "mlu-370": vendor_devices(CambriconNode(), "MLU370-X4", 2, 24576, tmp),
        "dcu-z100": vendor_devices(HygonNode(), "Z100L", 2, 32768, tmp),
    }
    for name, devs in devices.items():
        index.set_registration(name, NodeRegistration(node=name, devices=devs), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    return index


def pod(name: str, limits: dict[str, Any], annotations: dict[str, str] | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": name,
                         "annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}


def schedule(index: ClusterIndex, spec: dict) -> tuple[str | None, Any, dict[str, str]]:
    """(node, grants) of the best fit and the refusals, placing the pod when it fits."""
    request = PodRequest(containers=[registry.read_request(c, SETTINGS)
                                     for c in spec["spec"]["containers"]])
    decision = decide(index, request, parse_pod_options(spec, SETTINGS), list(NODES))
    for entry, fit in decision.fits():
        uid = spec["metadata"]["uid"]
        ledger = index.entries[entry.name].ledger
        allocations = {**ledger.allocations, uid: Allocation(
            pod_uid=uid, namespace="ns", name=uid, node=entry.name, containers=fit.containers,
            state=AllocationState.ALLOCATED)}
        index.set_ledger(entry.name, NodeLedger(node=entry.name, allocations=allocations),
                         index.entries[entry.name].ledger_revision + 1, 0.0)
        return entry.name, fit.containers, decision.failed
    decision.explain_rest()
    return None, None, decision.failed


def release(index: ClusterIndex, node: str, uid: str) -> None:
    ledger = index.entries[node].ledger
    allocations = {k: v for k, v in ledger.allocations.items() if k != uid}
    index.set_ledger(node, NodeLedger(node=node, allocations=allocations),
                     index.entries[node].ledger_revision + 1, 0.0)


def test_each_vendors_pod_lands_on_its_own_vendor_only(tmp_path) -> None:
    index = cluster(str(tmp_path))
    cases = [
        ("cuda", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}, "gpu-a10", "NVIDIA-A10"),
        ("npu", {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 2000},
         "npu-910b3", "Ascend910B3"),
        ("mlu", {"cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vmemory": 16,
                 "cambricon.com/mlu.smlu.vcore": 50}, "mlu-370", "MLU370-X4"),
        ("dcu", {"hygon.com/dcunum": 1, "hygon.com/dcumem": 2000, "hygon.com/dcucores": 60},
         "dcu-z100", "DCU-Z100L"),
    ]
    for name, limits, where, device_type in cases:
        node, grants, failed = schedule(index, pod(name, limits))
        assert node == where, (name, failed)
        assert grants[0][0].type == device_type
    # the Ascend pod got the smallest covering template; MLU memory is 16 × 256 MiB
    _, npu, _ = schedule(index, pod("npu-2", {"huawei.com/Ascend910B3": 1,
                                               "huawei.com/Ascend910B3-memory": 20000}))
    assert (npu[0][0].memory_mib, npu[0][0].cores) == (32768, 10)  # vir10_3c_32g


def test_ascend_chips_fill_and_a_request_no_template_covers_is_refused_everywhere(tmp_path):
    index = cluster(str(tmp_path))
    big = {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 30000}
    placed = [schedule(index, pod(f"big-{i}", big)) for i in range(5)]
    # two vir10_3c_32g per chip (64 GiB, 20 AI cores), two chips: the fifth does not fit
    assert [p[0] for p in placed[:4]] == ["npu-910b3"] * 4
    assert {g[0][0].uuid for _, g, _ in placed[:4]} == {
        d.uuid for d in index.entries["npu-910b3"].registration.devices}
    node, _, failed = placed[4]
    assert node is None
    assert "2/2 CardInsufficientMemory" in failed["npu-910b3"]
    assert "CardTypeMismatch" in failed["gpu-a10"] and "CardTypeMismatch" in failed["mlu-370"]

    release(index, "npu-910b3", "big-1")  # deleted: its template's room is free again
    assert schedule(index, pod("big-5", big))[0] == "npu-910b3"

    node, _, failed = schedule(index, pod("huge", {"huawei.com/Ascend910B3": 1,
                                                   "huawei.com/Ascend910B3-memory": 90000}))
    assert node is None
    assert "NoVnpuTemplateCovers" in failed["npu-910b3"]
    assert "no vNPU template of Ascend910B3 covers 90000" in failed["npu-910b3"]


def test_selection_annotations_of_each_vendor(tmp_path) -> None:
    index = cluster(str(tmp_path))
    npus = [d.uuid for d in index.entries["npu-910b3"].registration.devices]
    node, grants, _ = schedule(index, pod("pinned", {"huawei.com/Ascend910B3": 1,
                                                      "huawei.com/Ascend910B3-memory": 1000},
                                          {"hami.io/use-Ascend910B3-uuid": npus[1]}))
    assert grants[0][0].uuid == npus[1]
    node, _, failed = schedule(index, pod("mlu590", {"cambricon.com/vmlu": 1},
                                          {"cambricon.com/use-mlutype": "MLU590"}))
    assert node is None and "CardTypeMismatch" in failed["mlu-370"]
    node, _, _ = schedule(index, pod("not-z100", {"hygon.com/dcunum": 1},
                                     {"hygon.com/nouse-dcutype": "K100"}))
    assert node == "dcu-z100"


def test_910c_pods_take_whole_modules(tmp_path) -> None:
    index = ClusterIndex()
    modules = vendor_devices(AscendNode(FAMILIES["ascend910c"]), "Ascend910C", 4, 1,
                             str(tmp_path))
    index.set_registration("npu-910c", NodeRegistration(node="npu-910c", devices=modules), 0.0)
    index.set_ledger("npu-910c", NodeLedger(node="npu-910c"), 1, 0.0)

    def place(name: str, npus: int):
        spec = pod(name, {"huawei.com/Ascend910C": npus})
        request = PodRequest(containers=[registry.read_request(c, SETTINGS)
                                         for c in spec["spec"]["containers"]])
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), ["npu-910c"])
        for entry, fit in decision.fits():
            ledger = index.entries[entry.name].ledger
            allocations = {**ledger.allocations, name: Allocation(
                pod_uid=name, namespace="ns", name=name, node=entry.name,
                containers=fit.containers, state=AllocationState.ALLOCATED)}
            index.set_ledger(entry.name, NodeLedger(node=entry.name, allocations=allocations),
                             index.entries[entry.name].ledger_revision + 1, 0.0)
            return fit.containers
        decision.explain_rest()
        return decision.failed

    one = place("one-npu", 1)  # rounded up to a module of two dies
    assert [(g.memory_mib, g.cores) for g in one[0]] == [(131072, 40)]
    assert isinstance(place("two-modules", 4), Mapping)  # refused (node -> reason): one module left
    other = place("second-module", 2)
    assert other[0][0].uuid != one[0][0].uuid
