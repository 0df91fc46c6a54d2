"""What a running Ascend, Cambricon or Hygon pod holds is read back from the cluster, from its
vendor's own allocation annotations: a pod Tessera placed keeps its device after NATS lost the
node's ledger, and a pod HAMi's scheduler placed (a cluster migrating from HAMi) holds its device
from the moment a (re)started scheduler has listed the cluster; either way a new pod never gets
what they hold (real NATS, the in-memory cluster; the devices as each vendor's node agent
advertises them over its simulated management library).

The Ascend case asks the AI cores it needs (`huawei.com/Ascend910B3-core`), so its grant is the
covering template (more cores than asked): the rebuild must restore the template the chip really
cut, never the smaller request."""

from __future__ import annotations

from typing import Any

import pytest

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.device_kinds import registry
from tessera.device_kinds.ascend import FAMILIES
from tessera.device_kinds.ascend.node import AscendNode
from tessera.device_kinds.cambricon.node import CambriconNode
from tessera.device_kinds.hygon.node import HygonNode
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.models import DeviceGrant, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .conftest import MakeService, agent_allocate, http_client, register, unique, wait_until
from .factories import pod
from .test_extender import bind_call, filter_call

NPU = "huawei.com/Ascend910B3"
MLU = "cambricon.com/vmlu"
DCU = "hygon.com/dcunum"


def vendor_node(name: str, vendor: str, tmp: str) -> NodeRegistration:
    """One device of the vendor, as its node agent advertises it."""
    family, model, memory = {
        "ascend": (AscendNode(FAMILIES["ascend910b3"]), "Ascend910B3", 1),
        "cambricon": (CambriconNode(), "MLU370-X4", 24576),
        "hygon": (HygonNode(), "Z100L", 32768),
    }[vendor]
    settings = TesseraSettings(device_source="static", static_gpu_count=1,
                               static_gpu_model=model, static_gpu_memory_mib=memory,
                               region_host_dir=tmp)  # fmt: skip
    devices = family.advertise(family.backend(settings, name).discover(), NodeDeviceConfig())
    return NodeRegistration(node=name, devices=devices)


def vendor_container(limits: dict[str, Any]) -> dict[str, Any]:
    return {"name": "main", "image": "x", "resources": {"limits": limits}}


# vendor -> (the pods that fill its one device, a small pod that must then be refused)
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    # 910B3: 64 GiB, 20 AI cores, 7 AI CPUs. Asking 1 AI core rounds up to vir05_1c_16g
    # (16 GiB, 5 cores): two of them and a vir10_3c_32g (32 GiB, 10 cores) fill the chip.
    "ascend": ([{NPU: 1, f"{NPU}-memory": 16384, f"{NPU}-core": 1},
                {NPU: 1, f"{NPU}-memory": 16384, f"{NPU}-core": 1},
                {NPU: 1, f"{NPU}-memory": 32768}],
               {NPU: 1, f"{NPU}-memory": 16384}),
    # MLU370-X4: 24 GiB; vmemory in 256 MiB units, vcore in % of the MLU.
    "cambricon": ([{MLU: 1, "cambricon.com/mlu.smlu.vmemory": 48,
                    "cambricon.com/mlu.smlu.vcore": 50}] * 2,
                  {MLU: 1, "cambricon.com/mlu.smlu.vmemory": 4,
                   "cambricon.com/mlu.smlu.vcore": 10}),
    "hygon": ([{DCU: 1, "hygon.com/dcumem": 16000, "hygon.com/dcucores": 50}] * 2,
              {DCU: 1, "hygon.com/dcumem": 1000, "hygon.com/dcucores": 10}),
}


async def place(service: Any, client: Any, cluster: InMemoryCluster, buckets: Buckets,
                node_name: str, limits: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    spec = cluster.add_pod(pod(vendor_container(limits)))
    outcome = await filter_call(client, spec, [node_name])
    assert outcome["nodenames"] == [node_name], outcome
    assert await bind_call(client, spec, node_name) == ""
    await agent_allocate(buckets, node_name, spec["metadata"]["uid"])
    return spec


@pytest.mark.parametrize("vendor", sorted(CASES))
async def test_a_wiped_ledger_keeps_every_vendor_pods_device(
    vendor: str, make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster,
    tmp_path,
) -> None:  # fmt: skip
    fill, small = CASES[vendor]
    name = unique(vendor[:3])
    registration = vendor_node(name, vendor, str(tmp_path))
    await register(buckets, registration)
    first = await make_service()
    await wait_until(lambda: first.index.node(name) is not None)
    async with http_client(first) as client:
        placed = [await place(first, client, cluster, buckets, name, limits) for limits in fill]
        refused = await filter_call(client, cluster.add_pod(pod(vendor_container(small))),
                                    [name])  # fmt: skip
        assert not refused["nodenames"], "the device was not full before the wipe"
    before = await bus.read(buckets.ledger, name, NodeLedger)
    assert before is not None
    await first.stop()

    await buckets.ledger.purge(name)  # NATS lost the node's ledger
    second = await make_service()  # ready = synced *and* rebuilt from the pods
    after = await bus.read(buckets.ledger, name, NodeLedger)
    assert after is not None
    uids = {p["metadata"]["uid"] for p in placed}
    assert set(after.value.allocations) == uids
    for uid in uids:  # the grants the device really holds, each vendor's record read back
        assert after.value.allocations[uid].containers == before.value.allocations[uid].containers
    async with http_client(second) as client:
        outcome = await filter_call(client, cluster.add_pod(pod(vendor_container(small))),
                                    [name])  # fmt: skip
    assert not outcome["nodenames"], f"a {vendor} device a running pod holds was handed out again"
    assert "CardInsufficient" in outcome["failedNodes"][name], outcome


def hami_placed(spec: dict[str, Any], node_name: str, device: Any) -> dict[str, Any]:
    """The pod as HAMi's webhook routed it and HAMi's scheduler annotated and bound it, holding
    the whole device: its family's `-devices-allocated` (and `-to-allocate`, emptied by HAMi's
    device plugin as it served the container), `hami.io/vgpu-node`, `hami.io/bind-phase`."""
    family = registry.family_of_type(device.type)
    record = family.encode_grants([[DeviceGrant(uuid=device.uuid, type=device.type,
                                                memory_mib=device.memory_mib,
                                                cores=device.cores)]])  # fmt: skip
    spec["metadata"]["annotations"] = {
        family.allocated_annotation: record, family.to_allocate_annotation: ";",
        "hami.io/vgpu-node": node_name, "hami.io/vgpu-time": "1700000000",
        "hami.io/bind-time": "1700000000", "hami.io/bind-phase": "success",
    }  # fmt: skip
    spec["spec"]["schedulerName"] = "hami-scheduler"
    spec["spec"]["nodeName"] = node_name
    spec["status"] = {"phase": "Running"}
    return spec


@pytest.mark.parametrize("vendor", sorted(CASES))
async def test_a_vendor_pod_hami_placed_holds_its_device_after_a_restart(
    vendor: str, make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster,
    tmp_path,
) -> None:  # fmt: skip
    _fill, small = CASES[vendor]
    name = unique(vendor[:3])
    registration = vendor_node(name, vendor, str(tmp_path))
    [device] = registration.devices
    await register(buckets, registration)
    held = cluster.add_pod(hami_placed(pod(vendor_container(small), namespace="team-hami"),
                                       name, device))  # fmt: skip
    service = await make_service()  # ready = the ledger synced and HAMi's pods read back
    await wait_until(lambda: service.index.node(name) is not None)
    assert len(service.index.foreign_allocations(name)) == 1
    async with http_client(service) as client:
        outcome = await filter_call(client, cluster.add_pod(pod(vendor_container(small))),
                                    [name])  # fmt: skip
        assert not outcome["nodenames"], f"a {vendor} device a HAMi pod holds was handed out"
        reason = outcome["failedNodes"][name]
        assert f"used by HAMi pod team-hami/{held['metadata']['name']}" in reason, reason
        ledger = await bus.read(buckets.ledger, name, NodeLedger)
        assert ledger is None or held["metadata"]["uid"] not in ledger.value.allocations

        cluster.delete_pod("team-hami", held["metadata"]["name"])  # HAMi's pod ends
        await wait_until(lambda: not service.index.foreign_allocations(name))
        outcome = await filter_call(client, cluster.add_pod(pod(vendor_container(small))),
                                    [name])  # fmt: skip
        assert outcome["nodenames"] == [name], outcome
