"""One candidate list's order under a node policy, kept sorted between calls (pure, numpy).

The policy order is a stable sort of the candidates by key (binpack: fullest first, -score;
spread: emptiest first, score), ties in the caller's order. A placement changes one node's
score, so the sorted order of the previous call is still right for every other candidate:
`PolicyOrder` keeps it (`perm`, with the keys it was sorted by) and the positions whose key
changed since (`dirty`). A decision takes a snapshot and walks it best first (`walk`): the kept
order a chunk at a time, less the dirty positions, with the dirty ones (sorted on their own,
current keys) merged in where they belong. A call that fits on one of the first nodes thus
reads a few dozen candidates, not every one of them; once more than `REBUILD` positions are
dirty the order is merged anew (the dirty positions, sorted, inserted into the kept order where
they belong: O(n) vectorised work, never a sort of n keys).

The walk is exactly the full stable sort (`tests/scheduler/test_candidate_order.py`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator

import numpy as np

HEAD = 8  # candidates of the kept order read first (in Python)
CHUNK = 64  # then this many (numpy), each later chunk GROWTH × larger
GROWTH = 4


def policy_sign(policy: str) -> float:
    """The sort key is sign × score, ascending = preferred first (binpack: fullest first)."""
    return -1.0 if policy == "binpack" else 1.0


class PolicyOrder:
    """The candidates of one list sorted by one policy's key, and the positions since changed."""

    REBUILD = 64

    def __init__(self, sign: float, scores: np.ndarray) -> None:
        self.sign = sign
        keys = sign * scores
        self._sorted(keys, np.argsort(keys, kind="stable"))

    def _sorted(self, keys: np.ndarray, perm: np.ndarray) -> None:
        self.perm = perm  # positions in policy order as of `keys` (never changed in place)
        self.keys = keys  # the keys `perm` was sorted by, by position (never changed in place)
        self.dirty = np.zeros(len(keys), dtype=bool)  # key changed since (copy-on-write)
        self.dirty_list: list[int] = []
        self._shared = False  # a snapshot holds `dirty`: copy before marking more

    def changed(self, positions: list[int]) -> None:
        """These positions' scores changed (or may have)."""
        dirty = self.dirty
        fresh = {p for p in positions if not dirty[p]}
        if not fresh:
            return
        if self._shared:
            self.dirty, self._shared = dirty.copy(), False
        fresh_list = list(fresh)
        self.dirty[fresh_list] = True
        self.dirty_list.extend(fresh_list)

    def snapshot(self, scores: np.ndarray) -> tuple[np.ndarray, ...]:
        """What a walk needs, as of now (`scores`: every position's current score): (perm, its
        keys, dirty mask, dirty positions and their current keys, sorted by key then position).
        None of it changes afterwards, whatever `changed` is told."""
        if len(self.dirty_list) > self.REBUILD:
            self._merge(scores)
        moved = np.asarray(self.dirty_list, dtype=np.int64)
        moved_keys = self.sign * scores[moved]
        by_key = np.lexsort((moved, moved_keys))
        self._shared = True
        return self.perm, self.keys, self.dirty, moved[by_key], moved_keys[by_key]

    def _merge(self, scores: np.ndarray) -> None:
        """The order as of `scores`: the sorted dirty positions inserted into the kept order
        where they belong (after every kept one with a smaller key, or the same key and a
        smaller position): O(n) vectorised, no sort of the n keys."""
        keys = self.sign * scores
        moved = np.asarray(self.dirty_list, dtype=np.int64)
        moved_keys = keys[moved]
        by_key = np.lexsort((moved, moved_keys))
        moved, moved_keys = moved[by_key], moved_keys[by_key]
        kept = self.perm[~self.dirty[self.perm]]
        kept_keys = keys[kept]
        at = np.searchsorted(kept_keys, moved_keys, side="left")
        # Equal keys: within a run of them the kept positions ascend, and a moved position goes
        # after the smaller ones. Number the runs and search (run, position) as one integer.
        tied = at < np.searchsorted(kept_keys, moved_keys, side="right")
        if tied.any():
            runs = np.zeros(len(kept), dtype=np.int64)
            np.cumsum(kept_keys[1:] != kept_keys[:-1], out=runs[1:])
            span = len(keys) + 1
            at[tied] = np.searchsorted(runs * span + kept, runs[at[tied]] * span + moved[tied])
        # Insert: moved[i] lands at at[i] + i (at ascends: moved is sorted the same way).
        total = len(kept) + len(moved)
        perm = np.empty(total, dtype=np.int64)
        landing = at + np.arange(len(moved))
        others = np.ones(total, dtype=bool)
        others[landing] = False
        perm[landing] = moved
        perm[others] = kept
        self._sorted(keys, perm)


def walk(
    snapshot: tuple[np.ndarray, ...], busy: np.ndarray | None, possible: np.ndarray
) -> Iterator[list[int] | np.ndarray]:
    """The `possible` positions in policy order, a chunk at a time: with `busy` (by position),
    the others first and then the busy ones, each group in the policy order. Each once.

    Each group's first chunk (`HEAD` of the kept order and the moved positions before its
    last) is a Python list, merged in Python: most calls fit on one of the first nodes, and a
    dozen numpy calls on a few elements cost more than the Python. The rest are numpy arrays.

    A plain function (a generator holding no reference to its caller's objects), so a decision
    that stops early leaves no reference cycle for the cyclic GC."""
    perm, perm_keys, dirty, moved, moved_keys = snapshot
    moved_pairs = list(zip(moved_keys.tolist(), moved.tolist(), strict=True))  # sorted
    for group in (False, True) if busy is not None else (None,):
        out = ~possible
        if busy is not None:
            out |= busy if not group else ~busy
        pairs = [pair for pair, o in zip(moved_pairs, out[moved].tolist(), strict=True) if not o]
        kept = perm[np.flatnonzero(~(out | dirty)[perm])]  # the group's kept ones, in order
        total = len(kept)
        # The head, in Python.
        raw = kept[:HEAD].tolist()
        raw_keys = perm_keys[raw].tolist()
        head = list(zip(raw_keys, raw, strict=True))
        taken = len(pairs) if len(raw) >= total else bisect_right(pairs, (raw_keys[-1], raw[-1]))
        if taken:
            head = sorted(head + pairs[:taken])
        if head:
            yield [position for _key, position in head]
        start, size = len(raw), CHUNK
        if start >= total:
            continue
        extra = np.array([position for _key, position in pairs], dtype=np.int64)
        extra_keys = np.array([key for key, _position in pairs], dtype=np.float64)
        while start < total:
            chunk = kept[start : start + size]
            start += size
            if start >= total:
                upto = len(extra)
            else:  # the moved positions that sort before the next chunk's first
                last = int(chunk[-1])
                bound = perm_keys[last]
                low = int(np.searchsorted(extra_keys, bound, side="left"))
                high = int(np.searchsorted(extra_keys, bound, side="right"))
                upto = low + int(np.searchsorted(extra[low:high], last, side="right"))
            if upto > taken:
                merged = np.concatenate((chunk, extra[taken:upto]))
                merged_keys = np.concatenate((perm_keys[chunk], extra_keys[taken:upto]))
                chunk = merged[np.lexsort((merged, merged_keys))]
                taken = upto
            if len(chunk):
                yield chunk
            size *= GROWTH


def full_order(snapshot: tuple[np.ndarray, ...], busy: np.ndarray | None) -> np.ndarray:
    """Every position in policy order (busy ones last), as of the snapshot: a full sort, for
    the rare caller that needs them all (a refused pod's reasons)."""
    _perm, perm_keys, _dirty, moved, moved_keys = snapshot
    keys = perm_keys.copy()
    keys[moved] = moved_keys
    return np.lexsort((keys, busy)) if busy is not None else np.argsort(keys, kind="stable")
