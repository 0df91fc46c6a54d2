"""The native steps of a refused pod of several containers (`native/refusals`, built by `make
native`): `refusal_steps.group_steps`' per-step verdicts, picks, ties and charges computed row
by row in C instead of ~80 numpy operations over every candidate row and card (~0.5-1.2 ms of
a two-container pod's first refusal at 5,000 nodes, the top of the refused calls' p99).

Same contract as the numpy path (`refusal_steps.step_arrays`): each candidate's failing step,
its signature, its cards' codes then, whether it is refused, and the ties; both are checked
equal on adversarial clusters and pods in `tests/scheduler/test_native_steps.py`. Only where
every card class the index knows is libvgpu slices (a card's code is then its verdict) and the
pod binds to no NUMA node; anything else, and a process without the library (not built,
another platform), takes the numpy path (`NativeSteps.load` gives None), as exactly.

The library is `native/refusals/build/libtessera_refusals.so` beside this checkout, or the
file `TESSERA_REFUSALS_LIBRARY` names. Its soname is its own: loading it affects no other
library's lookup."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .native_address import address_of

LIBRARY_ENV = "TESSERA_REFUSALS_LIBRARY"
_BUILT = (Path(__file__).resolve().parents[2] / "native" / "refusals" / "build"
          / "libtessera_refusals.so")  # fmt: skip
PADDING = 64  # bytes readable after `reasons_json`'s tables' last entry (src/reply.c TR_SPAN)
_MAX_WIDTH = 64  # cards per row the library takes (src/steps.c MAX_WIDTH)
_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Cards(ctypes.Structure):
    _fields_ = [("rows", _I), ("width", _I), ("card_class", _P), ("card_mem", _P),
                ("card_cores", _P), ("card_slots", _P), ("card_computing", _P),
                ("card_idle", _P), ("card_pct", _P), ("unusable_sig", _P)]  # fmt: skip


class _Classes(ctypes.Structure):
    _fields_ = [("classes", _I), ("memory", _P), ("cores", _P), ("split", _P), ("kind", _P)]


class _Pod(ctypes.Structure):
    _fields_ = [("containers", _I), ("requests", _P), ("statics", _P), ("mutex", _I),
                ("sign", _I), ("w_slot", _I), ("w_core", _I), ("w_mem", _I),
                ("all_codes", _I)]  # fmt: skip


# (array, dtype) of the index's per-card arrays the library reads, in `_Cards` order
_CARD_ARRAYS = (("card_class", np.int32), ("card_mem", np.int64), ("card_cores", np.int32),
                ("card_slots", np.int32), ("card_computing", np.bool_),
                ("card_idle", np.bool_), ("card_pct", np.int16))  # fmt: skip
_INT64 = (1 << 63) - 1


def library_path() -> Path:
    """Where the library is looked for."""
    named = os.environ.get(LIBRARY_ENV)
    return Path(named) if named else _BUILT


class NativeSteps:
    """The library's `tr_steps`, loaded once per process (`load`)."""

    _loaded: ClassVar[dict[str | None, NativeSteps | None]] = {}  # (by TESSERA_REFUSALS_LIBRARY)

    def __init__(self, lib: ctypes.CDLL) -> None:
        steps = lib.tr_steps
        steps.restype = ctypes.c_int64
        steps.argtypes = [_P, _P, _P, _P, _I, _P, _P, _P, _P, _P]
        self._steps = steps
        group = lib.tr_group
        group.restype = ctypes.c_int64
        group.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _I, _P]
        self._group = group
        distinct = lib.tr_distinct
        distinct.restype = ctypes.c_int64
        distinct.argtypes = [_P, _P, _P, _I, _P, _I, _P, _I, _P, _P, _P]
        self._distinct = distinct
        # (a library built before the reply's writer: the steps still load, the reply is joined
        # in Python)
        reasons_json = getattr(lib, "tr_reasons_json", None)
        if reasons_json is not None:
            reasons_json.restype = ctypes.c_int64
            reasons_json.argtypes = [_P, _P, _I, _P, _P, _P, _I, _P, _I, _P, _I]
        self._reasons_json = reasons_json

    @classmethod
    def load(cls) -> NativeSteps | None:
        """The library at `library_path()`, once per path; None without it."""
        named = os.environ.get(LIBRARY_ENV)  # (per call: a dict lookup, no path built)
        if named in cls._loaded:
            return cls._loaded[named]
        path = str(library_path())
        found = None
        if Path(path).is_file():
            try:
                found = cls(ctypes.CDLL(path))
            except (OSError, AttributeError):
                found = None
        cls._loaded[named] = found
        return found

    def steps(self, index: Any, slots: np.ndarray, steps: Any, ties: np.ndarray | None,
              every_row: bool = False
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """(the step each candidate fails at, -1 for none; its signature there, -1; its cards'
        codes then, -1 elsewhere; whether it is refused), `ties` (bool by candidate) set where
        a pick chose by index between unlike cards: `refusal_steps.step_arrays`' results. None
        where the library does not apply (another card kind, NUMA binding, a value out of
        its range): the caller computes them in numpy. `every_row` (a pod of one container):
        every candidate's codes against it, refused or not, grouped or not (as
        `refusal_steps.card_codes` gives them to `refusal_shapes._group`)."""
        options = steps.options
        if options.numa_bind:
            return None
        memory, cores_of, split, sliced = index.card_classes.statics()
        if not sliced.all():
            return None
        kind = index.card_classes.sans_numa()
        requests = []
        statics = []
        for r in steps.containers:
            percentage = -1 if r.memory_percentage is None else r.memory_percentage
            values = (r.count, r.memory_mib, percentage, r.cores)
            if not all(-_INT64 <= v <= _INT64 for v in values):
                return None
            requests.append(values)
            statics.append(index.card_classes.static_refusal(r, options))
        classes = len(memory)
        if len(kind) != classes or any(len(s) != classes for s in statics):
            return None
        signs = [-1 if p == "binpack" else 1 for p in options.gpu_policies
                 if p in ("binpack", "spread")]  # fmt: skip
        weights = options.weights
        if not all(-_INT64 <= w <= _INT64 for w in weights):
            return None
        arrays = []
        for name, dtype in _CARD_ARRAYS:
            array = getattr(index, name)
            if array.dtype != dtype or not array.flags.c_contiguous:
                return None
            arrays.append(array)
        signature = index.unusable_sig
        width = arrays[0].shape[1]
        rows = arrays[0].shape[0]
        if (width > _MAX_WIDTH or signature.dtype != np.int64 or len(signature) < rows
                or any(a.shape != (rows, width) for a in arrays)):  # fmt: skip
            return None
        by_class = [np.ascontiguousarray(a, dtype=np.int64) for a in (memory, cores_of, split,
                                                                       kind)]  # fmt: skip
        request_array = np.ascontiguousarray(requests, dtype=np.int64)
        static_array = np.ascontiguousarray(statics, dtype=np.int64)
        cards = _Cards(rows, width, *(address_of(a) for a in arrays), address_of(signature))
        klass = _Classes(classes, *(address_of(a) for a in by_class))
        if every_row and len(requests) != 1:
            return None
        pod = _Pod(len(requests), address_of(request_array), address_of(static_array),
                   int(options.mutex), signs[0] if signs else 0, *weights,
                   int(every_row))  # fmt: skip
        candidates = np.ascontiguousarray(slots, dtype=np.int64)
        count = len(candidates)
        failed_at = np.empty(count, dtype=np.int64)
        failed_sig = np.empty(count, dtype=np.int64)
        codes = np.empty((count, width), dtype=np.int64)
        refused = np.empty(count, dtype=np.bool_)
        tied = None
        if ties is not None:
            if ties.dtype != np.bool_ or not ties.flags.c_contiguous or len(ties) != count:
                return None
            tied = address_of(ties)
        done = self._steps(ctypes.byref(cards), ctypes.byref(klass), ctypes.byref(pod),
                           address_of(candidates), count, address_of(failed_at),
                           address_of(failed_sig), address_of(codes), address_of(refused),
                           tied)  # fmt: skip
        if done != 0:
            return None
        return failed_at, failed_sig, codes, refused

    def group(self, head: np.ndarray, codes: np.ndarray, where: np.ndarray,
              key_dtype: Any = np.int64) -> tuple[np.ndarray, list[bytes], np.ndarray] | None:
        """`refusal_steps.grouped` of int64 `head` and `codes` rows: (group by row, -1 where
        not `where`; each group's key, its first row's head and sorted codes as bytes; each
        group's first row), the groups numbered by their first row (`grouped` numbers them
        by their packed value: the same groups and keys; the codes in a key as `key_dtype`,
        the dtype the numpy path groups them in). None where it does not apply."""
        if (head.dtype != np.int64 or codes.dtype != np.int64 or where.dtype != np.bool_
                or head.ndim != 2 or codes.ndim != 2 or len(head) != len(codes)
                or len(where) != len(codes)):  # fmt: skip
            return None
        head = np.ascontiguousarray(head)
        codes = np.ascontiguousarray(codes)
        where = np.ascontiguousarray(where)
        count = len(codes)
        size = 1 << max(1, (2 * count - 1).bit_length())
        groups = np.empty(count, dtype=np.int64)
        first = np.empty(count, dtype=np.int64)
        table = np.empty(size, dtype=np.int64)
        ordered = np.empty(codes.shape, dtype=np.int64)
        found = self._group(address_of(head), head.shape[1], address_of(codes), codes.shape[1],
                            address_of(where), count, address_of(groups), address_of(first),
                            address_of(table), size, address_of(ordered))  # fmt: skip
        if found < 0:
            return None
        firsts = first[:found].tolist()
        if key_dtype != np.int64:
            ordered = ordered.astype(key_dtype)
        keys = [head[i].tobytes() + ordered[i].tobytes() for i in firsts]
        if found < count and not where.all():  # the rows not grouped, keyed as `grouped`
            rest = int(np.argmin(where))  # keys them: a group no row is given (its first's)
            keys.append(head[rest].tobytes() + np.sort(codes[rest]).astype(key_dtype).tobytes())
            firsts.append(rest)
        return groups, keys, np.asarray(firsts, dtype=np.int64)

    def distinct(self, numbers: np.ndarray, at: np.ndarray, versions: np.ndarray,
                 slots: np.ndarray, first_of: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | np.ndarray | None:
        """`refusal_states.RowStates.distinct`'s reading of the candidates' row numbers
        (`numbers`, valid where `at` is the row's version): (the candidates that are their
        number's first, in order; each candidate's place among them); where some candidates'
        numbers are stale, those candidates (the caller renumbers their rows); None where it
        does not apply.
        `first_of`: scratch, every entry -1 (left so), more entries than any number."""
        rows = len(versions)
        if (numbers.dtype != np.int64 or at.dtype != np.int64 or versions.dtype != np.int64
                or first_of.dtype != np.int64 or len(numbers) < rows or len(at) < rows
                or not (numbers.flags.c_contiguous and at.flags.c_contiguous
                        and versions.flags.c_contiguous and first_of.flags.c_contiguous)):
            return None  # fmt: skip
        candidates = np.ascontiguousarray(slots, dtype=np.int64)
        count = len(candidates)
        reps = np.empty(count, dtype=np.int64)
        rank = np.empty(count, dtype=np.int64)
        stale = ctypes.c_int64(0)
        found = self._distinct(address_of(numbers), address_of(at), address_of(versions), rows,
                               address_of(candidates), count, address_of(first_of),
                               len(first_of), address_of(reps), address_of(rank),
                               ctypes.byref(stale))  # fmt: skip
        if found == -2:
            return reps[: stale.value]
        if found < 0:
            return None
        return reps[:found], rank

    def reasons_json(self, keys: np.ndarray, key_at: np.ndarray, rows: np.ndarray,
                     texts: np.ndarray, text_at: np.ndarray, ids: np.ndarray) -> bytes | None:
        """The failedNodes JSON object of the pairs (`rows[i]`'s key, `ids[i]`'s text):
        `keys` (uint8) holds each row's key (`"name":`) at `key_at[row]:key_at[row + 1]`,
        `texts` each id's JSON string likewise (`text_at`), both with at least `PADDING` bytes
        after the last (read, never written). None where it does not apply (a library without
        the writer, a row or id out of range)."""
        if self._reasons_json is None or len(rows) != len(ids):
            return None
        arrays = (keys, key_at, texts, text_at)
        if (keys.dtype != np.uint8 or texts.dtype != np.uint8 or key_at.dtype != np.int64
                or text_at.dtype != np.int64 or not all(a.flags.c_contiguous for a in arrays)
                or len(key_at) < 1 or len(text_at) < 1 or len(keys) < key_at[-1] + PADDING
                or len(texts) < text_at[-1] + PADDING):  # fmt: skip
            return None
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        pairs = (address_of(keys), address_of(key_at), len(key_at) - 1, address_of(rows),
                 address_of(texts), address_of(text_at), len(text_at) - 1, address_of(ids),
                 len(rows))  # fmt: skip
        size = self._reasons_json(*pairs, None, 0)  # (its size first: every row and id checked)
        if size < 0:
            return None
        out = np.empty(size, dtype=np.uint8)  # (written once, copied once into the reply)
        written = self._reasons_json(*pairs, address_of(out), size)
        return out.tobytes() if written == size else None
