"""A backlog of unschedulable pods, retried by kube-scheduler's backoff, takes at most a bounded
share of the scheduler (`backlog.py`): the CPU of refused calls is metered against
`TESSERA_BACKLOG_SHARE`; over it, while other pods are being placed, a retry is answered at once
with `BacklogDeferred` (kube-scheduler retries after its backoff) and is evaluated again at the
latest `max_defer_s` later; with nothing else to place the backlog may take everything."""

from __future__ import annotations

import itertools
import random

from tessera.scheduler.backlog import DEFERRED, BacklogGovernor

from .conftest import MakeService, register, unique, wait_until
from .factories import GIB, container, node
from .factories import pod as make_pod

BACKOFF_MAX_S = 10.0  # kube-scheduler's podMaxBackoffSeconds


def run(governor: BacklogGovernor, seconds: float, placing: bool, backlog: int = 200,
        refusal_cpu_s: float = 0.05, placement_cpu_s: float = 0.002) -> dict[str, float]:
    """kube-scheduler's loop, on a simulated clock: one call at a time, a placeable pod whenever
    one is waiting (`placing`) and each backlog pod retried after its backoff (1 s doubling to
    10 s); each call's CPU advances the clock. What each kind of call took of it."""
    rng = random.Random(3)
    now = 0.0
    due = {f"pending-{i}": rng.random() for i in range(backlog)}  # next retry
    attempts = dict.fromkeys(due, 0)
    evaluated_at: dict[str, list[float]] = {uid: [] for uid in due}
    spent = {"refused": 0.0, "placed": 0.0, "deferred": 0.0}
    while now < seconds:
        uid = min(due, key=due.__getitem__)
        if due[uid] <= now:
            if governor.admit(uid, now):
                evaluated_at[uid].append(now)
                governor.charge(uid, refusal_cpu_s, True, now)
                spent["refused"] += refusal_cpu_s
                now += refusal_cpu_s
            else:
                spent["deferred"] += 1
                now += 0.00002
            attempts[uid] += 1
            due[uid] = now + min(BACKOFF_MAX_S, 2 ** (attempts[uid] - 1))
        elif placing:
            governor.charge(f"ok-{now}", placement_cpu_s, False, now)
            spent["placed"] += placement_cpu_s
            now += placement_cpu_s
        else:
            now = due[uid]
    gaps = [b - a for times in evaluated_at.values() for a, b in itertools.pairwise(times)]
    spent["longest_gap"] = max(gaps, default=0.0)
    spent["share"] = spent["refused"] / (spent["refused"] + spent["placed"])
    return spent


def test_the_backlog_takes_at_most_its_share_while_others_are_placed() -> None:
    """200 pods each retried every 10 s at 50 ms a refusal (pods of several containers, fitted
    node by node): unbounded they take most of the scheduler (next test: > 50 %). Bounded: the
    share, plus the burst, plus one evaluation per pod per `max_defer_s` (the liveness floor)."""
    share, burst, max_defer, seconds, pods, cost = 0.2, 0.25, 120.0, 600.0, 200, 0.05
    governor = BacklogGovernor(share=share, burst_s=burst, max_defer_s=max_defer)
    spent = run(governor, seconds, placing=True, backlog=pods, refusal_cpu_s=cost)
    assert spent["deferred"] > 0
    assert spent["share"] <= share + burst / seconds + pods * cost / max_defer, spent
    assert spent["share"] >= share / 2  # and it is used, not starved
    # no pod waits longer than max_defer_s plus one backoff between evaluations
    assert spent["longest_gap"] <= max_defer + BACKOFF_MAX_S + 1, spent


def test_with_nothing_else_to_place_the_backlog_is_evaluated_every_time() -> None:
    governor = BacklogGovernor(share=0.2, burst_s=0.25, max_defer_s=30.0)
    spent = run(governor, 120.0, placing=False)
    assert spent["deferred"] == 0 and governor.deferred == 0


def test_share_one_turns_the_bound_off() -> None:
    governor = BacklogGovernor(share=1.0)
    spent = run(governor, 120.0, placing=True)
    assert spent["deferred"] == 0
    assert spent["share"] > 0.5  # what the backlog takes unbounded, for comparison


def test_a_new_pod_or_one_placed_since_is_never_deferred() -> None:
    governor = BacklogGovernor(share=0.1, burst_s=0.0, max_defer_s=30.0)
    governor.charge("placed", 0.001, False, 0.0)  # others are being placed
    governor.charge("stuck", 1.0, True, 0.1)  # credit far below zero
    assert not governor.admit("stuck", 0.2)
    assert governor.admit("new", 0.2)
    governor.charge("stuck", 0.0, False, 0.3)  # it was placed after all
    assert governor.admit("stuck", 0.4)
    governor.charge("stuck", 1.0, True, 0.5)
    assert not governor.admit("stuck", 0.6)
    assert governor.admit("stuck", 30.6)  # max_defer_s after its last evaluation


async def test_the_service_defers_retries_over_the_share(make_service: MakeService,
                                                         cluster: object) -> None:
    """Through the filter: a pod refused once, retried while other pods are placed and the
    share is spent, is answered with the BacklogDeferred error and reserves nothing; a new
    pod that fits is placed meanwhile."""
    service = await make_service(config={"backlog_share": 0.001, "backlog_burst_s": 0.0})
    prefix = unique("backlog")
    names = [f"{prefix}-{i}" for i in range(4)]
    for name in names:
        await register(service.buckets, node(name, gpus=1, memory_mib=10 * GIB))
    await wait_until(lambda: all(service.index.node(name) is not None for name in names))
    too_big = cluster.add_pod(make_pod(container(mem=20 * GIB)))  # type: ignore[attr-defined]
    first = await service.scheduler.filter(too_big, names)
    assert not first.nodenames and len(first.failed) == len(names) and not first.error
    fits = cluster.add_pod(make_pod(container(mem=GIB)))  # type: ignore[attr-defined]
    placed = await service.scheduler.filter(fits, names)
    assert placed.nodenames and len(placed.nodenames) == 1
    retry = await service.scheduler.filter(too_big, names)
    assert retry.error.startswith(DEFERRED), retry
    assert not retry.nodenames and not retry.failed
    another = cluster.add_pod(make_pod(container(mem=GIB)))  # type: ignore[attr-defined]
    assert (await service.scheduler.filter(another, names)).nodenames


def test_who_could_be_evicted_is_known_without_a_scan_of_every_pod() -> None:
    """Every refusal asks whether preemption could help (any pod of lower priority): answered
    from counts per priority kept as the pod watch reports pods, not a scan of every pod per
    refusal; correct as pods come, change priority and go."""
    from tessera.scheduler.preemption_run import Preemptor

    from tessera.cluster.port import WatchEvent

    preemptor = Preemptor(*([None] * 7), instance="t")  # type: ignore[arg-type]

    def event(kind: str, uid: str, priority: int) -> WatchEvent:
        return WatchEvent(type=kind, object={"metadata": {"uid": uid, "name": uid},
                                             "spec": {"priority": priority}})  # fmt: skip

    assert preemptor._lowest_priority() is None
    for i in range(50):
        preemptor.observe_pod(event("ADDED", f"p{i}", 100 + i))
    assert preemptor._lowest_priority() == 100
    preemptor.observe_pod(event("MODIFIED", "p0", 500))
    assert preemptor._lowest_priority() == 101
    preemptor.observe_pod(event("DELETED", "p1", 101))
    assert preemptor._lowest_priority() == 102
    assert preemptor._lowest_priority() == min(f.priority for f in preemptor.pods.values())
