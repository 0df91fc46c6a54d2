"""A 910C node's NPUs named as HAMi names them. HAMi's Ascend device plugin registers every NPU
(die) on its own in `hami.io/node-register-Ascend910C`: `id` the NPU's die ID as DCMI reports it,
`index` its place in the list, `devmem`/`devcore` one NPU's memoryAllocatable and AI cores; HAMi's
scheduler pairs a module's NPUs by index / 2 and a pod's record lists each NPU it holds. Tessera's
device is the module (both dies); its node agent keeps both dies' IDs (`DeviceInfo.part_ids`), so
the annotation it writes is what HAMi's plugin writes, and a 910C pod HAMi's scheduler placed holds
its module (not half of it, and the node is not quarantined for naming an NPU the registration
does not list). Source: HAMi's ascend-device-plugin (`internal/manager`: one device per logic
ID, UUID = its die ID; `internal/server/register.go`: index, devmem, devcore, NetworkID 0 on
910C) and HAMi's scheduler (`pkg/device/ascend`: the 910C module = index / 2)."""

from __future__ import annotations

import json
from typing import Any

from tessera.node_agent.devices import advertise
from tessera.node_agent.family_source import FamilySource
from tessera.scheduler.decide import decide
from tessera.scheduler.foreign import ForeignCapacity
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rules import parse_pod_options

from tessera import hami
from tessera.cluster.port import WatchEvent
from tessera.device_kinds import registry
from tessera.device_kinds.ascend.chips import DEFAULT_CHIPS
from tessera.device_kinds.ascend.dcmi_fake import SimulatedDcmi
from tessera.hami import PodRequest
from tessera.models import NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

NPU = "huawei.com/Ascend910C"
CHIP = next(c for c in DEFAULT_CHIPS if c.common_word == "Ascend910C")


def settings_for(tmp: str) -> TesseraSettings:
    return TesseraSettings(device_source="static", static_gpu_count=4,
                           static_gpu_model="Ascend910C", region_host_dir=tmp,
                           device_family="ascend910c")  # fmt: skip


def modules(tmp: str) -> list[Any]:
    """Two modules (four NPUs) as the node agent registers them."""
    settings = settings_for(tmp)
    return advertise(FamilySource.of(settings, "n").discover(), settings)


def die_ids() -> list[str]:
    """The node's four NPUs' die IDs as DCMI reports them (what HAMi's plugin registers)."""
    dcmi = SimulatedDcmi("n", CHIP, 4)
    return [dcmi.get_device_die(card, j) for card in (0, 1) for j in (0, 1)]


def test_the_register_annotation_lists_each_npu_as_hamis_plugin_does(tmp_path) -> None:
    dies = die_ids()
    devices = modules(str(tmp_path))
    assert [d.uuid for d in devices] == [dies[0], dies[2]]  # a module is its die 0
    assert [d.part_ids for d in devices] == [dies[:2], dies[2:]]
    written = json.loads(registry.register_annotations(devices)["hami.io/node-register-Ascend910C"])
    assert [(n["id"], n["index"], n["devmem"], n["devcore"], n["customInfo"]) for n in written] \
        == [(die, i, CHIP.memory_allocatable, CHIP.ai_core, {"NetworkID": 0})
            for i, die in enumerate(dies)]  # fmt: skip
    # HAMi's scheduler pairs NPUs into modules by index / 2: each pair is one of our modules
    for module in devices:
        indices = [n["index"] for n in written if n["id"] in module.part_ids]
        assert [i // 2 for i in indices] == [module.index] * 2


def hami_910c_pod(name: str, node: str, npus: list[str]) -> dict[str, Any]:
    """A 910C pod as HAMi's scheduler placed it: its record lists each NPU it holds."""
    record = "".join(f"{u},Ascend910C,{CHIP.memory_allocatable},{CHIP.ai_core}:" for u in npus)
    return {"metadata": {"name": name, "namespace": "team", "uid": f"u-{name}",
                         "resourceVersion": "1",
                         "annotations": {"hami.io/Ascend910C-devices-allocated": record + ";",
                                         hami.ANN_VGPU_NODE: node,
                                         hami.ANN_BIND_PHASE: "success"}},
            "spec": {"schedulerName": "hami-scheduler", "nodeName": node,
                     "containers": [{"name": "main", "resources": {"limits": {NPU: 2}}}]},
            "status": {"phase": "Running"}}  # fmt: skip


def fit(index: ClusterIndex, node: str) -> tuple[list[str], dict[str, str]]:
    spec = {"metadata": {"name": "p", "namespace": "ns", "uid": "p", "annotations": {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {NPU: 2}}}]}}
    request = PodRequest(containers=[registry.read_request(c, TesseraSettings())
                                     for c in spec["spec"]["containers"]])  # fmt: skip
    decision = decide(index, request, parse_pod_options(spec, TesseraSettings()), [node])
    placed = [entry.name for entry, _fit in decision.fits()]
    if not placed:
        decision.explain_rest()
    return placed, dict(decision.failed)


def test_a_910c_pod_hami_placed_holds_its_whole_module(tmp_path) -> None:
    devices = modules(str(tmp_path))
    index = ClusterIndex()
    index.set_registration("n", NodeRegistration(node="n", devices=devices), 0.0)
    index.set_ledger("n", NodeLedger(node="n"), 1, 0.0)
    foreign = ForeignCapacity(settings=TesseraSettings(), index=index, clock=lambda: 0.0)
    first, second = devices
    dies = die_ids()
    # HAMi lists the module's NPUs in either order (its pick walks the devices backwards)
    foreign.on_pod_event(WatchEvent(type="ADDED", object=hami_910c_pod(
        "train", "n", [dies[1], dies[0]])))
    entry = index.entries["n"]
    assert not entry.blocked, entry.blocked
    held = index.foreign_allocations("n")[0].containers
    assert [(g.uuid, g.memory_mib, g.cores) for g in held[0]] == [
        (first.uuid, first.memory_mib, first.cores)]  # both NPUs: the whole module
    # the other module is free: a 910C pod (one module) goes there, not beside HAMi's
    placed, _ = fit(index, "n")
    assert placed == ["n"]
    assert {c.uuid: c.used_mem for c in entry.cards} == {first.uuid: first.memory_mib,
                                                         second.uuid: 0}  # fmt: skip

    # HAMi's second pod takes the other module: nothing is left, and nothing is quarantined
    foreign.on_pod_event(WatchEvent(type="ADDED", object=hami_910c_pod(
        "infer", "n", dies[2:])))
    placed, failed = fit(index, "n")
    assert placed == [] and "HAMiCapacityUnknown" not in failed["n"], failed
    assert "2/2 " in failed["n"]

    # an NPU the registration does not list still quarantines the node (fails closed)
    foreign.on_pod_event(WatchEvent(type="ADDED", object=hami_910c_pod("odd", "n", ["NPU-x"])))
    assert index.entries["n"].blocked.startswith("HAMiCapacityUnknown: HAMi pod team/odd holds "
                                                 "NPU-x")  # fmt: skip
