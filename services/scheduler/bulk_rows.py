"""The index rows of many nodes at once (start-up: every node's row is built in one pass).

`ClusterIndex._row_of_devices` reads one node's row off its devices and usage map in Python,
card by card; at start-up that is 40,000 cards at 5,000 nodes. Here the same values are
computed for every node of a flush together, one numpy operation per quantity over all their
cards: exactly what `_row_of_devices` gives each node (tests/scheduler/test_bulk_rows.py
compares the index built so with one built node by node). Pure: no index, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

_NOTHING = (0, 0, 0)  # a card the node's pods hold nothing of: memory, cores, slots


@dataclass
class Rows:
    """Per node: how many cards take a pod (`free_gpus`) and its score; per usable card (in
    the node's device order): the node's index (`node`), its position in the row (`column`),
    free memory, free %, free cores, whether it computes and whether it is idle."""

    free_gpus: np.ndarray
    scores: np.ndarray
    node: np.ndarray
    column: np.ndarray
    memory: np.ndarray
    percentage: np.ndarray
    cores: np.ndarray
    computing: np.ndarray
    idle: np.ndarray


def rows_of(devices: list[list[Any]], usages: list[dict[str, list[int]]]) -> Rows:
    """The rows of nodes without cordoned cards, dynamic MIG cards or HAMi's pods (one usage
    map each: GPU UUID -> [memory, cores, slots] held), as `_row_of_devices` builds them."""
    n = len(devices)
    lengths = np.fromiter(map(len, devices), dtype=np.int64, count=n)
    flat = [d for cards in devices for d in cards]
    m = len(flat)
    used = np.fromiter(
        chain.from_iterable([usage.get(d.uuid, _NOTHING) for cards, usage
                             in zip(devices, usages, strict=True) for d in cards]),
        dtype=np.int64, count=3 * m,
    ).reshape(m, 3)  # fmt: skip
    used_mem, used_cores, used_slots = used[:, 0], used[:, 1], used[:, 2]
    memory = np.fromiter((d.memory_mib for d in flat), dtype=np.int64, count=m)
    cores = np.fromiter((d.cores for d in flat), dtype=np.int64, count=m)
    split = np.fromiter((d.split_count for d in flat), dtype=np.int64, count=m)
    not_mig = {mode: mode.lower() != "mig" for mode in {d.mode for d in flat}}
    takes = np.fromiter((d.healthy and not_mig[d.mode] for d in flat), dtype=bool, count=m)
    node = np.repeat(np.arange(n, dtype=np.int64), lengths)
    usable = takes & (used_slots < split)

    free = memory - used_mem
    sized = memory > 0
    percentage = np.where(
        sized,
        np.minimum((100 * (free + 1) - 1) // np.where(sized, memory, 1), 32767),
        np.where(free < 0, -1, 32767),
    )  # free_percentage, card by card
    # position among the node's usable cards, in device order
    ahead = np.concatenate(([0], np.cumsum(usable)))
    column = ahead[1:] - 1 - ahead[np.cumsum(lengths) - lengths][node]

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(node, weights=values, minlength=n)

    score = np.zeros(n, dtype=np.float64)  # node_score, term for term, in its order
    for held, capacity in ((used_slots, split), (used_cores, cores), (used_mem, memory)):
        held_sum, capacity_sum = total(held), total(capacity)
        some = capacity_sum != 0
        score = score + np.where(some, held_sum / np.where(some, capacity_sum, 1), 0.0)
    score *= 10.0

    return Rows(
        free_gpus=np.bincount(node[usable], minlength=n), scores=score, node=node[usable],
        column=column[usable], memory=free[usable], percentage=percentage[usable],
        cores=(cores - used_cores)[usable],
        computing=((cores == 0) | (cores > used_cores))[usable], idle=(used_slots == 0)[usable],
    )  # fmt: skip
