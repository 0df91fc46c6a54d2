"""Nodes whose cards stand alike, numbered, so that a refusal reads each distinct row once (pure,
numpy).

A refusal groups its candidates by what each node's refusal depends on (`refusal_shapes.group`):
per card, its static class and how it stands (free memory, free cores, used slots, still
computing, idle), per node the signature of its cards that take no pod. That is O(candidates ×
cards) numpy work per call whatever the cluster (a first refusal of a two-container pod on
5,000 nodes: ~50 passes over 5,000 × 8 cards, 2-4 ms on a loaded machine), though far fewer
rows are distinct: in a homogeneous cluster the nodes' cards take a few states each, and a
node's refusal reads its cards as a multiset (its codes are counted, and a pod's later
containers pick among equal cards alike: `refusal_steps.group_steps` says where the order of
the cards matters, and those nodes are read one by one).

So each row's state is numbered here: its cards' states packed exactly into one 64-bit word
each (class, free memory, free cores, used slots, computing, idle: each field checked to fit
its bits, else the row is numbered by its plain values), sorted, with the row's signature,
interned by those bytes (one table per card width; never hashed alone, so two rows share a
number only when they are equal). A number is valid at the row version it was taken at
(`ClusterIndex.row_version`, advanced with every write of the row); a call renumbers only the
rows written since (a refusal usually finds a handful: the placements since the last one).
The free percentage is not in the key: it is a function of the free memory and the class's
memory (`index.free_percentage`), nor the node's free GPUs (its cards with a class). A row
whose refusals are not grouped (signature `UNSHAREABLE`: MIG or another kind's cards, HAMi's
pods, a blocked row) is numbered alone. The per-card summaries a walk checks a large chunk of
candidates against (`ClusterIndex._mask`) are read the same way: they read only these values
as a multiset. `tests/scheduler/test_refusal_states.py`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .native_steps import NativeSteps

# bits of each field of a card's packed state (low to high: idle, computing, used slots + 1,
# free cores + 1024, free memory MiB + 2^25, class + 1): 1 + 1 + 10 + 12 + 28 + 12 = 64
_SLOT_BITS, _CORE_BITS, _MEM_BITS, _CLASS_BITS = 10, 12, 28, 12
_CORE_OFFSET, _MEM_OFFSET = 1 << 10, 1 << 25
# distinct row states numbered before the table starts over (every row then renumbered as
# calls read it): 4 per row the index can hold, at least 65,536 (~13 MB of keys)
_TABLE_PER_ROW, _TABLE_MIN = 4, 1 << 16


class RowStates:
    """A number per node row: equal numbers <=> equal card states (as a multiset) and signature."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self.at = np.zeros(0, dtype=np.int64)  # the row version each number was taken at
        self._table: dict[Any, int] = {}
        self._width = -1
        # (`distinct`'s scratch: each number's first candidate; 0, 1, 2, ... as places)
        self._first_of = np.zeros(0, dtype=np.int64)
        self._places = np.zeros(0, dtype=np.int64)
        # (the native `distinct`'s scratch: -1 by number, more entries than the table has)
        self._native_first_of = np.zeros(0, dtype=np.int64)

    def forget(self, slot: int) -> None:
        """A node left its slot: its number no longer holds."""
        if slot < len(self.at):
            self.at[slot] = -1

    def of(self, index: Any, slots: np.ndarray) -> np.ndarray:
        """Each candidate row's number (int64), renumbering the rows written since they were
        numbered."""
        versions = index.row_version
        width = index.card_class.shape[1]
        if len(self.at) < len(versions):
            grown = np.full(len(versions), -1, dtype=np.int64)
            grown[: len(self.at)] = self.at
            self.at = grown
            ids = np.zeros(len(versions), dtype=np.int64)
            ids[: len(self.ids)] = self.ids
            self.ids = ids
        if width != self._width or len(self._table) > max(_TABLE_MIN,
                                                           _TABLE_PER_ROW * len(versions)):
            self._table.clear()
            self.at[:] = -1
            self._width = width
        stale = self.at.take(slots) != versions.take(slots)
        if stale.any():
            self._number(index, slots[stale] if not stale.all() else slots)
        return self.ids.take(slots)

    def distinct(self, index: Any, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(the candidates' distinct rows, each by its first candidate, in the candidates'
        order; each candidate's place among them), or None when most rows are distinct.

        O(candidates), no sort: the numbers are small dense integers, so each number's first
        candidate is scattered into a table by number (the candidates written last to first,
        so the first is written last) and read back for every candidate; that every candidate
        reads back a place no later than its own proves each read is its number's first
        (whatever order the scatter wrote in), else the numbers are sorted as before
        (`np.unique`: ~1.3 ms at 20,000 candidates on a loaded machine, this ~0.2). In C
        where the library is (`native_steps.NativeSteps.distinct`: the same, in one pass,
        with the check that no candidate's number is stale)."""
        found = self._native(index, slots)
        if found is not None:
            reps, rank = found
            return None if 4 * len(reps) > 3 * len(slots) else (reps, rank)
        numbers = self.of(index, slots)
        count = len(numbers)
        if not count:
            return None
        if len(self._places) < count:
            self._places = np.arange(max(count, 2 * len(self._places)), dtype=np.int64)
        places = self._places[:count]
        top = int(numbers.max()) + 1
        if len(self._first_of) < top:
            self._first_of = np.zeros(max(top, 2 * len(self._first_of)), dtype=np.int64)
        first_of = self._first_of
        first_of[numbers[::-1]] = places[::-1]
        first = first_of.take(numbers)
        if not bool((first <= places).all()):  # (the scatter wrote in another order)
            return self._distinct_sorted(numbers)
        reps = np.flatnonzero(first == places)
        if 4 * len(reps) > 3 * count:
            return None
        rank = np.empty(count, dtype=np.int64)
        rank[reps] = places[: len(reps)]
        return reps, rank.take(first)

    def _native(self, index: Any, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`distinct`'s reps and ranks in C (the stale rows renumbered first), or None where
        the library does not apply."""
        native = NativeSteps.load()
        if native is None or not len(slots):
            return None
        for _attempt in range(2):
            versions = index.row_version
            if (len(self.at) < len(versions) or index.card_class.shape[1] != self._width
                    or len(self._table) > max(_TABLE_MIN, _TABLE_PER_ROW * len(versions))):
                self.of(index, slots)  # (grown, or started over: every number taken anew)
            if len(self._native_first_of) <= len(self._table):
                self._native_first_of = np.full(max(1024, 2 * len(self._table)), -1,
                                                dtype=np.int64)  # fmt: skip
            found = native.distinct(self.ids, self.at, versions, slots, self._native_first_of)
            if not isinstance(found, np.ndarray):
                return found
            self._number(index, slots[found])  # (the rows written since they were numbered)
        return None

    @staticmethod
    def _distinct_sorted(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`distinct` by sorting the numbers."""
        _unique, firsts, inverse = np.unique(numbers, return_index=True, return_inverse=True)
        if 4 * len(firsts) > 3 * len(numbers):
            return None
        order = np.argsort(firsts)
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        return firsts[order], rank[inverse.reshape(-1)]

    def _number(self, index: Any, rows: np.ndarray) -> None:
        classes = index.card_class.take(rows, axis=0).astype(np.int64) + 1
        memory = index.card_mem.take(rows, axis=0) + _MEM_OFFSET
        cores = index.card_cores.take(rows, axis=0).astype(np.int64) + _CORE_OFFSET
        used = index.card_slots.take(rows, axis=0).astype(np.int64) + 1
        fits = ((classes >= 0) & (classes < 1 << _CLASS_BITS) & (memory >= 0)
                & (memory < 1 << _MEM_BITS) & (cores >= 0) & (cores < 1 << _CORE_BITS)
                & (used >= 0) & (used < 1 << _SLOT_BITS)).all(axis=1)  # fmt: skip
        packed = classes.astype(np.uint64) << np.uint64(_MEM_BITS)
        packed |= memory.astype(np.uint64)
        packed <<= np.uint64(_CORE_BITS)
        packed |= cores.astype(np.uint64)
        packed <<= np.uint64(_SLOT_BITS)
        packed |= used.astype(np.uint64)
        packed <<= np.uint64(2)
        packed |= index.card_computing.take(rows, axis=0).astype(np.uint64) << np.uint64(1)
        packed |= index.card_idle.take(rows, axis=0).astype(np.uint64)
        packed.sort(axis=1)
        signature = index.unusable_sig.take(rows).astype(np.uint64)
        keyed = np.ascontiguousarray(np.concatenate((packed, signature[:, None]), axis=1))
        data = keyed.tobytes()
        size = keyed.shape[1] * 8
        table = self._table
        numbers = []
        shared = (signature.astype(np.int64) >= 0).tolist()
        versions = index.row_version.take(rows).tolist()
        for i, ok in enumerate(fits.tolist()):
            key: Any = data[i * size : (i + 1) * size]
            if not shared[i]:  # (a row whose refusals are not grouped: numbered alone)
                key = ("alone", int(rows[i]), versions[i])
            elif not ok:  # (a field out of its bits: the row's plain values)
                row = int(rows[i])
                key = ("plain", int(index.unusable_sig[row]), tuple(sorted(zip(
                    index.card_class[row].tolist(), index.card_mem[row].tolist(),
                    index.card_cores[row].tolist(), index.card_slots[row].tolist(),
                    index.card_computing[row].tolist(), index.card_idle[row].tolist(),
                    strict=True))))  # fmt: skip
            found = table.get(key)
            if found is None:
                found = table[key] = len(table)
            numbers.append(found)
        self.ids[rows] = numbers
        self.at[rows] = index.row_version.take(rows)
