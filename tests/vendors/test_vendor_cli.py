"""`tessera get nodes` lists a vendor node's devices from its register annotation (Ascend's
JSON, Hygon's list form) with what the pods bound there hold."""

from __future__ import annotations

from tessera.device_kinds.ascend import annotations as asc
from tessera.device_kinds.hygon import annotations as dcu
from tessera_cli.nodes import nodes_table, summarise


def node(name: str, annotations: dict[str, str]) -> dict:
    return {"metadata": {"name": name, "annotations": annotations},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_vendor_nodes_show_their_devices_and_use() -> None:
    npus = [asc.RegisteredNpu(f"npu-{i}", i, 4, 65536, 20, "Ascend910B3", True,
                              mode="ascend910b3-vnpu") for i in range(2)]
    dcus = [dcu.RegisteredDcu("DCU-a", 10, 32768, 100, "DCU-Z100L", 0, False)]
    pod = {"metadata": {"annotations": {
        asc.allocated_key("Ascend910B3"): "npu-1,Ascend910B3,16384,5:;"}},
        "spec": {"nodeName": "npu", "containers": [{"name": "c"}]},
        "status": {"phase": "Running"}}
    summaries = summarise([
        node("npu", {asc.register_key("Ascend910B3"): asc.encode_register(npus)}),
        node("dcu", {dcu.NODE_REGISTER: dcu.encode_register(dcus)}),
    ], [pod])
    npu, dcu_node = summaries
    assert [(g["type"], g["memory_used_mib"], g["cores_used"]) for g in npu["gpus"]] == [
        ("Ascend910B3", 0, 0), ("Ascend910B3", 16384, 5)]
    assert npu["gpus"][0]["mode"] == "ascend910b3-vnpu"
    assert dcu_node["gpus"][0]["type"] == "DCU-Z100L"
    table = nodes_table(summaries)
    assert "1 unhealthy" in table and "16384/131072" in table
