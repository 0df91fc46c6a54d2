"""A (re)started quota service frees the charges of pods the cluster no longer has before it
serves (deleted while no scheduler watched), and never a charge that may be a pod being placed."""

from __future__ import annotations

import time
import uuid

from quota_testkit import call, unique_namespace
from tessera.quota.stale_charges import dra_booked, gone_allocation, live_uids, stale_charges

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.dra_names import DRA_REASON
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    NodeLedger,
    QuotaCharge,
    QuotaReply,
    QuotaState,
    QuotaStatusRequest,
)

NOW = 10_000.0


def charge(uid: str, at: float) -> QuotaCharge:
    return QuotaCharge(pod_uid=uid, name=f"pod-{uid}", memory_mib=1000, cores=10, gpus=1, at=at)


def test_only_charges_older_than_the_listing_of_unlisted_or_finished_pods_go() -> None:
    pods = [{"metadata": {"uid": "live"}, "status": {"phase": "Running"}},
            {"metadata": {"uid": "done"}, "status": {"phase": "Succeeded"}},
            {"metadata": {}}, "not a pod"]  # fmt: skip
    live = live_uids(pods)
    assert live == frozenset({"live"})
    charges = {"live": charge("live", NOW - 600), "done": charge("done", NOW - 600),
               "gone": charge("gone", NOW - 600), "placing": charge("placing", NOW - 2),
               "later": charge("later", NOW + 1)}  # fmt: skip
    assert stale_charges(charges, live, NOW) == ["done", "gone"]
    old = Allocation(pod_uid="gone", namespace="n", name="g", node="x", containers=[],
                     created_at=NOW - 600)  # fmt: skip
    assert gone_allocation(live, NOW)(old)
    assert not gone_allocation(live, NOW)(old.model_copy(update={"pod_uid": "live"}))
    assert not gone_allocation(live, NOW)(old.model_copy(update={"created_at": NOW - 1}))


async def test_restart_frees_charges_of_pods_gone_before_it_serves(start_quota, nc,
                                                                   buckets: Buckets) -> None:
    """A previous run's state: charges and ledger entries of a pod since deleted (the scheduler
    has not released its entry yet) and of a live pod, and a fresh charge of a pod being placed."""
    ns, node = unique_namespace(), f"node-{uuid.uuid4().hex[:8]}"
    cluster = InMemoryCluster(implicit_nodes=True)
    live = cluster.add_pod({"metadata": {"name": "live", "namespace": ns},
                            "spec": {"containers": []}, "status": {"phase": "Running"}})
    live_uid = live["metadata"]["uid"]
    long_ago = time.time() - 600
    grant = DeviceGrant(uuid=f"GPU-{node}", type="NVIDIA-A100", memory_mib=1000, cores=10)
    ledger = NodeLedger(node=node, allocations={
        uid: Allocation(pod_uid=uid, namespace=ns, name=f"pod-{uid}", node=node,
                        containers=[[grant]], state=AllocationState.ALLOCATED, quota_held=True,
                        created_at=long_ago, updated_at=long_ago)
        for uid in ("gone", live_uid)
    })  # fmt: skip
    await bus.cas_update(buckets.ledger, node, NodeLedger, lambda _c: ledger)
    state = QuotaState(namespace=ns, charges={
        "gone": charge("gone", long_ago), live_uid: charge(live_uid, long_ago),
        "placing": charge("placing", time.time()),
    })  # fmt: skip
    await bus.cas_update(buckets.quota, ns, QuotaState, lambda _c: state)

    await start_quota(cluster=cluster)  # returns once serving
    reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert isinstance(reply, QuotaReply), reply
    assert set(reply.states[0].charges) == {live_uid, "placing"}
    assert reply.states[0].used().memory_mib == 2000


def test_a_gone_pods_dra_booking_keeps_its_charge() -> None:
    """The scheduler keeps a deleted pod's DRA booking while the claim is shared with a pod
    still running on that node, until the node's driver hands it on with its charge: neither
    path frees that charge meanwhile (a restart used to leave the slice outside the quota)."""
    old = Allocation(pod_uid="first", namespace="n", name="p", node="x", containers=[],
                     state=AllocationState.ALLOCATED, quota_held=True, created_at=NOW - 600,
                     reason=DRA_REASON)  # fmt: skip
    plain = old.model_copy(update={"pod_uid": "other", "reason": ""})
    booked = dra_booked([NodeLedger(node="x", allocations={"first": old, "other": plain})])
    assert booked == frozenset({"first"})
    charges = {"first": charge("first", NOW - 600), "other": charge("other", NOW - 600)}
    assert stale_charges(charges, frozenset(), NOW, booked=booked) == ["other"]
    assert not gone_allocation(frozenset(), NOW)(old)
    assert gone_allocation(frozenset(), NOW)(plain)


async def test_restart_keeps_the_charge_of_a_shared_claims_ended_pod(start_quota, nc,
                                                                     buckets: Buckets) -> None:
    """The quota service restarts between a shared claim's first pod's deletion and the
    hand-on: the charge the ledger's DRA booking stands for is kept; a gone pod's without a
    DRA booking still goes."""
    ns, node = unique_namespace(), f"node-{uuid.uuid4().hex[:8]}"
    cluster = InMemoryCluster(implicit_nodes=True)
    long_ago = time.time() - 600
    grant = DeviceGrant(uuid=f"GPU-{node}", type="NVIDIA-A100", memory_mib=1000, cores=10)
    ledger = NodeLedger(node=node, allocations={
        uid: Allocation(pod_uid=uid, namespace=ns, name=f"pod-{uid}", node=node,
                        containers=[[grant]], state=AllocationState.ALLOCATED, quota_held=True,
                        created_at=long_ago, updated_at=long_ago, reason=reason)
        for uid, reason in (("first", DRA_REASON), ("gone", ""))
    })  # fmt: skip
    await bus.cas_update(buckets.ledger, node, NodeLedger, lambda _c: ledger)
    state = QuotaState(namespace=ns, charges={
        "first": charge("first", long_ago), "gone": charge("gone", long_ago)})  # fmt: skip
    await bus.cas_update(buckets.quota, ns, QuotaState, lambda _c: state)

    await start_quota(cluster=cluster)  # neither pod is in the cluster
    reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert isinstance(reply, QuotaReply), reply
    assert set(reply.states[0].charges) == {"first"}
    assert reply.states[0].used().memory_mib == 1000
