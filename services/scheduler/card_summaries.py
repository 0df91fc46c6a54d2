"""Necessary conditions a node's per-card summaries must meet before its per-GPU fit (pure).

The index keeps, per node and card, what each usable card can still give (free memory, %,
cores; whether it still computes and is idle; -1 for a card that takes no pod). A node is
refused here only when the per-GPU fit (rules.py, placement.py) would refuse it too, so the
candidates that pass are ordered and fitted exactly as if every one had been fitted.

- `summary_mask`: per container, enough cards that can each take it on every numeric dimension
  at once (each container must fit on its own).
- `joint_mask`: a pod of several app containers (no GPU init container) must place all its
  grants at once, a card taking at most one grant of each container. A card can take two of
  the pod's containers only if it holds both on memory and cores together (a container asking
  no cores placed after one that asks some needs a core left over: a card whose cores are all
  taken no longer computes), so a card holds at most one grant unless some other container
  pairs with it there. Containers that each fit a node but only on the same few cards fail
  together; without this bound they were fitted node after node (0.4-0.7 s at 5,000 nodes).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from tessera.hami import PodRequest

from .row_reduce import row_counts


class Need(NamedTuple):
    """One container's demand: necessary conditions for a node to fit it. (A named tuple: a
    decision builds one or two per container: a third of a frozen dataclass's cost.)"""

    gpus: int
    memory_mib: int
    memory_percentage: int
    cores: int

    @classmethod
    def of(cls, request: PodRequest) -> list[Need]:
        """Every GPU container's demand (each must fit on its own, so each is necessary)."""
        needs = {
            cls(r.count, r.memory_mib if r.memory_percentage is None else 0,
                r.memory_percentage or 0, r.cores)
            for r in request.all if r is not None
        }  # fmt: skip
        return sorted(needs, key=lambda n: (n.gpus, n.memory_mib, n.cores))

    @classmethod
    def together(cls, request: PodRequest) -> tuple[Need, ...]:
        """The app containers' demands in container order when the pod's GPU containers are two
        or more app containers fitted together (no GPU init container); else ()."""
        if any(r is not None for r in request.init):
            return ()
        needs = tuple(
            cls(r.count, r.memory_mib if r.memory_percentage is None else 0,
                r.memory_percentage or 0, r.cores)
            for r in request.containers if r is not None
        )  # fmt: skip
        return needs if len(needs) >= 2 else ()


class Cards:
    """The per-card summaries of some nodes (rows), gathered from the index when first read."""

    def __init__(self, index: Any, slots: np.ndarray) -> None:
        self._index = index
        self._slots = slots
        self._gathered: dict[str, np.ndarray] = {}

    def __getattr__(self, name: str) -> np.ndarray:  # card_mem, card_pct, card_cores, ...
        if name.startswith("_"):
            raise AttributeError(name)
        array = self._gathered.get(name)
        if array is None:
            array = self._gathered[name] = getattr(self._index, name)[self._slots]
        return array

    def takes(self, need: Need) -> np.ndarray:
        """Per node and card: the card can take one grant of the container (rules' numeric
        checks, all at once)."""
        ok = self.card_mem >= need.memory_mib
        if need.memory_percentage:
            ok &= self.card_pct >= need.memory_percentage
        if need.cores:
            ok &= self.card_cores >= need.cores
        else:
            ok &= self.card_computing
        if need.cores >= 100:
            ok &= self.card_idle
        return ok


def summary_mask(cards: Cards, free_gpus: np.ndarray, needs: list[Need]) -> np.ndarray:
    mask = free_gpus >= 0
    for need in needs:
        mask &= row_counts(cards.takes(need)) >= need.gpus
    return mask


def row_holds(
    memory: list[int], percentage: list[int], cores: list[int], computing: list[bool],
    idle: list[bool], needs: list[Need],
) -> bool:
    """`summary_mask` for one node (its free GPUs >= 0), from its row of each array."""
    for need in needs:
        mib, pct, asked = need.memory_mib, need.memory_percentage, need.cores
        cards = 0
        for i, free in enumerate(memory):
            if (
                free >= mib and (not pct or percentage[i] >= pct)
                and (cores[i] >= asked if asked else computing[i])
                and (asked < 100 or idle[i])
            ):  # fmt: skip
                cards += 1
        if cards < need.gpus:
            return False
    return True


def _takes_card(need: Need, free: int, percentage: int, cores: int, computing: bool,
                idle: bool) -> bool:
    """`Cards.takes` for one card."""
    asked = need.cores
    return (
        free >= need.memory_mib
        and (not need.memory_percentage or percentage >= need.memory_percentage)
        and (cores >= asked if asked else computing)
        and (asked < 100 or idle)
    )  # fmt: skip


def row_joint(
    memory: list[int], percentage: list[int], cores: list[int], computing: list[bool],
    idle: list[bool], together: tuple[Need, ...],
) -> bool:
    """`joint_mask` for one node, from its row of each array (the same sums, card by card)."""
    held_total = 0
    for i, free in enumerate(memory):
        takes = [
            _takes_card(need, free, percentage[i], cores[i], computing[i], idle[i])
            for need in together
        ]
        if not any(takes):
            continue
        paired = 0
        for j, later in enumerate(together):
            if not takes[j]:
                continue
            for k, other in enumerate(together):
                if k == j or not takes[k]:
                    continue
                first, second = (other, later) if k < j else (later, other)
                spare = 1 if second.cores == 0 and first.cores > 0 else 0
                if free >= first.memory_mib + second.memory_mib and (
                    cores[i] >= first.cores + second.cores + spare
                ):
                    paired += 1
                    break
        held_total += max(1, paired)
    return held_total >= sum(need.gpus for need in together)


def joint_mask(cards: Cards, together: tuple[Need, ...]) -> np.ndarray:
    """Per node: its cards can hold every grant of the containers together (a necessary
    condition: memory and cores summed per pair of containers sharing a card)."""
    takes = [cards.takes(need) for need in together]
    memory, cores = cards.card_mem, cards.card_cores
    single = np.zeros(memory.shape, dtype=bool)
    paired = np.zeros(memory.shape, dtype=np.int32)
    for j, later in enumerate(together):
        single |= takes[j]
        partner = np.zeros(memory.shape, dtype=bool)
        for i, other in enumerate(together):
            if i == j:
                continue
            first, second = (other, later) if i < j else (later, other)
            # A container asking no cores after one asking some: a core must be left over.
            spare = 1 if second.cores == 0 and first.cores > 0 else 0
            partner |= takes[i] & (memory >= first.memory_mib + second.memory_mib) & (
                cores >= first.cores + second.cores + spare
            )
        paired += partner & takes[j]
    held = np.maximum(single.astype(np.int32), paired)  # grants a card can hold at most
    return held.sum(axis=1) >= sum(need.gpus for need in together)
