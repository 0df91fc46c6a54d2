"""A node whose NPUs, MLUs or DCUs HAMi's (or the vendor's) device plugin registered, during a
migration from HAMi, is read-only to Tessera and says so in every refusal that names it: on a node
no Tessera agent registered (`NodeUnregistered`, with what HAMi's plugin registered there), and on
a node whose Tessera agent serves another family (the vendor pod's `CardTypeMismatch`, with the
NPUs HAMi's plugin registered beside the GPUs). Tessera's own agent writes the same register
annotation for the family it serves: that one is never reported as HAMi's. The decision and the
node watch as the scheduler runs them (`ForeignCapacity` over the `ClusterIndex`)."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from tessera.scheduler.decide import decide
from tessera.scheduler.foreign import ForeignCapacity
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rules import parse_pod_options

from tessera.cluster.port import WatchEvent
from tessera.device_kinds import registry
from tessera.device_kinds.ascend import FAMILIES
from tessera.device_kinds.ascend.node import AscendNode
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.hami import PodRequest
from tessera.models import DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
NPU = "huawei.com/Ascend910B3"
READ_ONLY = ": read-only to Tessera, which places pods only where its own node agent enforces them"


def npu_register(count: int) -> str:
    """`hami.io/node-register-Ascend910B3` as HAMi's Ascend device plugin writes it."""
    return json.dumps([{"id": f"NPU-{i}", "index": i, "count": 4, "devmem": 65536,
                        "devcore": 20, "type": "Ascend910B3", "numa": 0, "health": True,
                        "customInfo": {"NetworkID": 0 if i < 4 else 1}}
                       for i in range(count)])  # fmt: skip


def node(name: str, annotations: dict[str, str], capacity: dict[str, str] | None = None,
         ) -> WatchEvent:  # fmt: skip
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name, "annotations": annotations}}
    if capacity:
        obj["status"] = {"capacity": capacity, "allocatable": capacity}
    return WatchEvent(type="ADDED", object=obj)


def refusals(index: ClusterIndex, limits: dict[str, Any], names: list[str]) -> dict[str, str]:
    spec = {"metadata": {"name": "p", "namespace": "ns", "uid": "p", "annotations": {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}
    request = PodRequest(containers=[registry.read_request(c, SETTINGS)
                                     for c in spec["spec"]["containers"]])  # fmt: skip
    decision = decide(index, request, parse_pod_options(spec, SETTINGS), names)
    assert next(iter(decision.fits()), None) is None, "placed on a node Tessera does not serve"
    decision.explain_rest()
    return dict(decision.failed)


def test_unregistered_vendor_nodes_are_named_read_only_with_what_hami_registered() -> None:
    index = ClusterIndex()
    metrics = CollectorRegistry()
    foreign = ForeignCapacity(settings=SETTINGS, index=index, registry=metrics, clock=lambda: 0.0)
    foreign.on_node_event(node("npu-hami", {"hami.io/node-register-Ascend910B3": npu_register(8),
                                            "hami.io/node-handshake-Ascend910B3": "Reported_x"}))
    dcu = "DCU-0,4,16368,100,DCU-Z100L,0,true:DCU-1,4,16368,100,DCU-Z100L,0,true:"
    foreign.on_node_event(node("dcu-hami", {"hami.io/node-dcu-register": dcu}))
    # Cambricon's device plugin advertises the vcore capacity HAMi reads an MLU node from
    foreign.on_node_event(node("mlu-hami", {}, {"cambricon.com/mlu.smlu.vcore": "400",
                                                "cambricon.com/mlu.smlu.vmemory": "384"}))
    foreign.on_node_event(node("npu-broken", {"hami.io/node-register-Ascend910B3": "[{}]"}))
    names = ["npu-hami", "dcu-hami", "mlu-hami", "npu-broken"]

    failed = refusals(index, {NPU: 1, f"{NPU}-memory": 16384}, names)
    unregistered = "NodeUnregistered: no Tessera node agent registered this node ["
    carried = {name: text.removeprefix(unregistered + "it carries ").removesuffix(READ_ONLY + "]")
               for name, text in failed.items()}  # fmt: skip
    assert carried["npu-hami"] == "hami.io/node-register-Ascend910B3 (8 NPUs)"
    assert carried["dcu-hami"] == "hami.io/node-dcu-register (2 DCUs)"
    assert carried["mlu-hami"] == "capacity cambricon.com/mlu.smlu.vcore=400 (4 MLUs)"
    assert failed["npu-broken"].startswith(unregistered + "its hami.io/node-register-Ascend910B3 "
                                           'is unreadable: hami.io/node-register-Ascend910B3: '
                                           'item 0 has no string "id"')  # fmt: skip
    # an NVIDIA pod is told the same of these nodes
    assert "(8 NPUs)" in refusals(index, {"nvidia.com/gpu": 1}, names)["npu-hami"]
    assert "tessera_scheduler_hami_nodes 3.0" in generate_latest(metrics).decode()

    # HAMi's plugin gone (the annotation removed): nothing more to say, the node leaves
    foreign.on_node_event(node("npu-hami", {}))
    assert refusals(index, {NPU: 1}, ["npu-hami"])["npu-hami"] == unregistered[:-2]
    assert "npu-hami" not in index.foreign


def test_npus_hami_registered_beside_tesseras_gpus_are_named_in_the_npu_pods_refusal(
    tmp_path,
) -> None:
    index = ClusterIndex()
    foreign = ForeignCapacity(settings=SETTINGS, index=index, clock=lambda: 0.0)
    gpus = [DeviceInfo(uuid=f"GPU-{i}", index=i, type="NVIDIA-A10", memory_mib=24576)
            for i in range(2)]  # fmt: skip
    ascend = AscendNode(FAMILIES["ascend910b3"])
    settings = TesseraSettings(device_source="static", static_gpu_count=2,
                               static_gpu_model="Ascend910B3", region_host_dir=str(tmp_path))
    npus = ascend.advertise(ascend.backend(settings, "npu-own").discover(), NodeDeviceConfig())
    for name, devices in (("mixed", gpus), ("npu-own", npus)):
        index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    # "mixed": Tessera's agent serves the GPUs (and writes NVIDIA's register annotation);
    # HAMi's Ascend plugin registered the NPUs. "npu-own": Tessera's agent wrote both of its
    # annotations itself (registry.register_annotations), as it does on every Ascend node.
    foreign.on_node_event(node("mixed", {**registry.register_annotations(gpus),
                                         "hami.io/node-register-Ascend910B3": npu_register(4)}))
    foreign.on_node_event(node("npu-own", registry.register_annotations(npus)))

    failed = refusals(index, {NPU: 1, f"{NPU}-memory": 90000}, ["mixed", "npu-own"])
    assert failed["mixed"].startswith("2/2 CardTypeMismatch")
    assert failed["mixed"].endswith(
        " [it also carries hami.io/node-register-Ascend910B3 (4 NPUs) from HAMi's device plugin: "
        "read-only to Tessera, whose node agent here does not serve them]")
    assert "NoVnpuTemplateCovers" in failed["npu-own"]
    assert "HAMi" not in failed["npu-own"] and "read-only" not in failed["npu-own"]


def test_a_register_annotation_tesseras_own_agent_wrote_makes_no_node_special() -> None:
    """Tessera's node agent writes HAMi's `hami.io/node-nvidia-register` on every node it
    serves: such a node says nothing and blocks nothing, so the decision treats it as any node
    (it is not in `index.foreign`, which words a node on its own and never remembers its
    refusal: bench/hami_register_nodes.py). Its refusals are the same as without the Node
    watch; once no Tessera agent registers it, the annotation is named again."""
    watched, plain = ClusterIndex(), ClusterIndex()
    foreign = ForeignCapacity(settings=SETTINGS, index=watched, clock=lambda: 0.0)
    names = [f"gpu-{i}" for i in range(3)]
    for name in names:
        gpus = [DeviceInfo(uuid=f"GPU-{name}-{j}", index=j, type="NVIDIA-A10",
                           memory_mib=24576) for j in range(2)]  # fmt: skip
        for index in (watched, plain):
            index.set_registration(name, NodeRegistration(node=name, devices=gpus), 0.0)
            index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
        foreign.on_node_event(node(name, registry.register_annotations(gpus)))
    assert watched.foreign == {} and sorted(watched.hami_registered) == names
    too_big = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 30000}
    assert refusals(watched, too_big, names) == refusals(plain, too_big, names)
    assert "read-only" not in refusals(watched, too_big, names)["gpu-0"]
    # its agent gone (its registration expired): an unknown name, with what it carries
    watched.set_registration("gpu-0", None, 0.0)
    assert refusals(watched, too_big, names)["gpu-0"] == (
        "NodeUnregistered: no Tessera node agent registered this node [it carries "
        f"hami.io/node-nvidia-register (2 GPUs){READ_ONLY}]")
