"""An Ascend chip's AI CPUs in the scheduler's decision: the driver refuses a vNPU beyond a
chip's AI CPUs, so the scheduler counts them by the templates its vNPUs hold (the cards keep
their grants' templates). A 910B2 has 6 AI CPUs: one vir12_3c_32g (3) and three vir03_1c_8g (1
each) fit; a fourth vir03_1c_8g (7 of 6) pends with the reason though memory and AI cores are
left; released, the room comes back."""

from __future__ import annotations

from typing import Any

from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rules import parse_pod_options

from tessera.device_kinds import registry
from tessera.device_kinds.ascend import FAMILIES
from tessera.device_kinds.ascend.node import AscendNode
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.hami import PodRequest
from tessera.models import Allocation, AllocationState, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
NODE = "npu-910b2"


def index_with_one_chip(tmp: str) -> ClusterIndex:
    node = AscendNode(FAMILIES["ascend910b2"])
    settings = TesseraSettings(device_source="static", static_gpu_count=1,
                               static_gpu_model="Ascend910B2", region_host_dir=tmp)
    devices = node.advertise(node.backend(settings, NODE).discover(), NodeDeviceConfig())
    index = ClusterIndex()
    index.set_registration(NODE, NodeRegistration(node=NODE, devices=devices), 0.0)
    index.set_ledger(NODE, NodeLedger(node=NODE), 1, 0.0)
    return index


def vnpu_pod(name: str, memory: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": name, "annotations": {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {
                "huawei.com/Ascend910B2": 1, "huawei.com/Ascend910B2-memory": memory}}}]}}


def schedule(index: ClusterIndex, spec: dict[str, Any]) -> tuple[bool, str]:
    """Whether it was placed (and records it in the ledger), else the refusal's text."""
    request = PodRequest(containers=[registry.read_request(c, SETTINGS)
                                     for c in spec["spec"]["containers"]])
    decision = decide(index, request, parse_pod_options(spec, SETTINGS), [NODE])
    for _entry, fit in decision.fits():
        uid = spec["metadata"]["uid"]
        ledger = index.entries[NODE].ledger
        allocations = {**ledger.allocations, uid: Allocation(
            pod_uid=uid, namespace="ns", name=uid, node=NODE, containers=fit.containers,
            state=AllocationState.ALLOCATED)}
        index.set_ledger(NODE, NodeLedger(node=NODE, allocations=allocations),
                         index.entries[NODE].ledger_revision + 1, 0.0)
        return True, ""
    decision.explain_rest()
    return False, str(decision.failed)


def release(index: ClusterIndex, uid: str) -> None:
    ledger = index.entries[NODE].ledger
    index.set_ledger(NODE, NodeLedger(node=NODE, allocations={
        k: v for k, v in ledger.allocations.items() if k != uid}),
        index.entries[NODE].ledger_revision + 1, 0.0)


def test_a_vnpu_beyond_the_chips_ai_cpus_pends_with_the_reason(tmp_path) -> None:
    index = index_with_one_chip(str(tmp_path))
    assert schedule(index, vnpu_pod("big", 32768)) == (True, "")  # vir12_3c_32g: 3 AI CPUs
    for i in range(3):  # vir03_1c_8g: 1 AI CPU each -> 6 of 6
        assert schedule(index, vnpu_pod(f"small-{i}", 8192)) == (True, "")
    # 8192 MiB and 3 AI cores are still free on the chip; its AI CPUs are not
    placed, why = schedule(index, vnpu_pod("small-3", 8192))
    assert not placed
    assert "CardInsufficientCore" in why
    assert "vir03_1c_8g needs 1 AI CPU(s)" in why and "0 of 6 left" in why, why
    # one vir03 released: its AI CPU is free again
    release(index, "small-0")
    assert schedule(index, vnpu_pod("small-3", 8192)) == (True, "")


def test_templates_without_ai_cpus_to_spare_still_fill_the_chip(tmp_path) -> None:
    """Two vir12_3c_32g (6 AI CPUs) fill a 910B2 exactly: the AI CPU count refuses nothing
    the memory and AI cores allow when the templates' AI CPUs fit."""
    index = index_with_one_chip(str(tmp_path))
    assert schedule(index, vnpu_pod("a", 32768)) == (True, "")
    assert schedule(index, vnpu_pod("b", 32768)) == (True, "")
    placed, why = schedule(index, vnpu_pod("c", 8192))
    assert not placed and "CardInsufficientMemory" in why, why


def test_a_lapsed_reservation_is_not_regranted_beyond_the_ai_cpus(tmp_path) -> None:
    """The ledger's regrant check (a reservation that lapsed before its bind was recorded)
    counts AI CPUs too: while it lapsed, others took the chip's AI CPUs."""
    from tessera.scheduler.ledger import regrant_problems

    index = index_with_one_chip(str(tmp_path))
    assert schedule(index, vnpu_pod("lapsed", 8192)) == (True, "")
    assert schedule(index, vnpu_pod("big", 32768)) == (True, "")
    for i in range(2):
        assert schedule(index, vnpu_pod(f"small-{i}", 8192)) == (True, "")
    entry = index.entries[NODE]
    assert regrant_problems(entry.registered, entry.ledger, "lapsed", 0.0) == []  # 6 of 6
    ledger = entry.ledger
    # meanwhile a third vir03 took the lapsed one's AI CPU
    third = ledger.allocations["small-0"].model_copy(update={"pod_uid": "small-2",
                                                               "name": "small-2"})
    crowded = NodeLedger(node=NODE, allocations={**ledger.allocations, "small-2": third})
    problems = regrant_problems(entry.registered, crowded, "lapsed", 0.0)
    assert any("AI CPUs 7 > 6" in p for p in problems), problems
