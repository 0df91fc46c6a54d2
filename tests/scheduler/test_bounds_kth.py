"""The k-th most free memory among a node's computing cards (`ClusterIndex.bound_mem_kth`): a
container asking for several cards is ruled out unchecked on the nodes where fewer of them
have its memory (an 8-GPU binpack pod's fullest nodes: one roomy card is not eight), never on
a node whose cards hold it. (Rows written one by one and at once: `test_bulk_rows.py`.)"""

from __future__ import annotations

import random

from tessera.scheduler.card_summaries import Need
from tessera.scheduler.index import ClusterIndex, _possible

from .factories import GIB, node
from .test_bounds_rungs import ledger_of


def cluster(rng: random.Random, nodes: int) -> tuple[ClusterIndex, list[str]]:
    index = ClusterIndex()
    names = []
    for n in range(nodes):
        gpus = rng.choice([1, 2, 4, 8])
        registration = node(f"k{n}", gpus=gpus, memory_mib=rng.choice([24, 80]) * GIB)
        used = [(rng.choice([0, 4, 10, 20, 24, 60, 80]), rng.choice([0, 10, 50, 100]))
                for _ in range(gpus)]  # fmt: skip
        index.set_registration(registration.node, registration, 0.0)
        index.set_ledger(registration.node, ledger_of(registration, used), 1, 0.0)
        names.append(registration.node)
    return index, names


def test_a_node_with_one_roomy_card_is_ruled_out_for_several_unchecked() -> None:
    index = ClusterIndex()
    names = []
    for n in range(40):  # one card of 80 GiB free, seven full: binpack's first
        registration = node(f"full{n}", gpus=8)
        index.set_registration(registration.node, registration, 0.0)
        index.set_ledger(registration.node, ledger_of(registration, [(0, 0)] + [(78, 10)] * 7),
                         1, 0.0)  # fmt: skip
        names.append(registration.node)
    roomy = node("roomy", gpus=8)  # every card 40 GiB free: emptier, last under binpack
    index.set_registration("roomy", roomy, 0.0)
    index.set_ledger("roomy", ledger_of(roomy, [(40, 10)] * 8), 1, 0.0)
    names.append("roomy")
    slots, _unknown = index.resolve(names)
    ordered, pruned = index.order(slots, [Need(8, 16 * GIB, 0, 0)], "binpack")
    assert [index.entry_at(s).name for s in ordered] == ["roomy"]
    assert ordered._ordering.checked == 1  # the 40 full nodes never reached the card check
    assert sorted(index.entry_at(s).name for s in pruned) == sorted(names[:-1])


def test_the_bound_never_rules_out_a_node_the_cards_hold() -> None:
    rng = random.Random(35)
    index, names = cluster(rng, 300)
    slots, _unknown = index.resolve(names)
    columns = {name: getattr(index, name) for name in
               ("free_gpus", "bound_mem_at", "bound_pct_at", "bound_cores", "bound_computing",
                "bound_idle", "bound_mem_kth")}  # fmt: skip
    ruled_out_by_kth = 0
    for _ in range(400):
        needs = [Need(rng.choice([1, 2, 3, 4, 5, 8]), rng.choice([0, 1, 8, 16, 30, 50]) * GIB,
                      rng.choice([0, 0, 10, 40]), rng.choice([0, 0, 10, 30, 100]))
                 for _ in range(rng.choice([1, 1, 2]))]  # fmt: skip
        held = index._mask(slots, needs, distinct=False)
        possible = _possible(columns, needs, slots)
        assert not (held & ~possible).any(), needs  # (a node the cards hold is never pruned)
        without = {**columns, "bound_mem_kth": columns["bound_mem_kth"] * 0 + (1 << 62)}
        ruled_out_by_kth += int((_possible(without, needs, slots) & ~possible).sum())
    assert ruled_out_by_kth > 1000  # (and it does rule nodes out)
