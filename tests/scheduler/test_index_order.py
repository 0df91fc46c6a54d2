"""The index orders candidates lazily (a chunk at a time, by partial selection): the order and the
pruned set must be exactly those of a full stable sort, ties in the caller's order."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tessera.scheduler.index import ClusterIndex, Need

from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger

from .factories import GIB, node


def reference(
    index: ClusterIndex, slots: np.ndarray, needs: list[Need], policy: str, avoid_busy: bool
) -> tuple[list[int], list[int]]:
    """The plain algorithm: mask every candidate, then one stable sort of all survivors."""
    mask = index._mask(slots, needs)
    survivors = slots[mask]
    scores = index.scores[survivors]
    key = -scores if policy == "binpack" else scores
    if avoid_busy:
        order = np.lexsort((key, index.busy[survivors]))
    else:
        order = np.argsort(key, kind="stable")
    return survivors[order].tolist(), sorted(slots[~mask].tolist())


def cluster(rng: random.Random, nodes: int) -> tuple[ClusterIndex, list[str]]:
    index = ClusterIndex()
    names = []
    for n in range(nodes):
        registration = node(f"n{n}", gpus=4)
        allocations = {}
        for d in registration.devices:
            # Few distinct fill levels, so many nodes tie on the score.
            used = rng.choice([0, 20, 40, 60, 80])
            if used:
                uid = f"{d.uuid}-p"
                allocations[uid] = Allocation(
                    pod_uid=uid, namespace="ns", name=uid, node=registration.node,
                    containers=[[DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=used * GIB,
                                             cores=used)]],
                    state=AllocationState.ALLOCATED,
                )  # fmt: skip
        index.set_registration(registration.node, registration, 0.0)
        ledger = NodeLedger(node=registration.node, allocations=allocations)
        index.set_ledger(registration.node, ledger, 1, 0.0)
        index.busy[index.entries[registration.node].slot] = rng.random() < 0.2
        names.append(registration.node)
    return index, names


@pytest.mark.parametrize("policy", ["binpack", "spread"])
@pytest.mark.parametrize("avoid_busy", [True, False])
def test_lazy_order_is_the_full_stable_sort(policy: str, avoid_busy: bool) -> None:
    rng = random.Random(7)
    index, names = cluster(rng, 700)
    rng.shuffle(names)
    slots, _unknown = index.resolve(names)
    for needs in (
        [Need(1, 10 * GIB, 0, 10)],
        [Need(2, 30 * GIB, 0, 0)],
        [Need(1, 0, 50, 100)],
        [Need(4, 70 * GIB, 0, 0)],  # prunes most nodes
        [Need(1, 0, 0, 0), Need(3, 1, 0, 5)],
    ):
        ordered, pruned = index.order(slots, needs, policy, avoid_busy)
        expected_order, expected_pruned = reference(index, slots, needs, policy, avoid_busy)
        assert list(ordered) == expected_order
        assert list(ordered) == expected_order  # iterable again
        assert sorted(pruned) == expected_pruned
        assert len(ordered) + len(pruned) == len(slots)


def test_first_fit_needs_only_the_first_chunk() -> None:
    index, names = cluster(random.Random(3), 2000)
    slots, _unknown = index.resolve(names)
    ordered, _pruned = index.order(slots, [Need(1, GIB, 0, 0)], "binpack")
    first = next(iter(ordered))
    assert first == reference(index, slots, [Need(1, GIB, 0, 0)], "binpack", True)[0][0]
    assert ordered._ordering.checked <= 64  # one chunk checked card by card
