"""One candidate list's order under a node policy, kept sorted between calls (pure, numpy).

The policy order is a stable sort of the candidates by key (binpack: fullest first, -score;
spread: emptiest first, score), ties in the caller's order. A placement changes one node's
score, so the sorted order of the previous call is still right for every other candidate:
`PolicyOrder` keeps it (`perm`, with the keys it was sorted by) and the positions whose key
changed since (`dirty`). A decision takes a snapshot and walks it best first (`walk`): the kept
order a chunk at a time, less the dirty positions, with the dirty ones (sorted on their own,
current keys) merged in where they belong. A call that fits on one of the first nodes thus
reads a few dozen candidates, not every one of them. Once more than `REBUILD` positions are
dirty the order is merged anew (the dirty positions, sorted, inserted into the kept order where
they belong: O(n) vectorised work, never a sort of n keys; ~0.2 ms at 5,000 candidates): by
`tidy`, which the service calls after a decision has answered (`ClusterIndex.tidy_orders`),
so that no decision pays for it. Only if merges fell behind (more than `BEHIND` dirty, a flood of
writes between two calls) does a snapshot merge first, so the dirty set stays bounded.

The walk is exactly the full stable sort (`tests/scheduler/test_candidate_order.py`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator

import numpy as np

HEAD = 8  # candidates of the kept order read first (in Python)
CHUNK = 64  # then this many (numpy), each later chunk GROWTH × larger
GROWTH = 4
BLOCK = 128  # of the kept order, where a group's head is looked for first (lists above 4x)


def policy_sign(policy: str) -> float:
    """The sort key is sign × score, ascending = preferred first (binpack: fullest first)."""
    return -1.0 if policy == "binpack" else 1.0


class PolicyOrder:
    """The candidates of one list sorted by one policy's key, and the positions since changed."""

    REBUILD = 64  # dirty positions above which `tidy` merges (between calls)
    BEHIND = 4 * REBUILD  # ... above which a snapshot merges (inside a call: merges fell behind)

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
        if len(self.dirty_list) > self.BEHIND:
            self._merge(scores)
        moved = np.asarray(self.dirty_list, dtype=np.int64)
        moved_keys = self.sign * scores[moved]
        by_key = np.lexsort((moved, moved_keys))
        self._shared = True
        return self.perm, self.keys, self.dirty, moved[by_key], moved_keys[by_key]

    def tidy(self, scores: np.ndarray) -> bool:
        """Between calls: merge once more than `REBUILD` positions are dirty (True if it did).
        A snapshot taken before stays as it was (the merge makes new arrays)."""
        if len(self.dirty_list) <= self.REBUILD:
            return False
        self._merge(scores)
        return True

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
    snapshot: tuple[np.ndarray, ...], busy: np.ndarray | None,
    possible: np.ndarray | Callable[[np.ndarray | None], np.ndarray],
) -> Iterator[list[int] | np.ndarray]:
    """The `possible` positions in policy order, a chunk at a time: with `busy` (by position),
    the others first and then the busy ones, each group in the policy order. Each once.
    `possible`: a mask by position, or a function giving it at the given positions (None:
    every position), read only where and when the walk gets there.

    Each group's first chunk (`HEAD` of the kept order and the moved positions before its
    last) is a Python list, merged in Python: most calls fit on one of the first nodes, and a
    dozen numpy calls on a few elements cost more than the Python. It is looked for in the
    first `BLOCK` positions of the kept order (and the moved ones) first: only when they hold
    too few is `possible` read for every candidate, and otherwise only once the walk goes on
    past the head. The rest are numpy arrays.

    A plain function (a generator holding no reference to its caller's objects), so a decision
    that stops early leaves no reference cycle for the cyclic GC."""
    if isinstance(possible, np.ndarray):
        possible = _given(possible)
    perm, perm_keys, dirty, moved, moved_keys = snapshot
    moved_pairs = list(zip(moved_keys.tolist(), moved.tolist(), strict=True))  # sorted
    every: np.ndarray | None = None  # `possible` of every position, once read
    block = perm[:BLOCK] if len(perm) > 4 * BLOCK else None
    if block is not None:
        both = possible(np.concatenate((block, moved)))
        block_ok, moved_ok = both[:BLOCK] & ~dirty[block], both[BLOCK:]
    else:
        every = possible(None)
        moved_ok = every[moved]
    for group in (False, True) if busy is not None else (None,):
        out_moved = ~moved_ok
        if busy is not None:
            out_moved |= busy[moved] if not group else ~busy[moved]
        pairs = [pair for pair, o in zip(moved_pairs, out_moved.tolist(), strict=True) if not o]
        found = None
        if block is not None:
            ok = block_ok
            if busy is not None:
                ok = ok & (~busy[block] if not group else busy[block])
            found = block[ok]
        if found is not None:
            first = found[:HEAD]
            kept = None  # the rest: the block's after the head, then those after the block
            # The moved positions before the head's last go in the head; with fewer than HEAD in
            # the block, those before the block's end (every kept one after it sorts after it).
            end = int(first[-1]) if len(found) > HEAD else int(block[-1])
            taken = bisect_right(pairs, (float(perm_keys[end]), end))
        else:
            if every is None:
                every = possible(None)
            out = ~every
            if busy is not None:
                out |= busy if not group else ~busy
            kept = perm[np.flatnonzero(~(out | dirty)[perm])]  # the group's kept ones, in order
            first = kept[:HEAD]
            kept = kept[len(first) :]
            # The head: its moved positions are those before its last, or every one when it
            # holds the group's every kept one.
            taken = len(pairs) if not len(kept) else bisect_right(
                pairs, (float(perm_keys[first[-1]]), int(first[-1]))
            )  # fmt: skip
        # The head, in Python.
        head = list(zip(perm_keys[first].tolist(), first.tolist(), strict=True))
        if taken:
            head = sorted(head + pairs[:taken])
        if head:
            yield [position for _key, position in head]
        if kept is None:
            assert found is not None and block is not None
            if every is None:
                every = possible(None)
            after = perm[BLOCK:]
            out = ~every[after] | dirty[after]
            if busy is not None:
                out |= busy[after] if not group else ~busy[after]
            kept = np.concatenate((found[HEAD:], after[~out]))
        if not len(kept):
            if taken < len(pairs):  # (moved positions after the block's end, none kept there)
                yield [position for _key, position in pairs[taken:]]
            continue
        start, total, size = 0, len(kept), CHUNK
        extra = np.array([position for _key, position in pairs], dtype=np.int64)
        extra_keys = np.array([key for key, _position in pairs], dtype=np.float64)
        while start < total:
            chunk = kept[start : start + size]
            start += size
            if start >= total:
                upto = len(extra)
            else:  # the moved positions that sort before the next chunk's first
                last_position = int(chunk[-1])
                bound = perm_keys[last_position]
                low = int(np.searchsorted(extra_keys, bound, side="left"))
                high = int(np.searchsorted(extra_keys, bound, side="right"))
                upto = low + int(np.searchsorted(extra[low:high], last_position, side="right"))
            if upto > taken:
                merged = np.concatenate((chunk, extra[taken:upto]))
                merged_keys = np.concatenate((perm_keys[chunk], extra_keys[taken:upto]))
                chunk = merged[np.lexsort((merged, merged_keys))]
                taken = upto
            if len(chunk):
                yield chunk
            size *= GROWTH


def fresh_walk(
    keys: np.ndarray, busy: np.ndarray | None,
    possible: Callable[[np.ndarray], np.ndarray],
    resume: tuple[bool | None, tuple[float, int] | None] | None = None,
) -> Iterator[list[int] | np.ndarray]:
    """`walk` for a list seen for the first time (kube-scheduler's rotating window, a list
    changed by feasibility): the same positions in the same order, with no kept order to
    start from and none built (a list used once never pays for a sort of every candidate).
    `keys`: sign × score by position; `possible(positions)`: the bounds' verdict there.

    Per group (the non-busy, then the busy), rounds of the smallest keys: about the `BLOCK`
    smallest (every key up to a threshold, so each round holds exactly the keys up to it and
    every later one sorts after it), then 4× more of the rest, ...; each round's possible
    positions sorted by (key, position). The threshold is read off a sample of the keys (a
    partition of a sixteenth of them; `_threshold`), so a call that fits among the first
    candidates costs a few O(n) passes with a small constant (a gather, a comparison, a
    nonzero: ~0.1 ms at 20,000 candidates); one that walks them all ~O(n log n). No busy
    candidate (the usual case) and the groups are one. The first `HEAD` come as a Python
    list (checked one by one), the rest as arrays.

    `resume` (group, (key, position) or None): the walk from there on, as arrays (the rest of
    a walk begun in C, `native_walk.py`): that group's positions after that one (None: from
    the group's start; group None: no busy candidate), then the groups after it."""
    if busy is not None and not busy.any():
        busy = None
    groups: tuple[bool | None, ...] = (None,) if busy is None else (False, True)
    head_given = resume is not None
    if resume is not None:
        groups = groups[groups.index(resume[0]) :]
    for group in groups:
        if group is None:
            positions, group_keys = None, keys  # (positions: every one, made when needed)
        else:
            positions = np.flatnonzero(busy == group)
            group_keys = keys[positions]
        if resume is not None and resume[1] is not None and group is resume[0]:
            key, position = resume[1]
            at = np.arange(len(keys)) if positions is None else positions
            later = np.flatnonzero((group_keys > key) | ((group_keys == key) & (at > position)))
            positions, group_keys = at[later], group_keys[later]
        size = BLOCK
        while len(group_keys):
            near = None
            if len(group_keys) > 4 * size:
                near = group_keys <= _threshold(group_keys, size)
                taken = np.flatnonzero(near)
                taken_keys = group_keys[taken]
                if positions is not None:
                    taken = positions[taken]
            else:
                taken = positions if positions is not None else np.arange(len(group_keys))
                taken_keys = group_keys
            ok = possible(taken)
            taken, taken_keys = taken[ok], taken_keys[ok]
            if len(taken):
                taken = taken[np.lexsort((taken, taken_keys))]
                if not head_given:
                    head_given = True
                    yield taken[:HEAD].tolist()
                    taken = taken[HEAD:]
                start, chunk = 0, CHUNK
                while start < len(taken):
                    yield taken[start : start + chunk]
                    start += chunk
                    chunk *= GROWTH
            # the rest, only once the walk goes on past this round (most calls stop in it)
            if near is None:
                group_keys = group_keys[:0]
            else:
                far = np.flatnonzero(~near)
                positions = far if positions is None else positions[far]
                group_keys = group_keys[far]
            size *= GROWTH


_SAMPLE = 16  # `_threshold` reads every 16th key


def _threshold(keys: np.ndarray, size: int) -> float:
    """A key about `size` keys from the smallest: the (size / 16)-th smallest of every 16th
    key (a partition of n / 16 keys instead of n). Any key of `keys` is a correct threshold
    (a round holds exactly the keys up to it, at least one); the sample only keeps the rounds
    near `size`, so the first round is O(n) with a small constant."""
    sample = keys[:: _SAMPLE]
    rank = max(0, size // _SAMPLE - 1)
    if len(sample) <= rank + 1:
        return float(np.partition(keys, size - 1)[size - 1])
    return float(np.partition(sample, rank)[rank])


def fresh_order(keys: np.ndarray, busy: np.ndarray | None) -> np.ndarray:
    """Every position in policy order (busy ones last), for a list walked by `fresh_walk`."""
    return np.lexsort((keys, busy)) if busy is not None else np.argsort(keys, kind="stable")


def _given(mask: np.ndarray) -> Callable[[np.ndarray | None], np.ndarray]:
    def at(positions: np.ndarray | None) -> np.ndarray:
        return mask if positions is None else mask[positions]

    return at


def full_order(snapshot: tuple[np.ndarray, ...], busy: np.ndarray | None) -> np.ndarray:
    """Every position in policy order (busy ones last), as of the snapshot: a full sort, for
    the rare caller that needs them all (a refused pod's reasons)."""
    _perm, perm_keys, _dirty, moved, moved_keys = snapshot
    keys = perm_keys.copy()
    keys[moved] = moved_keys
    return np.lexsort((keys, busy)) if busy is not None else np.argsort(keys, kind="stable")
