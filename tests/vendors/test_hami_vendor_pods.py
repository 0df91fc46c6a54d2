"""A pod HAMi's own scheduler placed (a cluster migrating from HAMi) holds the devices its
family's record lists, whatever the vendor: the scheduler and the node agent read an Ascend,
Cambricon or Hygon pod's `hami.io/<family>-devices-allocated` as NVIDIA's, and an unreadable
record quarantines as NVIDIA's does. Pure (the scheduler-level test with real NATS is
tests/scheduler/test_vendor_rebuild.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.node_agent.foreign import ForeignUnknownError, hami_held

from tessera import hami
from tessera.device_kinds import pod_grants
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()

# family's allocated key, the container's limits, the record (HAMi's `UUID,TYPE,MEM,CORES:`)
VENDORS = {
    "ascend": ("hami.io/Ascend910B3-devices-allocated",
               {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 16384},
               "NPU-1,Ascend910B3,16384,5:;"),
    "cambricon": ("hami.io/cambricon-mlu-devices-allocated",
                  {"cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vmemory": 16},
                  "MLU-1,MLU370-X4,4096,100:;"),
    "hygon": ("hami.io/dcu-devices-allocated",
              {"hygon.com/dcunum": 1, "hygon.com/dcumem": 2000, "hygon.com/dcucores": 30},
              "DCU-1,DCU-Z100L,2000,30:;"),
}


def hami_pod(vendor: str, record: str | None = None) -> dict[str, Any]:
    key, limits, written = VENDORS[vendor]
    return {"metadata": {"name": f"{vendor}-job", "namespace": "team", "uid": f"u-{vendor}",
                         "annotations": {key: written if record is None else record,
                                         hami.ANN_VGPU_NODE: "n1",
                                         hami.ANN_BIND_PHASE: "success"}},
            "spec": {"schedulerName": "hami-scheduler", "nodeName": "n1",
                     "containers": [{"name": "main", "resources": {"limits": limits}}]},
            "status": {"phase": "Running"}}  # fmt: skip


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_the_node_agent_counts_a_vendor_pod_hami_placed(vendor: str) -> None:
    _key, _limits, record = VENDORS[vendor]
    uuid, _type, memory, cores = record.rstrip(":;").split(",")
    assert hami_held([hami_pod(vendor)], "n1", SETTINGS) == {uuid: (int(memory), int(cores))}
    assert hami_held([hami_pod(vendor)], "n2", SETTINGS) == {}  # bound elsewhere


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_an_unreadable_vendor_record_quarantines(vendor: str) -> None:
    key = VENDORS[vendor][0]
    with pytest.raises(ForeignUnknownError, match=key):
        hami_held([hami_pod(vendor, "NPU-1,x,not-a-number,5:;")], "n1", SETTINGS)
    with pytest.raises(ForeignUnknownError, match="lists no device"):
        hami_held([hami_pod(vendor, ";")], "n1", SETTINGS)


def test_a_pod_holding_two_families_merges_their_containers() -> None:
    annotations = {
        hami.ANN_DEVICES_ALLOCATED: "GPU-1,NVIDIA-A10,1000,10:;;",
        "hami.io/cambricon-mlu-devices-allocated": ";MLU-1,MLU370-X4,4096,50:;",
        "hami.io/cambricon-mlu-devices-to-allocate": ";;",  # emptied as HAMi served it
    }
    grants = pod_grants.placed_grants(annotations, 2)
    assert [[g.uuid for g in c] for c in grants] == [["GPU-1"], ["MLU-1"]]
    # -to-allocate stands in while -allocated lists no device (HAMi's reading, per family)
    only_to = {"hami.io/dcu-devices-to-allocate": "DCU-1,DCU-Z100L,2000,30:;"}
    assert pod_grants.placed_grants(only_to, 1)[0][0].uuid == "DCU-1"
    assert pod_grants.placed_grants({}, 1) == []


def test_any_familys_resources_ask_for_devices_a_priority_alone_does_not() -> None:
    def asks(limits: dict[str, Any]) -> bool:
        return hami.asks_gpu([{"name": "m", "resources": {"limits": limits}}], SETTINGS)

    for _key, limits, _record in VENDORS.values():
        assert asks(limits)
    assert asks({"huawei.com/Ascend910B3-memory": 2000})  # any one of the family's names
    assert asks({"nvidia.com/gpumem": 1000})
    assert not asks({"nvidia.com/priority": 0})
    assert not asks({"cpu": 1})
    renamed = TesseraSettings(device_resource_names={"mlu": {"count": "example.com/mlu"}})
    assert hami.asks_gpu([{"resources": {"requests": {"example.com/mlu": 1}}}], renamed)
