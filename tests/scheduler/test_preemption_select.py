"""Victim selection (services/scheduler/preemption.py): the chosen set is the cheapest the rule
allows, checked against brute force over every subset on small random clusters."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.preemption import (
    ClusterView,
    DisruptionBudget,
    NodeState,
    PreemptionQuery,
    fit_without,
    may_preempt,
    node_victims,
    pod_priority,
    select_victims,
    violations,
)
from tessera.scheduler.rules import PodOptions

from tessera.hami import ContainerRequest, PodRequest
from tessera.models import Allocation, AllocationState, DeviceGrant

from .factories import node

NOW = 1000.0


def alloc(node_name: str, uid: str, grants: list[tuple[str, int, int]], **kw) -> Allocation:
    return Allocation(
        pod_uid=uid, namespace="default", name=uid, node=node_name, state=AllocationState.BOUND,
        containers=[[DeviceGrant(uuid=u, type="NVIDIA-H100", memory_mib=m, cores=c)
                     for u, m, c in grants]], **kw,
    )  # fmt: skip


def request(count: int, mem: int, cores: int) -> PodRequest:
    return PodRequest(containers=[ContainerRequest(count, mem, None, cores)])


def query(
    req: PodRequest, priority: int, priorities: dict[str, int], budgets=()
) -> PreemptionQuery:
    return PreemptionQuery(
        pod_uid="preemptor", request=req, options=PodOptions(), priority=priority,
        priorities=priorities, budgets=tuple(budgets), now=NOW,
    )  # fmt: skip


def brute_force(nodes: list[NodeState], q: PreemptionQuery):
    """Every subset of allowed victims on every node: the least key, or None."""
    best = None
    for n in nodes:
        allowed = [a for a in n.allocations.values()
                   if q.priorities.get(a.pod_uid, q.priority) < q.priority]  # fmt: skip
        for size in range(1, len(allowed) + 1):
            for combo in itertools.combinations(allowed, size):
                if not fit_without(n, {a.pod_uid for a in combo}, q).ok:
                    continue
                key = (
                    violations(combo, q.budgets), size,
                    max(q.priorities[a.pod_uid] for a in combo),
                    sum(g.memory_mib for a in combo for gs in a.containers for g in gs),
                )  # fmt: skip
                best = key if best is None or key < best else best
    return best


# --- examples a person can check by eye -------------------------------------------------------


def full_node(name: str = "n1") -> NodeState:
    reg = node(name, gpus=2, memory_mib=16000, split=4)
    g0, g1 = reg.devices[0].uuid, reg.devices[1].uuid
    allocations = {
        "low-small": alloc(name, "low-small", [(g0, 4000, 0)]),
        "low-big": alloc(name, "low-big", [(g0, 12000, 0)]),
        "mid": alloc(name, "mid", [(g1, 10000, 0)]),
        "high": alloc(name, "high", [(g1, 6000, 0)]),
    }
    return NodeState(name, reg, allocations)


PRIOS = {"low-small": 1, "low-big": 1, "mid": 5, "high": 100}


def test_fewest_victims_then_lowest_priority_then_least_memory() -> None:
    n = full_node()
    # 10 GB on one card: freeing low-big (12 GB, prio 1) or mid (10 GB, prio 5) each works alone.
    chosen = node_victims(n, query(request(1, 10000, 0), 50, PRIOS))
    assert chosen is not None and [v.pod_uid for v in chosen.victims] == ["low-big"]
    assert chosen.key == (0, 1, 1, 12000)
    # 14 GB: only both pods of GPU 0 (16 GB) can make room; mid+high is not allowed (high >= 50).
    chosen = node_victims(n, query(request(1, 14000, 0), 50, PRIOS))
    assert chosen is not None and {v.pod_uid for v in chosen.victims} == {"low-small", "low-big"}


def test_equal_or_higher_priority_pods_are_never_victims() -> None:
    n = full_node()
    # Only GPU 1 could take 16 GB by evicting mid and high; high has priority 100 = the pod's.
    assert node_victims(n, query(request(2, 16000, 0), 100, PRIOS)) is None
    chosen = node_victims(n, query(request(1, 16000, 0), 5, PRIOS))
    assert chosen is not None and {v.pod_uid for v in chosen.victims} == {"low-small", "low-big"}
    assert node_victims(n, query(request(1, 16000, 0), 1, PRIOS)) is None


def test_a_pdb_violating_set_only_when_no_other_exists() -> None:
    n = full_node()
    budget = DisruptionBudget("default/keep-low-big", allowed=0, pods=frozenset({"low-big"}))
    chosen = node_victims(n, query(request(1, 10000, 0), 50, PRIOS, [budget]))
    assert chosen is not None and [v.pod_uid for v in chosen.victims] == ["mid"]
    assert chosen.violations == 0
    budget2 = DisruptionBudget("default/keep-mid", allowed=0, pods=frozenset({"mid"}))
    chosen = node_victims(n, query(request(1, 10000, 0), 50, PRIOS, [budget, budget2]))
    assert chosen is not None and chosen.violations == 1  # no clean set exists: the least bad


def test_claimed_victims_are_not_counted_twice() -> None:
    """A victim already being evicted for another pod (marked until its deadline) neither holds
    capacity nor can be chosen again; the nominee's reservation holds that capacity."""
    n = full_node()
    reg = n.registration
    g0 = reg.devices[0].uuid
    allocations = dict(n.allocations)
    allocations["low-big"] = allocations["low-big"].model_copy(
        update={"preempted_by": "first", "preempted_until": NOW + 30}
    )
    allocations["first"] = alloc("n1", "first", [(g0, 12000, 0)]).model_copy(
        update={"state": AllocationState.RESERVED, "expires_at": NOW + 30}
    )
    n2 = NodeState("n1", reg, allocations)
    prios = {**PRIOS, "first": 60}
    chosen = node_victims(n2, query(request(1, 10000, 0), 50, prios))
    assert chosen is not None and [v.pod_uid for v in chosen.victims] == ["mid"]


def test_priority_comes_from_spec_priority_and_never_preempts_policy() -> None:
    pod = {"spec": {"priority": 1000, "containers": []},
           "metadata": {"annotations": {"hami.io/task-priority": "0"}}}  # fmt: skip
    assert pod_priority(pod) == 1000 and may_preempt(pod)
    assert pod_priority({"spec": {}}) == 0
    assert not may_preempt({"spec": {"preemptionPolicy": "Never", "priority": 5}})


# --- the property: minimal among the sets the rule allows ---------------------------------------


@st.composite
def clusters(draw):
    nodes = []
    priorities: dict[str, int] = {}
    for ni in range(draw(st.integers(1, 4))):
        name = f"n{ni}"
        reg = node(name, gpus=draw(st.integers(1, 3)), memory_mib=8000,
                   split=draw(st.integers(2, 4)))  # fmt: skip
        free = {d.uuid: [8000, 100, d.split_count] for d in reg.devices}
        allocations = {}
        for ai in range(draw(st.integers(0, 6))):
            uuids = draw(st.lists(st.sampled_from(list(free)), min_size=1, max_size=2,
                                  unique=True))  # fmt: skip
            mem = draw(st.sampled_from([1000, 2000, 3000, 4000]))
            cores = draw(st.sampled_from([0, 20, 50]))
            if any(free[u][0] < mem or free[u][1] < cores or free[u][2] < 1 for u in uuids):
                continue
            for u in uuids:
                free[u][0] -= mem
                free[u][1] -= cores
                free[u][2] -= 1
            uid = f"{name}-a{ai}"
            allocations[uid] = alloc(name, uid, [(u, mem, cores) for u in uuids])
            priorities[uid] = draw(st.integers(0, 4))
        nodes.append(NodeState(name, reg, allocations))
    uids = [u for n in nodes for u in n.allocations]
    budgets = []
    for bi in range(draw(st.integers(0, 2))):
        if uids:
            pods = frozenset(draw(st.lists(st.sampled_from(uids), max_size=3)))
            budgets.append(DisruptionBudget(f"b{bi}", draw(st.integers(0, 1)), pods))
    req = request(draw(st.integers(1, 2)), draw(st.sampled_from([2000, 5000, 8000])),
                  draw(st.sampled_from([0, 30, 100])))  # fmt: skip
    return nodes, priorities, budgets, req, draw(st.integers(1, 5))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_chosen_set_is_minimal_among_allowed_sets(case) -> None:
    nodes, priorities, budgets, req, priority = case
    q = query(req, priority, priorities, budgets)
    expected = brute_force(nodes, q)
    chosen = select_victims(ClusterView.build(nodes, NOW), q)
    if expected is None:
        assert chosen is None
        return
    assert chosen is not None and chosen.exact
    assert chosen.key == expected
    # ...and the set really works, under the same fit code, with only lower-priority victims.
    by_name = {n.name: n for n in nodes}
    target = by_name[chosen.node]
    assert all(priorities[v.pod_uid] < priority for v in chosen.victims)
    assert fit_without(target, {v.pod_uid for v in chosen.victims}, q).ok
    # Per node the exact search agrees with brute force too.
    for n in nodes:
        found = node_victims(n, q)
        assert (found.key if found else None) == brute_force([n], q)


def test_fit_is_the_filters_fit() -> None:
    """The fit after eviction is computed by the filter's own fit_pod on the same cards."""
    n = full_node()
    q = query(request(1, 10000, 0), 50, PRIOS)
    chosen = node_victims(n, q)
    assert chosen is not None
    from tessera.scheduler.cards import build_cards

    kept = [a for u, a in n.allocations.items() if u not in {v.pod_uid for v in chosen.victims}]
    direct = fit_pod(build_cards(n.registration, kept, NOW), q.request, q.context())
    assert direct.ok and direct.containers == chosen.containers
