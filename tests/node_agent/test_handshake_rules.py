"""The pure rules of the handshake and of dynamic limits (no sockets, no NATS)."""

from __future__ import annotations

from pathlib import Path

import pytest
from node_agent_rig import grants
from tessera.node_agent import handshake as hs
from tessera.node_agent import ledger_mutations as lm
from tessera.node_agent.containers import ContainerDir, PreparedContainer
from tessera.node_agent.foreign import ForeignUnknownError, hami_held
from tessera.node_agent.limits import LimitsError, apply_change, pod_usage_on
from test_in_flight import hami_pod

from tessera.bus import NoChange
from tessera.models import Allocation, AllocationState, DeviceInfo, InFlightClaim, NodeLedger
from tessera.settings import TesseraSettings

A, B = "GPU-aaaa", "GPU-bbbb"
DEVICES = {
    u: DeviceInfo(uuid=u, index=i, type="NVIDIA-x", memory_mib=10000, split_count=3)
    for i, u in enumerate((A, B))
}


def allocation(uid: str, containers, *, init_count: int = 0, state=AllocationState.BOUND):
    return Allocation(pod_uid=uid, namespace="ns", name=uid, node="n", containers=containers,
                      init_count=init_count, state=state,
                      container_names=[f"c{i}" for i in range(len(containers))])


def test_replica_ids_and_their_gpus():
    assert hs.replica_ids([DEVICES[A]]) == [f"{A}-0", f"{A}-1", f"{A}-2"]
    assert hs.gpus_of([f"{B}-2", f"{A}-0"], DEVICES) == [B, A]
    for bad in ([f"{A}-3"], ["GPU-zzzz-0"], [A], [f"{A}-x"]):
        with pytest.raises(hs.HandshakeError, match="unknown device IDs"):
            hs.gpus_of(bad, DEVICES)
    with pytest.raises(hs.HandshakeError, match="same GPU twice"):
        hs.gpus_of([f"{A}-0", f"{A}-1"], DEVICES)


def test_preferred_replicas_follow_the_grants():
    g = grants((B, 100, 10), (A, 100, 10))
    available = [f"{A}-0", f"{A}-1", f"{B}-1"]
    assert hs.preferred_replicas(g, available, [], 2, DEVICES, "x") == [f"{B}-1", f"{A}-0"]
    assert hs.preferred_replicas(g, available, [f"{A}-1"], 2, DEVICES, "x") == [f"{B}-1", f"{A}-1"]
    with pytest.raises(hs.HandshakeError, match="must include"):
        hs.preferred_replicas(grants((A, 1, 1)), available, [f"{B}-1"], 1, DEVICES, "x")
    with pytest.raises(hs.HandshakeError, match="no free replica of GPU"):
        hs.preferred_replicas(grants((B, 1, 1)), [f"{A}-0"], [], 1, DEVICES, "x")


def test_next_container_skips_containers_without_gpus():
    alloc = allocation("p", [[], grants((A, 1, 1)), [], grants((B, 1, 1))])
    assert hs.next_container(alloc, set()) == 1
    assert hs.next_container(alloc, {1}) == 3
    with pytest.raises(hs.HandshakeError, match="already allocated"):
        hs.next_container(alloc, {1, 3})


def test_env_sets_every_gpus_sm_limit_and_oversubscription(settings):
    alloc = allocation("p", [grants((A, 3000, 30), (B, 5000, 100))])
    env = hs.container_env(alloc, alloc.containers[0], settings)
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "30" and env["CUDA_DEVICE_SM_LIMIT_1"] == "100"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    scaled = settings.model_copy(update={"device_memory_scaling": 2.0})
    assert hs.container_env(alloc, alloc.containers[0], scaled)["CUDA_OVERSUBSCRIBE"] == "true"


def prepared(tmp_path: Path, pod: str, index: int, at: float, sealed: bool = False):
    cdir = ContainerDir(tmp_path / pod / str(index), PreparedContainer(
        pod_uid=pod, namespace="ns", pod=pod, container=f"c{index}", index=index,
        device_ids=[f"{A}-0"], grants=grants((A, 1, 1)), prepared_at=at,
    ))
    return cdir, sealed


def test_pick_prepared_goes_by_the_holding_pod_and_start_order(tmp_path):
    (init, _), (app, _) = prepared(tmp_path, "p", 0, 1.0), prepared(tmp_path, "p", 1, 2.0)
    (old, _) = prepared(tmp_path, "gone", 0, 0.5)
    holders = [("ns", "p", "c0"), ("ns", "p", "c1")]
    sealed: set[int] = set()
    chosen, _ = hs.pick_prepared([app, init, old], holders, lambda c: id(c) in sealed)
    assert chosen is init
    sealed.add(id(init))
    chosen, _ = hs.pick_prepared([app, init, old], holders, lambda c: id(c) in sealed)
    assert chosen is app
    chosen, why = hs.pick_prepared([old], holders, lambda c: False)
    assert chosen is None and "prepared for ns/gone" in why
    chosen, why = hs.pick_prepared([init], [("ns", "p", "other")], lambda c: False)
    assert chosen is None and "prepared for container c0" in why


def test_finish_and_reclaim_are_cas_bodies():
    alloc = allocation("p", [grants((A, 1, 1))])
    ledger = NodeLedger(node="n", allocations={"p": alloc},
                        claim=InFlightClaim(pod_uid="p", namespace="ns", name="p", expires_at=9))
    done = lm.finish_mutation("p", ledger)
    assert done.in_flight() == {} and done.allocations["p"].state == AllocationState.ALLOCATED
    with pytest.raises(NoChange):
        lm.finish_mutation("p", done)
    back = lm.reclaim_mutation("p", done, "agent", 30)
    assert set(back.claims) == {"p"} and back.allocations["p"].state == AllocationState.BOUND
    with pytest.raises(NoChange):  # in flight already: nothing to give back
        lm.reclaim_mutation("p", back, "agent", 30)


def test_finish_writes_once_and_leaves_the_read_value_alone():
    """A finish copies on write (the entry read is not changed under its reader), says whether
    it wrote (an Allocate finishes the pod; the PreStart after it has nothing left to write, so
    the pod is announced allocated once), and PreStart skips it when the entry shows it done."""
    alloc = allocation("p", [grants((A, 1, 1))])
    other = allocation("q", [grants((B, 1, 1))])
    claim = InFlightClaim(pod_uid="p", namespace="ns", name="p", expires_at=9)
    ledger = NodeLedger(node="n", allocations={"p": alloc, "q": other}, claims={"p": claim})
    assert lm.finish_pending("p", ledger)
    finish = lm.Finish("p")
    done = finish.mutate(ledger)
    assert finish.wrote
    assert ledger.allocations["p"].state == AllocationState.BOUND and "p" in ledger.claims
    assert done.allocations["p"].state == AllocationState.ALLOCATED and done.claims == {}
    assert done.allocations["q"] is other  # untouched allocations are not copied
    assert not lm.finish_pending("p", done)
    with pytest.raises(NoChange):
        finish.mutate(done)
    assert not finish.wrote  # the last attempt wrote nothing: no second announcement
    claimed_only = done.model_copy(update={"claims": {"p": claim}})
    assert lm.finish_pending("p", claimed_only)  # a claim left behind is still dropped


def test_in_flight_pods_oldest_claim_first_and_the_guess_among_equals():
    claims = {u: InFlightClaim(pod_uid=u, namespace="ns", name=u, taken_at=t, expires_at=99)
              for u, t in (("late", 5.0), ("early", 1.0))}
    pods = {
        "late": allocation("late", [grants((A, 1000, 10))]),
        "early": allocation("early", [grants((A, 2000, 10))]),
        "pair": allocation("pair", [grants((A, 1000, 10), (B, 1000, 10))]),
        "done": allocation("done", [grants((B, 1000, 10))], state=AllocationState.ALLOCATED),
    }
    ledger = NodeLedger(node="n", allocations=pods, claims=claims)
    order = [a.pod_uid for a in hs.in_flight(ledger)]
    assert order[:2] == ["early", "late"] and "done" not in order and "pair" in order
    flying = hs.in_flight(ledger)
    assert hs.choose_new_pod(flying, 1, {A}, None).pod_uid == "early"
    assert hs.choose_new_pod(flying, 1, {A}, "late").pod_uid == "late"
    assert hs.choose_new_pod(flying, 1, {B}, None) is None  # nobody was granted B alone
    assert hs.choose_new_pod(flying, 2, {A, B}, "late").pod_uid == "pair"


def test_swap_exchanges_grants_and_progress_of_one_shape_or_layout():
    a = allocation("a", [grants((A, 1000, 10))], state=AllocationState.ALLOCATED)
    b = allocation("b", [grants((B, 1000, 10))])
    c = allocation("c", [grants((B, 3000, 10))])
    claim = InFlightClaim(pod_uid="b", namespace="ns", name="b", expires_at=99)
    ledger = NodeLedger(node="n", allocations={"a": a, "b": b, "c": c}, claims={"b": claim})
    swapped = lm.swap_mutation("a", "b", ledger)
    assert swapped.allocations["b"].containers[0][0].uuid == A
    assert swapped.allocations["b"].state == AllocationState.ALLOCATED
    assert swapped.allocations["a"].containers[0][0].uuid == B
    assert swapped.allocations["a"].state == AllocationState.BOUND
    assert set(swapped.claims) == {"a"} and swapped.claims["a"].name == "a"
    # Without the cards' capacity, pods of other amounts are not exchanged.
    with pytest.raises(hs.HandshakeError, match="differ in layout"):
        lm.swap_mutation("a", "c", ledger)
    # Other amounts, one layout: each keeps its amounts on the other's card, if that fits.
    traded = lm.swap_mutation("a", "c", ledger, {A: (4000, 100), B: (4000, 100)})
    assert [(g.uuid, g.memory_mib) for g in traded.allocations["c"].containers[0]] == [(A, 3000)]
    assert [(g.uuid, g.memory_mib) for g in traded.allocations["a"].containers[0]] == [(B, 1000)]
    assert traded.allocations["c"].state == AllocationState.ALLOCATED
    with pytest.raises(hs.HandshakeError, match="overfill GPU"):
        lm.swap_mutation("a", "c", ledger, {A: (2000, 100), B: (8000, 100)})
    two = allocation("d", [grants((A, 1000, 10)), grants((B, 1000, 10))])
    with pytest.raises(hs.HandshakeError, match="differ in layout"):
        lm.swap_mutation("a", "d", ledger.model_copy(update={
            "allocations": {**ledger.allocations, "d": two}}), {A: (9000, 100), B: (9000, 100)})


def test_pod_usage_counts_init_containers_by_their_peak():
    alloc = allocation("p", [grants((A, 6000, 60)), grants((A, 2000, 20)), grants((A, 1000, 5))],
                       init_count=1)
    assert pod_usage_on(alloc, A) == (6000, 60)
    assert pod_usage_on(alloc.model_copy(update={"init_done": True}), A) == (3000, 25)
    assert pod_usage_on(alloc, B) == (0, 0)


def test_limit_raises_respect_the_gpus_capacity():
    mine = allocation("p", [grants((A, 4000, 40))], state=AllocationState.ALLOCATED)
    other = allocation("q", [grants((A, 5000, 50))], state=AllocationState.ALLOCATED)
    ledger = NodeLedger(node="n", allocations={"p": mine, "q": other})
    capacity = {A: (10000, 100)}
    new = apply_change(ledger, "p", 0, [A], 5000, 50, capacity)
    assert new.allocations["p"].containers[0][0].memory_mib == 5000
    with pytest.raises(LimitsError, match="not enough memory"):
        apply_change(ledger, "p", 0, [A], 5001, None, capacity)
    with pytest.raises(LimitsError, match="compute"):
        apply_change(ledger, "p", 0, [A], None, 51, capacity)
    released = ledger.model_copy(deep=True)
    released.allocations["q"].state = AllocationState.RELEASED
    assert apply_change(released, "p", 0, [A], 10000, None, capacity)


def test_allocate_serves_a_claimed_pod_the_scheduler_has_not_yet_marked_bound():
    """kubelet may call Allocate right after the cluster bind, before the scheduler's 'bound'
    write lands: the claim already names the pod, so it is served, and its expiry is dropped."""
    alloc = allocation("p", [grants((A, 1, 1))], state=AllocationState.RESERVED)
    alloc.expires_at = 100.0
    claim = InFlightClaim(pod_uid="p", namespace="ns", name="p", expires_at=9)
    ledger = NodeLedger(node="n", allocations={"p": alloc}, claims={"p": claim})
    assert hs.in_flight(ledger) == [ledger.allocations["p"]]
    done = lm.finish_mutation("p", ledger)
    assert done.allocations["p"].state == AllocationState.ALLOCATED
    assert done.allocations["p"].expires_at is None and done.in_flight() == {}
    released = allocation("p", [grants((A, 1, 1))], state=AllocationState.RELEASED)
    gone = NodeLedger(node="n", allocations={"p": released}, claims={"p": claim})
    assert hs.in_flight(gone) == []


def test_the_pod_under_admission_is_read_off_kubelets_list():
    """kubelet lists a pod from the start of its admission, its app containers (and native
    sidecars, not plain init containers) without devices until each one's Allocate returned."""
    done = allocation("done", [grants((A, 1000, 10))])
    under = allocation("under", [grants((A, 1000, 10)), grants((B, 1000, 10))])
    unseen = allocation("unseen", [grants((B, 1000, 10))])
    init_only = allocation("init", [grants((A, 500, 5)), grants((B, 500, 5))], init_count=1)
    listed = {("ns", "done"): {"c0"}, ("ns", "under"): {"c0"}, ("ns", "init"): {"c1"}}
    flying = [done, under, unseen, init_only]
    assert hs.kubelet_admitting(flying, listed) == {"under"}
    # A plain init container is never listed: a pod whose app containers hold devices is done.
    assert hs.kubelet_admitting([init_only], {("ns", "init"): set()}) == {"init"}
    side = init_only.model_copy(update={"sidecars": [0]})
    assert hs.kubelet_admitting([side], {("ns", "init"): {"c1"}}) == {"init"}  # sidecar c0 not
    assert hs.kubelet_admitting([side], {("ns", "init"): {"c0", "c1"}}) == set()


def test_reuse_pool_follows_kubelet_with_native_sidecars():
    pod = allocation("p", [grants((A, 500, 5), (B, 500, 5)), grants((A, 300, 5)),
                           grants((B, 400, 5))], init_count=2)
    assert lm.reuse_pool(pod, 2) == {A, B}  # a plain init container hands both on
    side = pod.model_copy(update={"sidecars": [1]})
    assert lm.reuse_pool(side, 1) == {A, B}
    assert lm.reuse_pool(side, 2) == {B}  # the sidecar keeps A


def test_hami_pods_held_on_the_node_and_hostile_shapes_fail_closed():
    """What HAMi's pods bound to the node hold per card (init peak vs app sum): Tessera's pods,
    finished pods, pods of other nodes and pods asking no GPU hold nothing; anything unreadable
    is ForeignUnknownError, never another exception and never a card left out."""
    settings = TesseraSettings()
    two = hami_pod("n1", "GPU-0,NVIDIA-A10,1000,10:;"
                         "GPU-0,NVIDIA-A10,500,5:GPU-1,NVIDIA-A10,700,7:;")
    two["spec"]["containers"].append({"name": "b", "resources": {"limits": {"nvidia.com/gpu": 1}}})
    mine = hami_pod("n1", "GPU-0,NVIDIA-A10,9000,90:;")
    mine["spec"]["schedulerName"] = settings.scheduler_name
    done = hami_pod("n1", "GPU-0,NVIDIA-A10,9000,90:;")
    done["status"]["phase"] = "Succeeded"
    elsewhere = hami_pod("n2", "GPU-0,NVIDIA-A10,9000,90:;")
    no_gpu = hami_pod("n1", "GPU-0,NVIDIA-A10,9000,90:;")
    no_gpu["spec"]["containers"][0]["resources"] = {}
    one = hami_pod("n1", "GPU-1,NVIDIA-A10,300,3:;")
    held = hami_held([two, mine, done, elsewhere, no_gpu, one], "n1", settings)
    assert held == {"GPU-0": (1500, 15), "GPU-1": (1000, 10)}
    assert hami_held([], "n1", settings) == {}
    for devices in ("GPU-0,broken;", ";", "GPU-0,NVIDIA-A10,99999999999,5:;"):
        with pytest.raises(ForeignUnknownError):
            hami_held([hami_pod("n1", devices)], "n1", settings)
    hostile = hami_pod("n1", "GPU-0,NVIDIA-A10,1000,10:;")
    hostile["spec"]["containers"] = "not a list"
    with pytest.raises(ForeignUnknownError):
        hami_held([hostile], "n1", settings)
    assert hami_held([{"metadata": 3}, {"spec": []}, {}], "n1", settings) == {}
