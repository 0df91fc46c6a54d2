"""Which DRA bookings the scheduler's release keeps (services/scheduler/dra_shared.py): only one
whose claim is still reserved for another pod running on the node, allocated exactly devices
the ended pod books and that pod does not. Every other allocation is released as ever. The
cluster is tessera.cluster.memory's fake of kube-apiserver (pods, ResourceClaims)."""

from __future__ import annotations

import copy
import uuid

from tessera.scheduler.dra_shared import shared_in_use

from tessera import dra_names as names
from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import ClusterError
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, NodeLedger

NODE, NS = "n1", "team"
CARD = DeviceInfo(uuid="GPU-0", index=0, type="NVIDIA-A100", memory_mib=16000)


def pod(name: str, node: str = NODE, phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4())},
            "spec": {"nodeName": node, "containers": [{"name": "c"}]},
            "status": {"phase": phase}}  # fmt: skip


def claim(name: str, reserved: list[dict], memory: str = "4Gi", cores: str = "30") -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4())},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": names.DEVICE_CLASS}}]}},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": names.DRIVER_NAME, "pool": NODE,
                "device": "gpu-0", "consumedCapacity": {"memory": memory, "cores": cores}}]}},
            "reservedFor": [{"resource": "pods", "name": p["metadata"]["name"],
                             "uid": p["metadata"]["uid"]} for p in reserved],
        },
    }  # fmt: skip


def booking(p: dict, memory: int = 4096, cores: int = 30, reason: str = names.DRA_REASON
            ) -> Allocation:  # fmt: skip
    return Allocation(pod_uid=p["metadata"]["uid"], namespace=NS, name=p["metadata"]["name"],
                      node=NODE, state=AllocationState.ALLOCATED, reason=reason,
                      containers=[[DeviceGrant(uuid="GPU-0", type=CARD.type, memory_mib=memory,
                                               cores=cores)]])  # fmt: skip


def ledger(*held: Allocation) -> NodeLedger:
    return NodeLedger(node=NODE, allocations={a.pod_uid: a for a in held})


async def test_kept_only_while_another_running_pod_of_the_node_still_uses_the_claim() -> None:
    cluster = InMemoryCluster()
    first, second = pod("first"), pod("second")
    cluster.add_pod(second)  # the first pod is gone; the claim is reserved for the second
    cluster.put_resource_claim(claim("shared", [second]))
    ended = booking(first)
    assert await shared_in_use(cluster, NODE, ended, ledger(ended), [CARD]) == [f"{NS}/shared"]

    # handed on (the second pod's booking holds it; the first's emptied): released
    emptied = ended.model_copy(update={"containers": [[]]})
    assert await shared_in_use(cluster, NODE, emptied, ledger(emptied, booking(second)),
                               [CARD]) == []  # fmt: skip
    # an extender allocation with the same grant: never kept
    extender = booking(first, reason="")
    assert await shared_in_use(cluster, NODE, extender, ledger(extender), [CARD]) == []


async def test_released_when_the_other_pod_cannot_be_using_it() -> None:
    first = pod("first")
    ended = booking(first)
    for other, note in ((pod("done", phase="Succeeded"), "finished"),
                        (pod("elsewhere", node="n2"), "on another node")):  # fmt: skip
        cluster = InMemoryCluster()
        cluster.add_pod(other)
        cluster.put_resource_claim(claim("shared", [other]))
        assert await shared_in_use(cluster, NODE, ended, ledger(ended), [CARD]) == [], note
    # reserved for a pod the cluster does not have (or another pod of that name)
    cluster = InMemoryCluster()
    ghost = pod("ghost")
    cluster.put_resource_claim(claim("shared", [ghost]))
    impostor = copy.deepcopy(ghost)
    impostor["metadata"]["uid"] = str(uuid.uuid4())
    cluster.add_pod(impostor)
    assert await shared_in_use(cluster, NODE, ended, ledger(ended), [CARD]) == []


async def test_another_pods_own_claim_with_the_same_slice_is_not_mistaken_for_a_shared_one():
    cluster = InMemoryCluster()
    first, second = pod("first"), pod("second")
    cluster.add_pod(second)
    # the second pod's own claim, identical slice, already booked under it
    cluster.put_resource_claim(claim("its-own", [second]))
    ended = booking(first)
    assert await shared_in_use(cluster, NODE, ended, ledger(ended, booking(second)),
                               [CARD]) == []  # fmt: skip
    # a claim whose devices the ended pod does not book (another slice size): not its
    cluster.put_resource_claim(claim("bigger", [second], memory="8Gi"))
    assert await shared_in_use(cluster, NODE, ended, ledger(ended), [CARD]) == [f"{NS}/its-own"]


async def test_a_cluster_that_cannot_answer_releases_as_ever() -> None:
    class Down(InMemoryCluster):
        async def list_resource_claims(self, namespace: str | None = None) -> list[dict]:
            raise ClusterError("apiserver unreachable")

    first = pod("first")
    ended = booking(first)
    assert await shared_in_use(Down(), NODE, ended, ledger(ended), [CARD]) == []
