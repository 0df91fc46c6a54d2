"""The per-node memory and % bounds kept per rung of free cores (`ClusterIndex.bound_mem_at`,
`bound_pct_at`): a node whose roomy card has no cores left and whose card with cores has
little memory is ruled out by the vectorised bounds, never checked card by card (binpack's
fullest nodes come first and most of them are like that); and the bounds are the same
whichever way the row was written (one node's write, or many rows at once at start-up), equal
to their definition."""

from __future__ import annotations

import random

import pytest
from tessera.scheduler.card_summaries import Need
from tessera.scheduler.index import ClusterIndex, cores_rung, rungs_of

from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger

from .factories import GIB, node


def ledger_of(registration, used: list[tuple[int, int]]) -> NodeLedger:  # type: ignore[no-untyped-def]
    """Each card holding one pod of (GiB, cores)."""
    allocations = {}
    for d, (gib, cores) in zip(registration.devices, used, strict=True):
        if gib or cores:
            uid = f"{d.uuid}-p"
            allocations[uid] = Allocation(
                pod_uid=uid, namespace="ns", name=uid, node=registration.node,
                containers=[[DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=gib * GIB,
                                         cores=cores)]],
                state=AllocationState.ALLOCATED,
            )  # fmt: skip
    return NodeLedger(node=registration.node, allocations=allocations)


@pytest.mark.parametrize(
    "asked", [Need(1, 16 * GIB, 0, 30), Need(1, 0, 20, 30)], ids=["MiB", "percentage"]
)
def test_a_node_whose_memory_and_cores_are_on_different_cards_is_ruled_out_unchecked(
    asked: Need,
) -> None:
    index = ClusterIndex()
    names = []
    for n in range(40):  # card 0: 70 GiB free, 10 cores; card 1: 2 GiB free, 80 cores
        registration = node(f"trap{n}", gpus=2)
        index.set_registration(registration.node, registration, 0.0)
        index.set_ledger(registration.node, ledger_of(registration, [(10, 90), (78, 20)]), 1,
                         0.0)  # fmt: skip
        names.append(registration.node)
    fits = node("fits", gpus=2)  # emptier (binpack puts it last), and it holds the pod
    index.set_registration("fits", fits, 0.0)
    index.set_ledger("fits", ledger_of(fits, [(40, 50), (0, 0)]), 1, 0.0)
    names.append("fits")
    slots, _unknown = index.resolve(names)
    ordered, pruned = index.order(slots, [asked], "binpack")
    assert [index.entry_at(s).name for s in ordered] == ["fits"]
    assert ordered._ordering.checked == 1  # the 40 traps never reached the per-card check
    assert sorted(index.entry_at(s).name for s in pruned) == sorted(names[:-1])


def defined(values: list[int], cores: list[int], computing: list[bool], rung: int) -> int:
    """The most free memory (or %) among the cards that take a container asking the rung's
    lowest cores (`Cards.takes`), or -1 (no such card, or each is given more memory than it
    has: any container's memory, 0 or more, is refused alike)."""
    need = Need(1, 0, 0, rung * 10)
    taking = [
        v for v, c, k in zip(values, cores, computing, strict=True)
        if (c >= need.cores if need.cores else k)
    ]  # fmt: skip
    return max([*taking, -1])


def test_the_rungs_are_the_same_however_the_row_was_written() -> None:
    rng = random.Random(3)
    index = ClusterIndex()
    batch = ClusterIndex()
    batch.defer_rebuilds()
    registrations = []
    for n in range(300):
        registration = node(f"n{n}", gpus=rng.choice([1, 2, 4, 8]))
        used = [(rng.choice([0, 10, 40, 70, 80, 85]), rng.choice([0, 5, 10, 30, 55, 99, 100, 120]))
                for _ in registration.devices]  # fmt: skip
        ledger = ledger_of(registration, used)
        for target in (index, batch):
            target.set_registration(registration.node, registration, 0.0)
            target.set_ledger(registration.node, ledger, 1, 0.0)
        registrations.append(registration)
    batch.flush_rebuilds(0.0)
    for registration in registrations:
        one, many = index.entries[registration.node].slot, batch.entries[registration.node].slot
        row = [index.card_mem[one], index.card_pct[one], index.card_cores[one],
               index.card_computing[one]]  # fmt: skip
        width = int(index.free_gpus[one])
        memory, percentage, cores, computing = (r[:width].tolist() for r in row)
        expected = (
            [defined(memory, cores, computing, rung) for rung in range(11)],
            [defined(percentage, cores, computing, rung) for rung in range(11)],
        )
        for at, slot in ((index, one), (batch, many)):
            assert at.bound_mem_at[:, slot].tolist() == expected[0]
            assert at.bound_pct_at[:, slot].tolist() == expected[1]
        assert rungs_of(memory, percentage, cores, computing) == expected


def test_a_container_asks_the_rung_below_its_cores() -> None:
    assert [cores_rung(c) for c in (0, 1, 9, 10, 19, 20, 55, 99, 100, 150)] == [
        0, 0, 0, 1, 1, 2, 5, 9, 10, 10]  # fmt: skip
    # every card with c free cores is on the container's rung: the bound never refuses a fit
    for asked in range(0, 130):
        for free in range(asked, 130):
            assert cores_rung(free) >= cores_rung(asked)
