"""A candidate list seen for the first time, walked in the node policy's order in C
(`native/names/src/walk.c`, in the scheduler's native library, built by `make native`).

`candidate_order.fresh_walk` walks such a list (kube-scheduler's lists change every cycle) in
numpy: per round a gather and a multiply of every candidate's key, a sample partition, a
comparison, a nonzero, a gather of the round's bounds and a lexsort; ~0.3-0.4 ms at 20,000
candidates for a pod that fits on the first node it checks, most of a fresh full list's
decision. Here one pass over the list in C reads each candidate's key (kept, for the rounds
after it and for a refusal's full order), keeps the `HEAD` first in the order in a small heap,
and reads a candidate's bounds only when its key would enter the heap: a few dozen µs.

The same positions in the same order (`(busy, key, position)` ascending, only those whose
bounds reach the request's: `ClusterIndex.bound_conditions`), with the keys and busy flags read
once, when the walk starts, as the numpy walk reads them, and each round's bounds read when the
walk gets there. Two rounds in C (the head, then up to `_NATIVE_CHECKED` candidates: a pod
that has not fitted by then is likely refused everywhere, `decide._AT_ONCE_CHECKED`); the rest,
if a walk goes on, in numpy from where C stopped (`fresh_walk`'s `resume`). Without the
library, or for anything it does not take (a NaN key, a bound outside int64), None: the caller
walks in numpy. Both are checked equal in `tests/scheduler/test_native_walk.py`."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import numpy as np

from .candidate_order import HEAD, fresh_walk
from .native_names import library

NATIVE_FROM = 1024  # candidates from which a fresh list is walked in C
_NATIVE_CHECKED = 128  # candidates walked in C before numpy goes on
_INT64 = (-(1 << 63), (1 << 63) - 1)
_POINTER = ctypes.c_void_p
_ARGUMENTS = [
    _POINTER, ctypes.c_uint64, ctypes.c_uint64,  # slots, n, limit
    _POINTER, ctypes.c_double, _POINTER,  # scores, sign, busy
    _POINTER, _POINTER, ctypes.c_int32,  # keys, busy_at, group
    _POINTER, _POINTER, _POINTER, ctypes.c_uint32,  # columns, widths, minimums, bounds
    ctypes.c_int32, ctypes.c_double, ctypes.c_int64,  # resume, after key and position
    _POINTER, _POINTER, ctypes.c_uint64, _POINTER,  # out, out_keys, cap, busy_count
]


def walk_function() -> Callable[..., int] | None:
    """`tn_walk_round` of the scheduler's native library, or None (not built, or a build
    older than it)."""
    lib = library()
    function = getattr(lib, "tn_walk_round", None) if lib is not None else None
    if function is not None and function.argtypes is None:
        function.restype = ctypes.c_int64
        function.argtypes = _ARGUMENTS
    return function


class NativeWalk:
    """One fresh list's walk (an iterator of what `fresh_walk` yields: the head as a list,
    then arrays of positions). `keys` and `busy` (None: not avoiding busy nodes) by position,
    as read when the walk started, as `fresh_walk` is given them."""

    def __init__(self, function: Callable[..., int], slots: np.ndarray, limit: int,
                 scores: np.ndarray, sign: float, busy: np.ndarray | None,
                 bounds: list[tuple[np.ndarray, int]],
                 possible: Callable[[np.ndarray], np.ndarray]) -> None:  # fmt: skip
        self._function = function
        self._possible = possible  # (numpy's, for the rounds after C's)
        columns = np.array([column.ctypes.data for column, _ in bounds], dtype=np.uint64)
        widths = np.array([column.itemsize for column, _ in bounds], dtype=np.int32)
        minimums = np.array([minimum for _, minimum in bounds], dtype=np.int64)
        self.keys = np.empty(len(slots), dtype=np.float64)
        self.busy = np.empty(len(slots), dtype=bool) if busy is not None else None
        # (what every round passes, addresses read once; the arrays kept alive with them)
        self._kept = (slots, scores, busy, bounds, columns, widths, minimums)
        self._list = (slots.ctypes.data, len(slots), limit)
        self._first = (scores.ctypes.data, sign, busy.ctypes.data if busy is not None else None)
        self._keys_at = self.keys.ctypes.data
        self._busy_at = self.busy.ctypes.data if self.busy is not None else None
        self._bounds = (columns.ctypes.data, widths.ctypes.data, minimums.ctypes.data,
                        len(minimums))  # fmt: skip
        self._sign = sign
        self._rounds: Iterator[list[int] | np.ndarray] | None = None

    def start(self) -> bool:
        """The first round (reads every key): False when C does not take this list."""
        busy_count = ctypes.c_uint64(0)
        first = self._round(False if self.busy is not None else None, None, HEAD,
                            ctypes.byref(busy_count))  # fmt: skip
        if first is None:
            return False
        # (none busy: one group; `busy` as C wrote it, every flag False)
        busy = self.busy if self.busy is not None and busy_count.value else None
        self._rounds = self._walk(first, busy)
        return True

    def __iter__(self) -> Iterator[list[int] | np.ndarray]:
        return self

    def __next__(self) -> list[int] | np.ndarray:
        assert self._rounds is not None, "start() first"
        return next(self._rounds)

    def _round(self, group: bool | None, after: tuple[float, int] | None, cap: int,
               busy_count: object = None) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
        """(positions, their keys): the `cap` first of the group after `after`."""
        out = np.empty(cap, dtype=np.int64)
        out_keys = np.empty(cap, dtype=np.float64)
        first = busy_count is not None
        by_group = group is not None
        scores, sign, busy = self._first if first else (None, self._sign, None)
        count = self._function(
            *self._list, scores, sign, busy if by_group else None, self._keys_at,
            self._busy_at if by_group else None, 1 if group else 0, *self._bounds,
            after is not None, after[0] if after is not None else 0.0,
            after[1] if after is not None else 0, out.ctypes.data, out_keys.ctypes.data, cap,
            busy_count,
        )  # fmt: skip
        if count < 0:
            return None
        return out[:count], out_keys[:count]

    def _walk(self, first: tuple[np.ndarray, np.ndarray],
              busy: np.ndarray | None) -> Iterator[list[int] | np.ndarray]:  # fmt: skip
        """The rounds: `first` (the first group's head), then C's second round, then numpy
        from where C stopped."""
        groups: tuple[bool | None, ...] = (None,) if busy is None else (False, True)
        walked = 0
        found: tuple[np.ndarray, np.ndarray] | None = first
        cap = HEAD
        for group in groups:
            after: tuple[float, int] | None = None  # the last position given of the group
            while True:
                if found is None:
                    found = self._round(group, after, cap) if walked < _NATIVE_CHECKED else None
                    if found is None:  # numpy goes on from there (or C ran out of memory)
                        yield from fresh_walk(self.keys, busy, self._possible,
                                              resume=(group, after))  # fmt: skip
                        return
                positions, keys = found
                found = None
                if len(positions):
                    yield positions.tolist() if not walked else positions
                    walked += len(positions)
                    after = (float(keys[-1]), int(positions[-1]))
                exhausted = len(positions) < cap
                cap = max(_NATIVE_CHECKED - walked, 1)
                if exhausted:
                    break


def native_walk(
    slots: np.ndarray, scores: np.ndarray, sign: float, busy: np.ndarray | None,
    bounds: list[tuple[np.ndarray, int]], possible: Callable[[np.ndarray], np.ndarray],
) -> NativeWalk | None:
    """A started `NativeWalk` of `slots` (their `scores` and `busy` flags by slot; `busy`
    None: not avoiding busy nodes; `bounds`: (column by slot, minimum) the candidates must
    reach; `possible`: numpy's verdict on the same bounds, for the rounds after C's), or None
    where C does not walk it (no library, a short list, a bound it does not take)."""
    if len(slots) < NATIVE_FROM:
        return None
    function = walk_function()
    if function is None:
        return None
    limit = len(scores) if busy is None else min(len(scores), len(busy))
    for column, minimum in bounds:
        if (column.ndim != 1 or not column.flags.c_contiguous or column.dtype.kind != "i"
                or not _INT64[0] <= minimum <= _INT64[1]):  # fmt: skip
            return None
        limit = min(limit, len(column))
    if scores.dtype != np.float64 or (busy is not None and busy.dtype != np.bool_):
        return None
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    walk = NativeWalk(function, slots, limit, scores, sign, busy, bounds, possible)
    return walk if walk.start() else None
