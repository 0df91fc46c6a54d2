"""The rebuild from pods before serving looks only at the pods the synced index does not place:
a restart over an intact ledger reads and writes no node's entry (at 5,000 nodes and 80,000 GPU
pods that pass decoded every pod's annotations and every node's entry once more, seconds before
ready), while a pod the ledger lacks is still restored, only onto its own node, and nothing a
hostile pod list holds stops the rebuild."""

from __future__ import annotations

from typing import Any

from services.scheduler.index import ClusterIndex
from services.scheduler.rebuild import LedgerRebuilder
from services.scheduler.registration_codec import RegistrationCodec
from services.scheduler.wire_fast import RegistrationWire
from tessera import hami
from tessera.bus import NoChange, Versioned
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import encode
from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger

from .factories import GIB, container, node, pod

NOW = 1_000.0


def bound_pod(name: str, node_name: str, uuid: str, mem: int = GIB) -> dict[str, Any]:
    spec = pod(container(mem=mem), name=name, uid=f"uid-{name}", annotations={
        hami.ANN_DEVICES_TO_ALLOCATE: f"{uuid},NVIDIA-H100,{mem},0:;",
        hami.ANN_VGPU_NODE: node_name, hami.ANN_BIND_PHASE: hami.BIND_PHASE_SUCCESS,
    })  # fmt: skip
    spec["spec"]["nodeName"] = node_name
    spec["status"] = {"phase": "Running"}
    return spec


def held(name: str, node_name: str, uuid: str, mem: int = GIB) -> Allocation:
    return Allocation(
        pod_uid=f"uid-{name}", namespace="default", name=name, node=node_name,
        containers=[[DeviceGrant(uuid=uuid, type="NVIDIA-H100", memory_mib=mem, cores=0)]],
        state=AllocationState.ALLOCATED, container_names=["main"],
    )  # fmt: skip


class Store:
    """The ledger KV's compare-and-set, in memory: counts every read-modify-write."""

    def __init__(self) -> None:
        self.values: dict[str, NodeLedger] = {}
        self.revision = 0
        self.calls: list[str] = []

    async def write(self, node_name: str, mutate: Any) -> Versioned[NodeLedger]:
        self.calls.append(node_name)
        current = self.values.get(node_name)
        try:
            value = mutate(current)
        except NoChange:
            if current is None:
                raise
            return Versioned(current, self.revision)
        self.revision += 1
        self.values[node_name] = value
        return Versioned(value, self.revision)


def cluster_of(index: ClusterIndex, store: Store, ledgers: dict[str, list[Allocation]],
               pods: list[dict[str, Any]]) -> LedgerRebuilder:  # fmt: skip
    """An index synced as at start-up (registrations read unbuilt, as the watch reads them)."""
    codec = RegistrationCodec()
    for name in ("a", "b"):
        registration = codec.read(encode(node(name, gpus=2, memory_mib=10 * GIB)))
        assert type(registration) is RegistrationWire
        index.set_registration(name, registration, NOW)
    for name, allocations in ledgers.items():
        ledger = NodeLedger(node=name, allocations={a.pod_uid: a for a in allocations})
        store.values[name] = ledger
        store.revision += 1
        index.set_ledger(name, ledger, store.revision, NOW)
    cluster = InMemoryCluster()
    for spec in pods:
        cluster.add_pod(spec)
    return LedgerRebuilder(cluster=cluster, index=index, write=store.write, quota_enabled=False,
                           claim_ttl_s=30.0, clock=lambda: NOW)  # fmt: skip


async def test_a_restart_over_an_intact_ledger_reads_and_writes_no_entry() -> None:
    index, store = ClusterIndex(), Store()
    rebuilder = cluster_of(index, store, {
        "a": [held("p1", "a", "GPU-a-0"), held("p2", "a", "GPU-a-1")],
        "b": [held("p3", "b", "GPU-b-0")],
    }, [bound_pod("p1", "a", "GPU-a-0"), bound_pod("p2", "a", "GPU-a-1"),
        bound_pod("p3", "b", "GPU-b-0")])  # fmt: skip
    report = await rebuilder.rebuild()
    assert store.calls == []  # before: one CAS read of every node holding a GPU pod
    assert report.restored == 0 and report.pods_seen == 3 and not report.unreadable
    # and the registrations were not built into models for it
    assert all(type(e.registered) is RegistrationWire for e in index.entries.values())


async def test_only_what_the_ledger_lacks_is_restored_next_to_what_it_holds() -> None:
    index, store = ClusterIndex(), Store()
    p1 = held("p1", "a", "GPU-a-0")
    rebuilder = cluster_of(index, store, {"a": [p1]}, [
        bound_pod("p1", "a", "GPU-a-0"), bound_pod("p2", "a", "GPU-a-1"),
        bound_pod("p3", "b", "GPU-b-0"),
    ])  # fmt: skip
    report = await rebuilder.rebuild()
    assert sorted(store.calls) == ["a", "b"] and report.restored == 2
    assert set(store.values["a"].allocations) == {"uid-p1", "uid-p2"}
    assert store.values["a"].allocations["uid-p1"] is p1  # what the ledger held: untouched
    assert set(store.values["b"].allocations) == {"uid-p3"}
    assert index.pod_nodes["uid-p2"] == "a" and index.pod_nodes["uid-p3"] == "b"
    assert index.node("a").ledger.allocations["uid-p2"].state == AllocationState.ALLOCATED


async def test_a_pod_the_index_places_elsewhere_is_not_restored_twice() -> None:
    index, store = ClusterIndex(), Store()
    rebuilder = cluster_of(index, store, {"a": [held("p1", "a", "GPU-a-0")]}, [
        bound_pod("p1", "b", "GPU-b-0"),  # the same uid, bound to b by its annotations
        bound_pod("p4", "b", "GPU-b-1"), {**bound_pod("p5", "b", "GPU-b-1"), "metadata": {
            **bound_pod("p5", "b", "GPU-b-1")["metadata"], "uid": "uid-p4"}},
    ])  # fmt: skip
    report = await rebuilder.rebuild()
    assert set(store.values["b"].allocations) == {"uid-p4"}  # once, not p1, not p4 twice
    assert report.restored == 1 and index.pod_nodes["uid-p1"] == "a"


async def test_a_grant_on_an_unknown_gpu_is_restored_and_reported() -> None:
    index, store = ClusterIndex(), Store()
    rebuilder = cluster_of(index, store, {}, [bound_pod("p6", "a", "GPU-gone")])
    report = await rebuilder.rebuild()
    assert report.restored == 1 and report.unknown_devices == ["default/p6 on a: GPU-gone"]


async def test_hostile_pods_in_the_listing_are_reported_not_fatal() -> None:
    index, store = ClusterIndex(), Store()
    listed_uid = bound_pod("p7", "a", "GPU-a-0")
    listed_uid["metadata"]["uid"] = ["not", "a", "string"]  # unhashable
    garbage = bound_pod("p8", "a", "GPU-a-1")
    garbage["metadata"]["annotations"][hami.ANN_DEVICES_TO_ALLOCATE] = "not;a:grant"
    rebuilder = cluster_of(index, store, {"a": [held("p1", "a", "GPU-a-0")]}, [
        listed_uid, garbage, bound_pod("p1", "a", "GPU-a-0"),
    ])  # fmt: skip
    report = await rebuilder.rebuild()
    assert len(report.unreadable) == 2 and report.restored == 0 and store.calls == []


async def test_pods_of_any_shape_are_reported_or_skipped_never_fatal() -> None:
    """Only an API server's schema makes `spec`, `status` and `metadata` objects: a listing from
    anything else may not, and one such pod must not stop every restart (the rebuild used to
    raise AttributeError and the scheduler never became ready)."""
    index, store = ClusterIndex(), Store()
    odd_spec, odd_status = bound_pod("p9", "a", "GPU-a-0"), bound_pod("p10", "a", "GPU-a-0")
    odd_spec["spec"] = ["a"]
    odd_status["status"] = ["Running"]
    odd_meta = {**bound_pod("p11", "a", "GPU-a-0"), "metadata": ["uid-p11"]}
    rebuilder = cluster_of(index, store, {}, [odd_spec, odd_status,
                                              bound_pod("p12", "a", "GPU-a-1")])  # fmt: skip
    cluster = rebuilder.cluster
    assert isinstance(cluster, InMemoryCluster)
    cluster.pods[("default", "p11")] = odd_meta
    cluster.pods[("default", "p13")] = ["not", "a", "pod"]  # type: ignore[assignment]
    report = await rebuilder.rebuild()
    assert sorted(report.unreadable) == [
        "default/p10: malformed pod (AttributeError(\"'list' object has no attribute 'get'\"))",
        "default/p9: malformed pod (AttributeError(\"'list' object has no attribute 'get'\"))",
    ]
    assert report.restored == 1 and set(store.values["a"].allocations) == {"uid-p12"}
