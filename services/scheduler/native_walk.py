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
import sys
from collections.abc import Callable, Iterator

import numpy as np

from .candidate_order import HEAD, fresh_walk
from .native_address import address_of
from .native_names import library

NATIVE_FROM = 1024  # candidates from which a fresh list is walked in C
_NATIVE_CHECKED = 128  # candidates walked in C before numpy goes on
_INT64 = (-(1 << 63), (1 << 63) - 1)
_SLOT_TYPES = (np.dtype(np.int32), np.dtype(np.int64))  # slot widths C reads (4 and 8 bytes)
_POINTER = ctypes.c_void_p
_ARGUMENTS = [
    _POINTER, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,  # slots, width, n, limit
    _POINTER, ctypes.c_double, _POINTER,  # scores, sign, busy
    _POINTER, _POINTER, ctypes.c_int32,  # keys, busy_at, group
    _POINTER, ctypes.c_uint32,  # spec (address, width, minimum per bound), bounds
    ctypes.c_int32, ctypes.c_double, ctypes.c_int64,  # resume, after key and position
    _POINTER, ctypes.c_uint64, _POINTER,  # out, cap, busy_count
]


def first_function() -> Callable[..., int] | None:
    """`tn_walk_first` of the scheduler's native library (a walk's first round in six
    arguments: each one ctypes converts costs ~0.2 µs a call), or None (not built, or a build
    without it: the first round is then `tn_walk_round`'s)."""
    lib = library()
    function = getattr(lib, "tn_walk_first", None) if lib is not None else None
    if function is not None and function.argtypes is None:
        function.restype = ctypes.c_int64
        function.argtypes = [_POINTER, _POINTER, ctypes.c_uint32, ctypes.c_uint64,
                             ctypes.c_double, _POINTER]  # fmt: skip
    return function


def walk_function() -> Callable[..., int] | None:
    """`tn_walk_round` of the scheduler's native library, or None (not built, or a build
    older than this code: `native_names.library` loads only its own interface)."""
    lib = library()
    function = getattr(lib, "tn_walk_round", None) if lib is not None else None
    if function is not None and function.argtypes is None:
        function.restype = ctypes.c_int64
        function.argtypes = _ARGUMENTS
    return function


class Block:
    """One block a walk in C writes, with its views for lists of `n` candidates: the keys
    (`n` floats), the positions of its rounds (`_NATIVE_CHECKED` + 1 ints, the busy count
    last) and the busy flags (`n` bytes), made once per length, not per walk (six numpy
    calls, ~5 µs of a cold call)."""

    __slots__ = ("address", "block", "busy", "keys", "n", "out")

    def __init__(self, size: int) -> None:
        self.block = np.empty(size, dtype=np.uint8)
        self.address = address_of(self.block)
        self.n = -1
        self.keys = self.out = self.busy = self.block[:0]

    def views(self, n: int) -> None:
        """Its views for `n` candidates (the block must hold `_room(n)` bytes)."""
        room = _NATIVE_CHECKED + 1
        block = self.block
        self.keys = block[: 8 * n].view(np.float64)
        self.out = block[8 * n : 8 * (n + room)].view(np.int64)
        self.busy = block[8 * (n + room) : 8 * (n + room) + n].view(np.bool_)
        self.n = n


def _room(n: int) -> int:
    """The bytes a walk of `n` candidates writes (`Block`)."""
    return 8 * (n + _NATIVE_CHECKED + 1) + n


def _idle(block: Block) -> tuple[int, int, int, int]:
    """The references to a kept block and its views (what `Blocks.take` compares)."""
    return (sys.getrefcount(block.block), sys.getrefcount(block.keys),
            sys.getrefcount(block.out), sys.getrefcount(block.busy))  # fmt: skip


class Blocks:
    """The memory a walk in C writes (its keys, rounds and busy flags: ~200 KB at 20,000
    candidates), handed out again once no walk reads it. A fresh block each call was given back
    to the system by the allocator now and then (the heap's top trimmed) and faulted in again
    page by page: about one fresh-list decision in seven took 44 page faults, ~80 µs more of
    its CPU (bench/RESULTS.md "walkpy"). A block is reused only when nothing but this keeper
    refers to it or to its views (a walk's keys, rounds and flags are its views or slices of
    them, each holding a reference): a decision still walked (a filter's CAS in flight) keeps
    its own."""

    KEEP = 2  # blocks kept (a decision in flight and the next one)

    def __init__(self) -> None:
        self._kept: list[Block] = []
        # the references `_idle` counts on a kept block that nothing else refers to (counted
        # here on a probe with views, as `take` counts them, not assumed)
        probe = Block(_room(1))
        probe.views(1)
        self._unread = _idle(probe)

    def take(self, n: int) -> Block:
        """A block with its views for `n` candidates that no walk reads (its contents
        undefined)."""
        size = _room(n)
        for kept in self._kept:
            if len(kept.block) >= size and _idle(kept) == self._unread:
                if kept.n != n:
                    kept.views(n)
                return kept
        block = Block(size)
        block.views(n)
        if len(self._kept) >= self.KEEP:
            self._kept.pop(0)  # (a walk that still reads it holds it)
        self._kept.append(block)
        return block


class Addresses:
    """The data address of long-lived arrays (the index's columns), read once per array:
    numpy's `.ctypes.data` costs ~1-2 µs a call, a dozen per walk. Each array is kept with
    its address (so the address stays its), at most `KEEP` of them."""

    KEEP = 64

    def __init__(self) -> None:
        self._known: dict[int, tuple[np.ndarray, int]] = {}
        self.blocks = Blocks()  # (the walks' blocks, kept beside the arrays they read)

    def of(self, array: np.ndarray) -> int:
        found = self._known.get(id(array))
        if found is not None and found[0] is array:
            return found[1]
        if len(self._known) >= self.KEEP:
            self._known.clear()
        address = address_of(array)
        self._known[id(array)] = (array, address)
        return address


class NativePlan:
    """What a walk in C is given that depends on the request's bounds and the index's arrays
    only, not on the list: the bound spec (column address, width, minimum per bound) and the
    arrays' addresses, checked and built once. A decision on a fresh list asks for one (kept
    by the index per request shape, `index._FreshPlans`), then walks its list with it (`walk`):
    a few µs of checks and conversions per call less."""

    __slots__ = ("_blocks", "_busy_at", "_call", "_call_at", "_first", "_function", "_kept",
                 "_limit", "_scores_at", "_spec")

    def __init__(self, scores_at: int, busy_at: int | None, limit: int, spec: np.ndarray,
                 blocks: Blocks) -> None:  # fmt: skip
        self._kept = spec  # (its address is used below)
        self._blocks = blocks
        self._scores_at, self._busy_at, self._limit = scores_at, busy_at, limit
        self._spec = (address_of(spec), len(spec) // 3)
        self._function = walk_function()  # (None: looked for again at each walk)
        self._first = first_function()
        # (`tn_walk_first`'s plan: what its first round reads besides the list and the block)
        self._call = np.array([scores_at, busy_at or 0, limit, self._spec[0], self._spec[1],
                               HEAD, _NATIVE_CHECKED], dtype=np.int64)  # fmt: skip
        self._call_at = address_of(self._call)

    def walk(self, slots: np.ndarray, sign: float, possible: Callable[[np.ndarray], np.ndarray],
             shortest: int = NATIVE_FROM) -> NativeWalk | None:  # fmt: skip
        """A started `NativeWalk` of `slots` in the order of `sign` × score, or None where C
        does not walk it (no library, a list shorter than `shortest`, a key it does not
        take)."""
        if len(slots) < shortest:
            return None
        function = self._function
        if function is None:
            function = self._function = walk_function()
            if function is None:
                return None
        # (read as they are: int32 from the native resolver, int64 from numpy's paths)
        if slots.dtype not in _SLOT_TYPES or not slots.flags.c_contiguous:
            slots = np.ascontiguousarray(slots, dtype=np.int64)
        walk = NativeWalk(function, slots, self, sign, possible)
        return walk if walk.start() else None


class NativeLayout:
    """The arrays a walk in C reads for one set of bound columns (their addresses, widths and
    the slots they all hold), checked once: a request's `NativePlan` adds its minimums."""

    __slots__ = ("_blocks", "_busy_at", "_columns", "_limit", "_scores_at")

    def __init__(self, scores_at: int, busy_at: int | None, limit: int,
                 columns: list[tuple[int, int]], blocks: Blocks) -> None:  # fmt: skip
        self._scores_at, self._busy_at, self._limit = scores_at, busy_at, limit
        self._columns = columns  # (address, width) per bound
        self._blocks = blocks

    def plan(self, minimums: list[int]) -> NativePlan | None:
        """The plan of these minimums (one per bound, in order), or None for one outside
        int64."""
        spec: list[int] = []
        for (address, width), minimum in zip(self._columns, minimums, strict=True):
            if not _INT64[0] <= minimum <= _INT64[1]:
                return None
            spec += (address, width, minimum)
        return NativePlan(self._scores_at, self._busy_at, self._limit,
                          np.array(spec, dtype=np.int64), self._blocks)  # fmt: skip


def native_layout(
    scores: np.ndarray, busy: np.ndarray | None, columns: list[tuple[np.ndarray, int | None]],
    addresses: Addresses,
) -> NativeLayout | None:
    """The `NativeLayout` of these arrays (`scores` and `busy` flags by slot; `busy` None: not
    avoiding busy nodes; `columns`: (column by slot, or its rung's row of a 2-D column, rung
    or None) per bound; `addresses`: the index's `Addresses`, which keeps them alive), or
    None where C does not read them (a key or bound column of a kind it does not read)."""
    if scores.dtype != np.float64 or not scores.flags.c_contiguous:
        return None
    limit = len(scores)
    if busy is not None:
        if busy.dtype != np.bool_ or not busy.flags.c_contiguous:
            return None
        limit = min(limit, len(busy))
    read: list[tuple[int, int]] = []
    for column, rung in columns:
        if (column.dtype.kind != "i" or not column.flags.c_contiguous
                or column.ndim != (1 if rung is None else 2)):  # fmt: skip
            return None
        address = addresses.of(column)
        if rung is not None:
            if not 0 <= rung < column.shape[0]:
                return None
            address += rung * column.strides[0]
        limit = min(limit, column.shape[-1])
        read.append((address, column.itemsize))
    return NativeLayout(addresses.of(scores), addresses.of(busy) if busy is not None else None,
                        limit, read, addresses.blocks)  # fmt: skip


def native_plan(
    scores: np.ndarray, busy: np.ndarray | None, bounds: list[tuple[np.ndarray, int | None, int]],
    addresses: Addresses,
) -> NativePlan | None:
    """The `NativePlan` of these arrays (`native_layout`'s) and minimums (`bounds`: (column,
    rung or None, minimum) the candidates must reach), or None where C does not take them."""
    layout = native_layout(scores, busy, [(column, rung) for column, rung, _ in bounds],
                           addresses)  # fmt: skip
    return layout.plan([minimum for _, _, minimum in bounds]) if layout is not None else None


class NativeWalk:
    """One fresh list's walk (an iterator of what `fresh_walk` yields: the head as a list,
    then arrays of positions). `keys` and `busy` (None: not avoiding busy nodes) by position,
    as read when the walk started, as `fresh_walk` is given them.

    Its rounds (`_Rounds`) do not refer back to it: a walk no decision holds any more is freed
    at once, its block handed out again (`Blocks`), not left to the cyclic collector (a walk
    and the generator of its rounds referring to each other kept every walk's ~180 KB until
    the next collection: the next walk's block was fresh memory, faulted in page by page)."""

    def __init__(self, function: Callable[..., int], slots: np.ndarray, plan: NativePlan,
                 sign: float, possible: Callable[[np.ndarray], np.ndarray]) -> None:  # fmt: skip
        """`slots`: int32 or int64, contiguous; `plan`: the index's arrays and the bounds
        (`native_plan`)."""
        self._core = _Rounds(function, slots, plan, sign, possible)
        self.keys = self._core.keys
        self.busy: np.ndarray | None = None  # (known once started)
        self._rounds: Iterator[list[int] | np.ndarray] | None = None

    def start(self) -> bool:
        """The first round (reads every key): False when C does not take this list."""
        self._rounds = self._core.start()
        self.busy = self._core.busy
        return self._rounds is not None

    def __iter__(self) -> Iterator[list[int] | np.ndarray]:
        return self

    def __next__(self) -> list[int] | np.ndarray:
        assert self._rounds is not None, "start() first"
        return next(self._rounds)


class _Rounds:
    """A walk's calls into C and the generator of its rounds (`NativeWalk`'s)."""

    def __init__(self, function: Callable[..., int], slots: np.ndarray, plan: NativePlan,
                 sign: float, possible: Callable[[np.ndarray], np.ndarray]) -> None:  # fmt: skip
        """`slots`: int32 or int64, contiguous; `plan`: the index's arrays and the bounds
        (`native_plan`)."""
        self._function = function
        self._possible = possible  # (numpy's, for the rounds after C's)
        n = len(slots)
        by_busy = plan._busy_at is not None
        # One block for what C writes: the keys, the positions of its rounds (each round
        # after the last one's: a round given as an array is never written over), the busy
        # count, the busy flags.
        room = _NATIVE_CHECKED + 1
        block = plan._blocks.take(n)
        base = block.address
        self.keys = block.keys
        self._out = block.out
        self.busy = block.busy if by_busy else None
        self._keys_at, self._out_at = base, base + 8 * n
        self._busy_at = base + 8 * (n + room) if by_busy else None
        self._kept = (slots, plan)  # (their addresses are used below)
        self._list = (address_of(slots), slots.itemsize, n, plan._limit)
        self._first_call = None if plan._first is None else (
            plan._call_at, self._list[0], slots.itemsize, n, sign, base)  # fmt: skip
        self._first_function = plan._first
        self._first = (plan._scores_at, sign, plan._busy_at)
        self._spec = plan._spec
        self._sign = sign

    def start(self) -> Iterator[list[int] | np.ndarray] | None:
        """The first round (reads every key), and the rounds from it; None when C does not
        take this list."""
        if self._first_call is not None:  # (the same round, its arguments mostly the plan's)
            count = self._first_function(*self._first_call)  # type: ignore[misc]
            first = self._out[:count] if count >= 0 else None
        else:
            first = self._round(False if self.busy is not None else None, None, HEAD, 0, True)
        if first is None:
            return None
        if self.busy is not None and not self._out[_NATIVE_CHECKED]:
            # (no candidate busy: one group, as no flags; C wrote none where no node of the
            # index is busy)
            self.busy = None
        return self._walk(first, self.busy)

    def _round(self, group: bool | None, after: tuple[float, int] | None, cap: int,
               walked: int, first: bool = False) -> np.ndarray | None:  # fmt: skip
        """The positions of the `cap` first of the group after `after`, written after the
        `walked` ones before them."""
        by_group = group is not None
        scores, sign, busy = self._first if first else (None, self._sign, None)
        count = self._function(
            *self._list, scores, sign, busy if by_group else None, self._keys_at,
            self._busy_at if by_group else None, 1 if group else 0, *self._spec,
            after is not None, after[0] if after is not None else 0.0,
            after[1] if after is not None else 0, self._out_at + 8 * walked, cap,
            self._out_at + 8 * _NATIVE_CHECKED if first else None,
        )  # fmt: skip
        if count < 0:
            return None
        return self._out[walked : walked + count]

    def _walk(self, first: np.ndarray,
              busy: np.ndarray | None) -> Iterator[list[int] | np.ndarray]:  # fmt: skip
        """The rounds: `first` (the first group's head), then C's second round, then numpy
        from where C stopped."""
        groups: tuple[bool | None, ...] = (None,) if busy is None else (False, True)
        walked = 0
        found: np.ndarray | None = first
        cap = HEAD
        for group in groups:
            after: tuple[float, int] | None = None  # the last position given of the group
            while True:
                if found is None:
                    found = (self._round(group, after, cap, walked)
                             if walked < _NATIVE_CHECKED else None)  # fmt: skip
                    if found is None:  # numpy goes on from there (or C ran out of memory)
                        yield from fresh_walk(self.keys, busy, self._possible,
                                              resume=(group, after))  # fmt: skip
                        return
                positions = found
                found = None
                if len(positions):
                    yield positions.tolist() if not walked else positions
                    walked += len(positions)
                    last = int(positions[-1])
                    after = (float(self.keys[last]), last)
                exhausted = len(positions) < cap
                cap = HEAD if not walked else _NATIVE_CHECKED - walked  # (a head first)
                if exhausted:
                    break


def native_walk(
    slots: np.ndarray, scores: np.ndarray, sign: float, busy: np.ndarray | None,
    bounds: list[tuple[np.ndarray, int | None, int]], possible: Callable[[np.ndarray], np.ndarray],
    addresses: Addresses, shortest: int = NATIVE_FROM,
) -> NativeWalk | None:
    """A started `NativeWalk` of `slots` (their `scores` and `busy` flags by slot, `bounds`:
    as `native_plan` takes them; `possible`: numpy's verdict on the same bounds, for the
    rounds after C's), or None where C does not walk it (`native_plan`, `NativePlan.walk`)."""
    if len(slots) < shortest:
        return None
    plan = native_plan(scores, busy, bounds, addresses)
    return plan.walk(slots, sign, possible, shortest) if plan is not None else None
