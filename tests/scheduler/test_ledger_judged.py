"""LedgerGuard judges a node's ledger entry again only where it changed, with the very verdict
(and the very problem) `tessera.validation.ledger_problem` gives for the whole entry."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.ledger_codec import LedgerCodec
from tessera.scheduler.validation import LedgerGuard

from tessera.codec import encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    MigInstanceGrant,
    NodeLedger,
    NodeRegistration,
)
from tessera.validation import Bounds, Rejections, ledger_problem

from .factories import GIB, node

NOW = 1_000.0


def grant(registration: NodeRegistration, card: int, mem: int, **kw: object) -> DeviceGrant:
    d = registration.devices[card]
    return DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=mem, cores=10, **kw)  # type: ignore[arg-type]


def allocation(uid: str, registration: NodeRegistration, *grants: DeviceGrant,
               **kw: object) -> Allocation:  # fmt: skip
    return Allocation(
        pod_uid=uid, namespace="ns", name=uid, node=registration.node,
        containers=[list(grants)], state=AllocationState.ALLOCATED, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture
def guard() -> LedgerGuard:
    index = ClusterIndex()
    return LedgerGuard(
        bounds=Bounds(), index=index, ledger_kv=None,  # type: ignore[arg-type]
        rejections=Rejections("scheduler", None, CollectorRegistry()), clock=lambda: NOW,
    )  # fmt: skip


def written(codec: LedgerCodec, key: str, ledger: NodeLedger) -> NodeLedger:
    """What the watch hands the guard: the value as the codec decodes it off the wire (the
    allocations that did not change are the objects of the value before)."""
    return codec.decode(key, encode(ledger))


async def test_a_changed_allocation_over_its_card_is_rejected_with_the_whole_entrys_problem(
    guard: LedgerGuard,
) -> None:
    registration = node("n1", gpus=2)
    guard.index.set_registration("n1", registration, NOW)
    codec = LedgerCodec()
    allocations = {f"p{i}": allocation(f"p{i}", registration, grant(registration, i % 2, GIB))
                   for i in range(6)}  # fmt: skip
    first = written(codec, "n1", NodeLedger(node="n1", allocations=allocations))
    assert guard.ledger_ok("n1", first, 1)
    # One pod's grant is rewritten beyond its card (80 GiB): only it changed.
    bad = dict(first.allocations)
    bad["p3"] = allocation("p3", registration, grant(registration, 1, 81 * GIB))
    second = written(codec, "n1", first.model_copy(update={"allocations": bad}))
    assert second.allocations["p0"] is first.allocations["p0"]  # unchanged: the same object
    assert not guard.ledger_ok("n1", second, 2)
    problem = guard.quarantined["n1"][1]
    assert problem == ledger_problem("n1", second, registration, guard.bounds, NOW)
    assert problem.code == "grant_above_capacity" and "ns/p3" in problem.detail
    await guard.stop()


async def test_new_devices_judge_every_allocation_again(guard: LedgerGuard) -> None:
    registration = node("n1", gpus=2)
    guard.index.set_registration("n1", registration, NOW)
    codec = LedgerCodec()
    big = allocation("big", registration, grant(registration, 0, 60 * GIB))
    first = written(codec, "n1", NodeLedger(node="n1", allocations={"big": big}))
    assert guard.ledger_ok("n1", first, 1)
    # The node re-registers with smaller cards; the next write leaves `big` unchanged.
    smaller = node("n1", gpus=2, memory_mib=40 * GIB)
    guard.index.set_registration("n1", smaller, NOW)
    other = allocation("small", smaller, grant(smaller, 1, GIB))
    second = written(codec, "n1", first.model_copy(
        update={"allocations": {**first.allocations, "small": other}}))  # fmt: skip
    assert second.allocations["big"] is first.allocations["big"]
    assert not guard.ledger_ok("n1", second, 2)
    assert guard.quarantined["n1"][1] == ledger_problem("n1", second, smaller, guard.bounds, NOW)
    await guard.stop()


async def test_an_unbacked_preemption_mark_on_a_changed_allocation_is_rejected(
    guard: LedgerGuard,
) -> None:
    registration = node("n1", gpus=1)
    guard.index.set_registration("n1", registration, NOW)
    codec = LedgerCodec()
    victim = allocation("v", registration, grant(registration, 0, GIB))
    first = written(codec, "n1", NodeLedger(node="n1", allocations={"v": victim}))
    assert guard.ledger_ok("n1", first, 1)
    marked = victim.model_copy(update={"preempted_by": "ghost", "preempted_until": NOW + 60})
    second = written(codec, "n1", NodeLedger(node="n1", allocations={"v": marked}))
    assert not guard.ledger_ok("n1", second, 2)
    assert guard.quarantined["n1"][1].code == "preemption_mark_unbacked"
    await guard.stop()


async def test_random_writes_get_the_whole_entrys_verdict(guard: LedgerGuard) -> None:
    """A node agent (or anyone) rewriting the entry at random, one or two allocations at a
    time, sometimes beyond a card, sometimes with a MIG grant or a mark, sometimes from a new
    registration: every verdict is the full check's, and so is every problem."""
    rng = random.Random(7)
    registrations = [node("n1", gpus=2), node("n1", gpus=2, memory_mib=40 * GIB)]
    registration = registrations[0]
    guard.index.set_registration("n1", registration, NOW)
    codec = LedgerCodec()
    current = NodeLedger(node="n1")
    verdicts = []
    for revision in range(1, 300):
        if rng.random() < 0.03:
            registration = rng.choice(registrations).model_copy(deep=True)
            guard.index.set_registration("n1", registration, NOW)
        allocations = dict(current.allocations)
        for _ in range(rng.choice([1, 1, 2])):
            uid = f"p{rng.randrange(12)}"
            roll = rng.random()
            if roll < 0.1 and allocations:
                allocations.pop(rng.choice(list(allocations)))
                continue
            extra: dict[str, object] = {}
            mem = rng.choice([GIB, 8 * GIB, 30 * GIB] * 4 + [50 * GIB, 90 * GIB])
            kw: dict[str, object] = {}
            if roll > 0.95:
                kw["mig"] = MigInstanceGrant(profile="1g.10gb", start=0, size=1)
            if 0.9 < roll <= 0.95:
                extra = {"preempted_by": rng.choice(["ghost", "p0"]),
                         "preempted_until": NOW + rng.choice([1, 100])}  # fmt: skip
            allocations[uid] = allocation(
                uid, registration, grant(registration, rng.randrange(2), mem, **kw), **extra
            )
        value = written(codec, "n1", current.model_copy(update={"allocations": allocations}))
        expected = ledger_problem("n1", value, guard.index.entries["n1"].registered,
                                  guard.bounds, NOW)  # fmt: skip
        ok = guard.ledger_ok("n1", value, revision)
        assert ok == (expected is None)
        if not ok:
            assert guard.quarantined["n1"][1] == expected
        verdicts.append(ok)
        if ok or rng.random() < 0.2:  # a rejected value is sometimes written over
            current = value
    assert 20 < sum(verdicts) < len(verdicts) - 20  # both verdicts were exercised
    await guard.stop()
