"""A node's cards are built again after every change to its row; they are copied from the last
ones built (`cards.recharged`) while the node's devices list and cordon are the same, and read
off the devices again otherwise: either way exactly what `cards_with_usage` builds."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tessera.scheduler import index as index_module
from tessera.scheduler.cards import Card, cards_with_usage
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, PodOptions

from tessera.hami import ContainerRequest, PodRequest
from tessera.models import Allocation, DeviceGrant, NodeLedger, NodeRegistration

from .factories import GIB, device

NOW = 1000.0


def fields(cards: list[Card]) -> list[tuple]:
    return [tuple(getattr(c, f.name) for f in dataclasses.fields(Card)) for c in cards]


def registration(name: str, rng: random.Random) -> NodeRegistration:
    return NodeRegistration(node=name, devices=[
        device(f"GPU-{name}-{rng.random():.6f}-{i}", i, memory_mib=rng.choice([16, 80]) * GIB,
               split=rng.choice([2, 10]), numa=i // 2, healthy=rng.random() > 0.1,
               links={f"GPU-{name}-{i + 1}": 2})
        for i in range(rng.choice([1, 4, 8]))
    ])  # fmt: skip


def ledger(name: str, reg: NodeRegistration, rng: random.Random, count: int) -> NodeLedger:
    allocations = {}
    for k in range(count):
        d = rng.choice(reg.devices)
        uid = f"{name}-{k}"
        allocations[uid] = Allocation(
            pod_uid=uid, namespace="ns", name=uid, node=name,
            containers=[[DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=rng.randint(1, 8) * GIB,
                                     cores=rng.choice([0, 10, 30]))]],
        )  # fmt: skip
    return NodeLedger(node=name, allocations=allocations)


def two_containers(rng: random.Random) -> PodRequest:
    """A pod whose first container's cards are taken (charged) before the second is fitted."""
    return PodRequest(containers=[
        ContainerRequest(rng.choice([1, 2]), rng.randint(1, 8) * GIB, None, rng.choice([0, 10]))
        for _ in range(2)
    ])  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
def test_cards_after_every_change_are_the_ones_built_afresh(seed: int) -> None:
    rng = random.Random(seed)
    index = ClusterIndex()
    reg = registration("n", rng)
    index.set_registration("n", reg, NOW)
    revision = 0
    built: list[tuple[list[Card], list[tuple]]] = []  # every list of cards read, as it was
    for _step in range(60):
        what = rng.random()
        if what < 0.3:
            revision += 1
            index.set_ledger("n", ledger("n", reg, rng, rng.randint(0, 6)), revision, NOW)
        elif what < 0.6:  # one pod more: most cards keep their usage
            now = index.entries["n"].ledger or NodeLedger(node="n")
            more = ledger("n", reg, rng, 1).allocations["n-0"]
            revision += 1
            more = more.model_copy(update={"pod_uid": f"more-{revision}"})
            index.set_ledger("n", NodeLedger(node="n", allocations={
                **now.allocations, more.pod_uid: more}), revision, NOW)  # fmt: skip
        elif what < 0.8:
            index.set_cordon("n", frozenset(
                d.uuid for d in reg.devices if rng.random() < 0.3
            ), NOW)  # fmt: skip
        elif what < 0.9:
            reg = registration("n", rng)
            index.set_registration("n", reg, NOW)
        else:  # a heartbeat: the same devices list
            index.set_registration("n", reg.model_copy(update={"heartbeat_at": NOW}), NOW)
        entry = index.entries["n"]
        usages, cordon = entry._card_usage
        assert fields(entry.cards) == fields(cards_with_usage(reg, usages, cordon))
        fit_pod(entry.cards, two_containers(rng), FitContext(PodOptions()))  # (takes cards)
        built.append((entry.cards, fields(entry.cards)))
        # (a card kept from one list in the next is never changed by either's use)
        assert all(fields(cards) == before for cards, before in built)


def test_the_devices_are_read_again_only_when_they_or_the_cordon_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(7)
    reg = registration("n", rng)
    index = ClusterIndex()
    index.set_registration("n", reg, NOW)
    index.set_ledger("n", ledger("n", reg, rng, 3), 1, NOW)
    read: list[str] = []  # (a device's UUID each time its card is built from it)

    def reading(registration: NodeRegistration, *args: object) -> list[Card]:
        read.extend(d.uuid for d in registration.devices)
        return cards_with_usage(registration, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(index_module, "cards_with_usage", reading)
    index.entries["n"].cards  # noqa: B018 (built)
    assert len(read) == len(reg.devices)
    for revision in range(2, 6):  # usage changes only: copied, not read
        index.set_ledger("n", ledger("n", reg, rng, revision), revision, NOW)
        index.entries["n"].cards  # noqa: B018
    assert len(read) == len(reg.devices)
    index.set_cordon("n", frozenset({reg.devices[0].uuid}), NOW)
    assert index.entries["n"].cards[0].cordoned
    assert len(read) == 2 * len(reg.devices)
    before, reg = len(read), registration("n", rng)
    index.set_registration("n", reg, NOW)
    assert [c.uuid for c in index.entries["n"].cards] == [d.uuid for d in reg.devices]
    assert len(read) == before + len(reg.devices)
