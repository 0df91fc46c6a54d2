"""An entry read whole at start-up (a `LedgerWire` whose usage `wire_fast.slim_all` counted) is
judged on its sums per GPU (`validation._counted_within`) with the very verdict, and on a
refusal the very problem, that `tessera.validation.ledger_problem` gives the decoded entry:
valid entries, and entries forged in every way a per-allocation check looks at."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tessera.scheduler import wire_fast
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.ledger_codec import LedgerCodec
from tessera.scheduler.registration_codec import RegistrationCodec
from tessera.scheduler.validation import LedgerGuard, _counted_within

from tessera.codec import decode, encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    NodeLedger,
)
from tessera.validation import Bounds, Rejections, ledger_problem

from .factories import GIB, node

NOW = 1_000.0
HOLDING = [AllocationState.ALLOCATED, AllocationState.BOUND]
STATES = HOLDING * 4 + [AllocationState.RESERVED, AllocationState.RELEASED,
                        AllocationState.FAILED]  # fmt: skip


@pytest.fixture
def guard() -> LedgerGuard:
    return LedgerGuard(
        bounds=Bounds(), index=ClusterIndex(), ledger_kv=None,  # type: ignore[arg-type]
        rejections=Rejections("scheduler", None, CollectorRegistry()), clock=lambda: NOW,
    )  # fmt: skip


def a_registration(rng: random.Random) -> Any:
    """The node's registration as the index may hold it: a model, the unbuilt wire form, none,
    smaller cards, or (forged past validation) one GPU listed twice."""
    roll = rng.random()
    if roll < 0.1:
        return None
    registration = node("n1", gpus=2, memory_mib=rng.choice([80 * GIB, 80 * GIB, 40 * GIB]),
                        cores=rng.choice([100, 100, 50]))  # fmt: skip
    if roll < 0.15:
        twice = [registration.devices[0], registration.devices[0].model_copy(
            update={"memory_mib": 10 * GIB})]  # fmt: skip
        return registration.model_copy(update={"devices": twice})
    if roll < 0.55:
        wire = RegistrationCodec().read(encode(registration))
        assert isinstance(wire, wire_fast.RegistrationWire)
        return wire
    return registration


def an_allocation(rng: random.Random, uid: str, plain: bool) -> Allocation:
    """A pod's allocation on n1; unless `plain`, sometimes forged where one check looks."""
    uuids = ["GPU-n1-0", "GPU-n1-1"] * 4 + ["GPU-elsewhere"]

    def grant() -> DeviceGrant:
        return DeviceGrant(
            uuid=rng.choice(uuids), type="NVIDIA-H100",
            memory_mib=rng.choice([GIB, 8 * GIB, 20 * GIB] * 5 + [45 * GIB, 90 * GIB,
                                                                 400 * GIB]),
            cores=rng.choice([0, 10, 20] * 5 + [60, 120]),
        )  # fmt: skip

    containers = [[grant()] for _ in range(rng.choice([1, 1, 1, 2]))]
    fields: dict[str, Any] = {
        "pod_uid": uid, "namespace": rng.choice(["ns", "other"]), "name": f"pod-{uid}",
        "node": "n1", "containers": containers, "state": rng.choice(STATES),
        "expires_at": rng.choice([None, NOW - 5, NOW + 50]),
    }  # fmt: skip
    if not plain:
        roll = rng.random()
        if roll < 0.06:
            fields["pod_uid"] = uid + "-forged"
        elif roll < 0.12:
            fields["node"] = "n9"
        elif roll < 0.18:
            containers[0] = [containers[0][0], containers[0][0].model_copy()]  # a GPU twice
        elif roll < 0.22:
            containers[0] = [containers[0][0], grant()]
        elif roll < 0.26:
            fields["containers"] = [[] for _ in range(257)]
        elif roll < 0.32:
            fields["init_count"] = rng.choice([1, len(containers), len(containers) + 1])
        elif roll < 0.36:
            fields["preempted_until"] = NOW + 60
        elif roll < 0.40:
            fields["preempted_by"] = rng.choice(["ghost", uid])
        elif roll < 0.44:
            fields["preempted_by"] = "ghost"
            fields["preempted_until"] = rng.choice([NOW + 60, NOW - 60])
    return Allocation(**fields)


async def test_entries_read_at_start_up_get_the_whole_entrys_verdict(guard: LedgerGuard) -> None:
    rng = random.Random(11)
    counted = accepted = 0
    codes: set[str] = set()
    for revision in range(1, 1500):
        key = "n1" if rng.random() < 0.95 else "n2"
        registration = a_registration(rng)
        guard.index = ClusterIndex()
        if registration is not None:
            guard.index.set_registration(key, registration, NOW)
        plain = rng.random() < 0.5
        allocations = {f"p{i}": an_allocation(rng, f"p{i}", plain)
                       for i in range(rng.randrange(1, 7))}  # fmt: skip
        payload = encode(NodeLedger(node="n1", allocations=allocations))
        wire = LedgerCodec().read(key, payload)  # a replica that holds nothing of the node
        assert type(wire) is wire_fast.LedgerWire
        expected = ledger_problem(key, decode(payload, NodeLedger), registration, guard.bounds,
                                  NOW)  # fmt: skip
        if _counted_within(key, wire, registration, guard.bounds):
            counted += 1
            assert expected is None, expected
        ok = guard.ledger_ok(key, wire, revision)
        assert ok == (expected is None)
        if ok:
            accepted += 1
        else:
            assert guard.quarantined[key][1] == expected
            codes.add(expected.code)  # type: ignore[union-attr]
    # Both verdicts, both ways of reaching "valid", and every kind of forgery were exercised.
    assert counted > 150 and accepted - counted > 150 and accepted < 1300
    assert codes >= {"key_mismatch", "container_count", "grant_duplicate",
                     "grant_above_capacity", "preemption_mark", "preemption_mark_unbacked"}
    await guard.stop()


async def test_sums_over_a_card_are_judged_grant_by_grant(guard: LedgerGuard) -> None:
    """Two pods whose grants each fit a card but together exceed it (an over-committed card,
    which `ledger_problem` accepts): the sums do not clear the entry, the full check does."""
    registration = node("n1", gpus=1)
    guard.index.set_registration("n1", registration, NOW)
    allocations = {
        uid: Allocation(pod_uid=uid, namespace="ns", name=uid, node="n1",
                        state=AllocationState.ALLOCATED, containers=[[DeviceGrant(
                            uuid="GPU-n1-0", type="NVIDIA-H100", memory_mib=50 * GIB,
                            cores=60)]])
        for uid in ("a", "b")
    }  # fmt: skip
    wire = LedgerCodec().read("n1", encode(NodeLedger(node="n1", allocations=allocations)))
    assert type(wire) is wire_fast.LedgerWire and wire.usage is not None
    assert not _counted_within("n1", wire, registration, guard.bounds)
    assert guard.ledger_ok("n1", wire, 1)
    await guard.stop()


@pytest.mark.parametrize("forged", [
    {"pod_uid": "someone-else"}, {"node": "n9"}, {"preempted_until": NOW + 60},
    {"preempted_by": "ghost"}, {"init_count": 1},
    {"containers": [[DeviceGrant(uuid="GPU-n1-0", type="NVIDIA-H100", memory_mib=GIB,
                                 cores=0)] * 2]},
    {"containers": [[] for _ in range(257)]},
])  # fmt: skip
def test_slim_all_counts_no_entry_the_sums_cannot_clear(forged: dict[str, Any]) -> None:
    """An allocation with a mark, init containers, or anything a per-allocation check of
    `ledger_problem` refuses: slim_all counts nothing, so the full check judges the entry."""
    plain = Allocation(pod_uid="a", namespace="ns", name="a", node="n1",
                       state=AllocationState.BOUND, containers=[[DeviceGrant(
                           uuid="GPU-n1-0", type="NVIDIA-H100", memory_mib=GIB, cores=0)]])
    ok = LedgerCodec().read("n1", encode(NodeLedger(node="n1", allocations={"a": plain})))
    assert type(ok) is wire_fast.LedgerWire and ok.usage is not None
    value = NodeLedger(node="n1", allocations={"a": plain.model_copy(update=forged)})
    wire = LedgerCodec().read("n1", encode(value))
    assert type(wire) is wire_fast.LedgerWire and wire.usage is None
