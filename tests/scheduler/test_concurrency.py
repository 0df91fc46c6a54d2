"""Two scheduler replicas, one NATS, a burst of random pods: no GPU is ever over capacity.

A fake node agent plays Allocate (marks bound pods allocated, releases the claim); a checker
watches every ledger revision of the test's nodes and records any GPU over memory, cores or
slots. Pods are deleted at random meanwhile, so releases race with reservations. Afterwards
every deleted pod's allocation must leave the ledger within the bound the scheduler README
states (the pod watch at once; the periodic reconcile when the watch missed it).

Bounded on a loaded machine: new pods start only during PLACE_BUDGET_S (a starved run places
fewer, still 32 at a time), and the wait for releases ends at the README's bound. What made a
run under double CI load outlast pytest's 300 s (session 6): 1000 pods took up to ~85 s to
place beside two CPU hogs (17 s quiet), and each replica's pod watch, awaiting every release
in turn, ended the burst ~750 events behind: deleted pods' GPUs stayed held up to 38 s after
the deletion (past the README's bound; fixed in the runtime: releases run off the watch), so
most pods were refused; the old final loop (100 tries, 0.1 s apart, six KV reads each) then
neither waited for the stated bound nor ended at one.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from tessera.scheduler.cards import build_cards, over_capacity
from tessera.scheduler.runtime import SchedulerService

from tessera import bus, hami
from tessera.bus import Buckets
from tessera.cancelling import cancel_and_wait
from tessera.cluster.memory import InMemoryCluster
from tessera.models import AllocationState, NodeLedger

from .conftest import MakeService, agent_allocate, register, unique, wait_until
from .factories import GIB, container, node, pod

PODS = 400
NODES = 3
GPUS = 4
PLACE_BUDGET_S = 60.0  # no pod starts after this (a quiet machine places all 400 in ~15 s)
MIN_BOUND = 100  # pods bound: enough to have raced (a quiet run binds ~380)
# The runtime's reconcile releases only allocations older than its listing by this much
# (services/scheduler/runtime.py `_reconcile_loop`): a pod deleted just before a listing
# waits for the next one.
LISTING_SLACK_S = 5.0
LOADED_MARGIN_S = 10.0  # a reconcile pass on a starved machine (list 1000 pods, release each)
# "On the pod watch event (at once)": the median deleted pod's allocation is gone this soon
# (400 pods beside two CPU hogs, load 5-6: 0.4-0.6 s; when the watch awaited each release in
# turn: 2.7 s quiet, 16-21 s beside the hogs, with 70 % of the pods refused meanwhile). Beside a
# single-threaded benchmark at load ~9 one run saw 1.7 s: the bound keeps room for that and still
# fails the old runtime.
AT_ONCE_S = 2.5
# A wall-clock bound on background work stretches with the host's load, and so does the burst
# itself: the median lag may also be a tenth of the burst's placing time (a quiet burst takes
# ~15 s, so the bound stays 2.5 s there; a starved one up to PLACE_BUDGET_S plus its last
# pods). The old runtime still fails it: 2.7 s on a quiet 15 s burst, 16-21 s beside two hogs,
# where no burst can stretch the bound past ~7 s (no pod starts after PLACE_BUDGET_S).
AT_ONCE_SHARE = 0.1


def random_pod(rng: random.Random, namespace: str) -> dict[str, Any]:
    count = rng.choice([1, 1, 1, 2])
    if rng.random() < 0.3:
        spec = container(gpus=count, pct=rng.choice([10, 25, 50]), cores=rng.choice([0, 20, 50]))
    else:
        cores = rng.choice([0, 10, 30, 50, 100]) if rng.random() < 0.9 else 100
        spec = container(gpus=count, mem=rng.randint(1, 40) * GIB, cores=cores)
    annotations = {"hami.io/gpu-scheduler-policy": rng.choice(["binpack", "spread"])}
    return pod(spec, namespace=namespace, annotations=annotations)


@dataclass
class Observed:
    """What the checker saw: overfills, ledger revisions, and how long each deleted pod's
    allocation stayed in the ledger after the deletion (seconds, as the checker saw it)."""

    violations: list[str] = field(default_factory=list)
    revisions: int = 0
    deleted_at: dict[str, float] = field(default_factory=dict)  # uid -> time.time() of delete
    release_lags: list[float] = field(default_factory=list)


async def fake_agent_and_checker(
    buckets: Buckets, registrations: dict[str, Any], seen: Observed
) -> None:
    allocating: set[str] = set()  # one Allocate per pod, as kubelet makes (no CAS storm)
    held: dict[str, set[str]] = {}  # node -> uids its last revision held
    async for key, value, _revision in bus.watch_models(buckets.ledger, NodeLedger):
        if key not in registrations or value is None:
            continue
        seen.revisions += 1
        now = time.time()
        for uid in held.get(key, set()) - value.allocations.keys():
            if uid in seen.deleted_at:
                seen.release_lags.append(now - seen.deleted_at[uid])
        held[key] = set(value.allocations)
        # At the clock of the moment the revision is seen: a reservation that has lapsed
        # holds nothing (the scheduler may give its room away), so a clock of 0 would report
        # a lapsed reservation and its successor as an overfill that never was.
        cards = build_cards(registrations[key], value.allocations.values(), now)
        seen.violations.extend(over_capacity(cards))
        for claim in value.in_flight().values():
            allocation = value.allocations.get(claim.pod_uid)
            if (allocation is not None and allocation.state == AllocationState.BOUND
                    and claim.pod_uid not in allocating):
                allocating.add(claim.pod_uid)
                asyncio.get_running_loop().create_task(agent_allocate(buckets, key, claim.pod_uid))


async def place(
    replicas: list[SchedulerService],
    cluster: InMemoryCluster,
    spec: dict[str, Any],
    names: list[str],
    rng: random.Random,
    stats: dict[str, int],
    deleted_at: dict[str, float],
) -> None:
    spec = cluster.add_pod(spec)
    meta = spec["metadata"]
    for _attempt in range(5):  # kube-scheduler retries an unschedulable pod after a backoff
        outcome = await rng.choice(replicas).scheduler.filter(spec, names)
        if outcome.nodenames:
            break
        await asyncio.sleep(0.05)
    else:
        stats["refused"] += 1
        return
    error = await rng.choice(replicas).scheduler.bind(
        meta["namespace"], meta["name"], meta["uid"], outcome.nodenames[0]
    )
    if error:
        stats["bind_errors"] += 1
        print(f"bind error: {error[:160]}")
        return
    stats["bound"] += 1
    if rng.random() < 0.98:  # nearly every pod ends soon, so capacity keeps turning over
        await asyncio.sleep(rng.uniform(0, 0.2))
        deleted_at[meta["uid"]] = time.time()
        cluster.delete_pod(meta["namespace"], meta["name"])


async def test_two_replicas_never_overfill_a_gpu(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    rng = random.Random(20261129)
    replicas = [await make_service(), await make_service()]
    registrations = {}
    for _ in range(NODES):
        registration = node(unique("c"), gpus=GPUS, memory_mib=80 * GIB, split=10)
        registrations[registration.node] = registration
        await register(buckets, registration)
    names = list(registrations)
    for replica in replicas:
        await wait_until(lambda r=replica: all(r.index.node(n) for n in names))
    seen = Observed()
    checker = asyncio.create_task(fake_agent_and_checker(buckets, registrations, seen))

    async def heartbeat() -> None:  # as node agents do: a loaded run outlives 2 x node TTL
        while True:
            await asyncio.sleep(2.0)
            for registration in registrations.values():
                fresh = registration.model_copy(update={"heartbeat_at": time.time()})
                await register(buckets, fresh)

    beating = asyncio.create_task(heartbeat())
    stats = {"bound": 0, "refused": 0, "bind_errors": 0, "not_started": 0}
    namespace = unique("ns")
    gate = asyncio.Semaphore(32)
    started = time.perf_counter()

    async def one(spec: dict[str, Any]) -> None:
        async with gate:
            if time.perf_counter() - started > PLACE_BUDGET_S:
                stats["not_started"] += 1
                return
            await place(replicas, cluster, spec, names, rng, stats, seen.deleted_at)

    await asyncio.gather(*(one(random_pod(rng, namespace)) for _ in range(PODS)))
    placed_s = time.perf_counter() - started
    # The checker (and fake agent) must have run throughout: a watch that died early (a NATS
    # timeout on a starved machine) would leave the overfill check vacuous.
    assert not checker.done(), checker.exception()
    assert seen.violations == [], seen.violations[:10]
    # The checker really saw the ledger move: a bound pod writes its node's entry at least
    # three times (reservation with its claim, bound, allocated) and once more when it ends;
    # half of that leaves room for a checker that lags on a loaded machine.
    assert seen.revisions >= 2 * stats["bound"] > 0, (seen.revisions, stats)
    # Enough pods went through to have raced (on a loaded 2-core machine fewer are bound
    # before their retries run out; the property under test is the absence of overfill).
    assert stats["bound"] >= MIN_BOUND, stats
    assert sum(stats.values()) == PODS, stats

    # Final state: every GPU within capacity; every allocation that is not a reservation
    # belongs to a live pod whose annotation matches the ledger's grants exactly, once the
    # deletions are processed. The README's bound for that: at once on the pod watch event,
    # at worst the reconcile interval (plus its listing slack) when the watch missed it.
    live = {p["metadata"]["uid"]: p for p in cluster.pods.values()}
    reconcile_s = max(r.config.reconcile_interval_s for r in replicas)
    bound_s = reconcile_s + LISTING_SLACK_S + LOADED_MARGIN_S
    last_delete = max(seen.deleted_at.values(), default=time.time())

    async def leftovers() -> list[str]:
        stale = []
        for name, registration in registrations.items():
            entry = await bus.read(buckets.ledger, name, NodeLedger)
            assert entry is not None
            allocations = entry.value.allocations
            assert over_capacity(build_cards(registration, allocations.values(), time.time())) == []
            for uid, allocation in allocations.items():
                if allocation.state == AllocationState.RESERVED:
                    continue
                if uid not in live:
                    ago = time.time() - seen.deleted_at.get(uid, last_delete)
                    stale.append(f"{uid} ({allocation.state.value}) deleted {ago:.1f} s ago "
                                 f"still holds {name}")  # fmt: skip
                    continue
                annotation = live[uid]["metadata"]["annotations"][hami.ANN_DEVICES_TO_ALLOCATE]
                assert hami.decode_pod_devices(annotation) == allocation.containers
        return stale

    settle_started = time.perf_counter()
    polls = 0
    while True:
        polls += 1
        stale = await leftovers()
        if not stale or time.time() > last_delete + bound_s:
            break
        await asyncio.sleep(0.25)
    settle_s = time.perf_counter() - settle_started
    backlog = [q.qsize() for q in getattr(cluster, "_pod_watchers", [])]  # diagnostic only
    # Both loops await bus replies: Python 3.11's wait_for can drop a cancel that lands with a
    # reply (CI hung here for 300 s), so cancel until they have ended.
    assert not await cancel_and_wait([checker, beating]), "checker or heartbeat did not stop"
    assert stale == [], (
        f"{len(stale)} allocations of deleted pods outlived the stated release bound "
        f"({bound_s:.0f} s after the last deletion; pod watch queues now {backlog}): {stale[:5]}"
    )
    lags = sorted(seen.release_lags) or [0.0]
    # Released on the watch event, during the burst too (a deleted pod's GPUs held until the
    # burst ends refuse new pods meanwhile), never later than the README's worst case.
    at_once_s = max(AT_ONCE_S, AT_ONCE_SHARE * placed_s)
    assert lags[len(lags) // 2] <= at_once_s and lags[-1] <= bound_s, (
        f"release after deletion: median {lags[len(lags) // 2]:.1f} s, max {lags[-1]:.1f} s "
        f"(bounds {at_once_s:.1f} s for a {placed_s:.0f} s burst, {bound_s:.0f} s)"
    )
    print(f"{PODS} pods, {placed_s:.1f} s placing, {settle_s:.1f} s until every deleted pod's "
          f"allocation was gone ({polls} polls); release after deletion (as the checker saw "
          f"it) p50 {lags[len(lags) // 2]:.2f} s, max {lags[-1]:.2f} s over {len(lags)}: {stats}")
