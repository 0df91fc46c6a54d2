"""Why a request was refused on each node, remembered until the node's row changes (pure, numpy).

kube-scheduler retries an unschedulable pod with backoff, and every retry asks for every
candidate's reason (HAMi's `N/M Reason, ...` per node). Fitting every node again for that is
O(nodes) per-GPU work (~0.1 s at 5,000 nodes), and a backlog of pending pods paid it on every
retry. So each distinct request (`Decision.memo_key`: the request, its options and the quota
budget) keeps, by index slot, the reason found there and the row version it was found at
(`ClusterIndex.row_version`, advanced whenever the node's row, and so its cards, is written).
A refusal then refits only the nodes whose rows changed since, and reads the others' reasons
with a few vectorised gathers: the texts are interned per memo (a handful of distinct ones:
`3/8 CardInsufficientMemory, 5/8 CardInsufficientCore`, ...), so a node costs an int.

Exactness: a reason is used only at the version it was found at, and the version moves with
every write of the node's row (over-invalidating costs a refit, never a wrong reason). Nodes
whose refusal depends on more than their cards (HAMi's pods there: `ClusterIndex.foreign`) are
never remembered. `tests/scheduler/test_refusal_memo.py`, `test_decision_reference.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

FITS = 0  # the id of "the node fits" (a summary was looser than the fit: no reason)
_MEMOS = 96  # distinct requests remembered (least recently used forgotten, refused ones last)
_TEXTS = 4096  # distinct reasons per request before its memo starts over


class RefusalMemo:
    """One request's reasons by slot: (row version found at, reason id)."""

    def __init__(self, capacity: int) -> None:
        self.stamp = np.full(capacity, -1, dtype=np.int64)
        self.reason = np.zeros(capacity, dtype=np.int32)
        self.texts: list[str | None] = [None]  # by id; FITS has none
        self.names: list[tuple[str, ...]] = [()]  # the reason names of each id
        self._ids: dict[tuple[str, tuple[str, ...]], int] = {}
        self._array: np.ndarray | None = None  # `texts` as an object array (gathers)
        # the reason of every node of a shape (`refusal_shapes.group`: its exact key), valid
        # for as long as the memo (the key holds everything the refusal depends on)
        self.shapes: dict[bytes, int] = {}
        # the request was refused everywhere on its last call (`Decision.explain_rest`): its
        # next is first checked at once (`refusal_fast.py`); cleared when a node fits it
        self.refused = False

    def grow(self, capacity: int) -> None:
        if len(self.stamp) < capacity:
            stamp = np.full(capacity, -1, dtype=np.int64)
            stamp[: len(self.stamp)] = self.stamp
            reason = np.zeros(capacity, dtype=np.int32)
            reason[: len(self.reason)] = self.reason
            self.stamp, self.reason = stamp, reason

    def get(self, slot: int, version: int) -> int | None:
        """The reason id found at `slot` at this row version, or None."""
        return int(self.reason[slot]) if self.stamp[slot] == version else None

    def intern(self, text: str | None, names: tuple[str, ...]) -> int:
        """The id of a reason (`text` None: the node fits, FITS)."""
        if text is None:
            return FITS
        found = self._ids.get((text, names), -1)
        if found < 0:
            found = len(self.texts)
            self._ids[(text, names)] = found
            self.texts.append(text)
            self.names.append(names)
            self._array = None
        return found

    def put(self, slot: int, version: int, text: str | None, names: tuple[str, ...]) -> int:
        """Remember the node's refusal (`text` None: it fits); its id."""
        found = self.intern(text, names)
        self.stamp[slot] = version
        self.reason[slot] = found
        return found

    def text_array(self) -> np.ndarray:
        if self._array is None:
            array = np.empty(len(self.texts), dtype=object)
            array[:] = self.texts
            self._array = array
        return self._array


def sketch(request: Any) -> tuple:
    """What a pod asks, lightly (`PodRequest`: its containers' counts, memory and cores):
    equal for equal requests (the memo key decides)."""
    return (len(request.init), *((r.count, r.memory_mib, r.memory_percentage, r.cores)
                                 if r is not None else None for r in request.all))


class RefusalMemos:
    """The memos of the most recent distinct requests, by `Decision.memo_key`."""

    def __init__(self) -> None:
        self._memos: OrderedDict[str, RefusalMemo] = OrderedDict()
        # a light print (`sketch`) of every request marked refused (or that was: a hint), so
        # that a placed pod's decision pays no `memo_key` for `refusal_fast`'s check
        self.refused: set[tuple] = set()

    def peek(self, key: str) -> RefusalMemo | None:
        """The request's memo if there is one (nothing created, the recency unchanged)."""
        return self._memos.get(key)

    def mark_refused(self, memo: RefusalMemo, request: Any) -> None:
        """The memo's request was just refused everywhere."""
        memo.refused = True
        if len(self.refused) > 4 * _MEMOS:
            self.refused.clear()
        self.refused.add(sketch(request))

    def maybe_refused(self, sketched: tuple) -> bool:
        """Whether a request of this `sketch` was refused everywhere (False: it was not)."""
        return bool(self.refused) and sketched in self.refused

    def of(self, key: str, capacity: int) -> RefusalMemo:
        """The request's memo (a new one once it holds more than `_TEXTS` distinct reasons: a
        pathological variety; never replaced while a call reads it, only when one asks)."""
        memo = self._memos.get(key)
        if memo is None or len(memo.texts) > _TEXTS:
            memo = self._memos[key] = RefusalMemo(capacity)
            self._memos.move_to_end(key)
            while len(self._memos) > _MEMOS:
                self._evict()
        else:
            self._memos.move_to_end(key)
            memo.grow(capacity)
        return memo

    def _evict(self) -> None:
        """The least recent memo of a request not refused on its last call goes first: the
        requests of a backlog are retried seconds apart (kube-scheduler's backoff) while many
        placed pods' requests come and go, and a refused request's memo is what answers its
        retries at once (`refusal_fast`). Only refused memos left: the least recent."""
        for key, memo in self._memos.items():
            if not memo.refused:
                del self._memos[key]
                return
        self._memos.popitem(last=False)

    def forget(self, slot: int) -> None:
        """A node left its slot (another may take it): nothing remembered there holds."""
        for memo in self._memos.values():
            if slot < len(memo.stamp):
                memo.stamp[slot] = -1
