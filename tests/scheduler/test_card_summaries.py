"""The per-node checks read in Python one row at a time (`row_holds`, `row_joint`: the head of a
decision's walk) are the vectorised masks (`summary_mask`, `joint_mask`) exactly, on random rows:
cards of every kind (padding, full, idle, out of compute), pods of one to three containers asking
memory or a percentage, no cores, some or a whole card. A check that said yes where the mask
says no would fit nodes the summaries prune (wasted work); one that said no where the mask says
yes would refuse a node that fits."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tessera.scheduler.card_summaries import (
    Cards,
    Need,
    joint_mask,
    row_holds,
    row_joint,
    summary_mask,
)

from .factories import GIB


class Rows:
    """The index's per-card arrays for some nodes (what `Cards` gathers from the index)."""

    def __init__(self, rng: random.Random, nodes: int, width: int) -> None:
        self.free_gpus = np.zeros(nodes, dtype=np.int32)
        self.card_mem = np.full((nodes, width), -1, dtype=np.int64)
        self.card_pct = np.full((nodes, width), -1, dtype=np.int16)
        self.card_cores = np.full((nodes, width), -1, dtype=np.int32)
        self.card_computing = np.zeros((nodes, width), dtype=bool)
        self.card_idle = np.zeros((nodes, width), dtype=bool)
        for n in range(nodes):
            usable = rng.randint(0, width)
            self.free_gpus[n] = -1 if rng.random() < 0.05 else usable
            total = rng.choice([16, 40, 80]) * GIB
            for c in range(usable):
                used_cores = rng.choice([0, 0, 10, 30, 50, 70, 90, 100])
                free = rng.choice([0, 1, 2, 4, 8, 12, 20, 30, 40, 80]) * GIB
                free = min(free, total)
                self.card_mem[n, c] = free
                self.card_pct[n, c] = (100 * (free + 1) - 1) // total
                self.card_cores[n, c] = 100 - used_cores
                self.card_computing[n, c] = used_cores < 100
                self.card_idle[n, c] = used_cores == 0 and free == total


def need(rng: random.Random) -> Need:
    percentage = rng.choice([0, 0, 0, 5, 25, 50])
    memory = 0 if percentage else rng.choice([0, 1, 4, 8, 16, 30]) * GIB
    return Need(rng.choice([1, 1, 2, 3, 4, 8]), memory, percentage,
                rng.choice([0, 0, 10, 30, 50, 100]))  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_row_checks_are_the_masks(seed: int) -> None:
    rng = random.Random(seed)
    rows = Rows(rng, nodes=300, width=rng.choice([2, 4, 8]))
    slots = np.arange(300, dtype=np.int64)
    for _ in range(60):
        together = tuple(need(rng) for _ in range(rng.choice([2, 2, 3])))
        needs = sorted(set(together), key=lambda n: (n.gpus, n.memory_mib, n.cores))
        cards = Cards(rows, slots)
        summary = summary_mask(cards, rows.free_gpus[slots], needs)
        joint = joint_mask(cards, together)
        for n in range(300):
            row = (rows.card_mem[n].tolist(), rows.card_pct[n].tolist(),
                   rows.card_cores[n].tolist(), rows.card_computing[n].tolist(),
                   rows.card_idle[n].tolist())  # fmt: skip
            holds = rows.free_gpus[n] >= 0 and row_holds(*row, needs)
            assert holds == bool(summary[n]), (n, needs)
            assert row_joint(*row, together) == bool(joint[n]), (n, together)
