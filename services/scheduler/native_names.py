"""The native name resolver (`native/names`, built by `make native`): kube-scheduler's
`nodenames` array resolved to the name table's rows and the index's slots in one pass over the
body's bytes in C, instead of `NameTable.rows`' ~15 numpy passes over every name (each a
temporary array; ~0.3 ms warm, ~0.8 cold at 20,000 names in kube-scheduler's parallel order).

Same contract as `NameTable.rows`: the rows of a compact `["a","b"]` array whose every name is
a registered one byte for byte (a hash finds where to look; the name's bytes are compared
there), None for anything else (an escape, a control character, spacing, an empty or unknown
name), which the caller then reads the slow way. Both paths are checked equal on adversarial
lists in `tests/scheduler/test_native_names.py`. Without the library (not built, another
platform) `NativeNames.load` gives None and `NameTable` resolves in numpy, as exactly.

The library is `native/names/build/libtessera_names.so` beside this checkout, or the file
`TESSERA_NAMES_LIBRARY` names (the image's copy). Its soname is its own: loading it affects
no other library's lookup."""

from __future__ import annotations

import ctypes
import os
import random
import weakref
from pathlib import Path

import numpy as np

from .native_address import address_of

LIBRARY_ENV = "TESSERA_NAMES_LIBRARY"
ABI = 2  # the library's `tn_abi()` this code calls it as (rows and slots of a width asked)
_BUILT = Path(__file__).resolve().parents[2] / "native" / "names" / "build" / "libtessera_names.so"
_library: ctypes.CDLL | None = None


def library_path() -> Path:
    """Where the library is looked for."""
    named = os.environ.get(LIBRARY_ENV)
    return Path(named) if named else _BUILT


def library() -> ctypes.CDLL | None:
    """The library, loaded once per process; None while there is none, or while the one found
    is not of this interface (`ABI`: an older build writes int64 where int32 is read; looked
    for again at the next name table: a stat and a load)."""
    global _library
    if _library is not None:
        return _library
    path = library_path()
    try:
        lib = ctypes.CDLL(str(path)) if path.is_file() else None
    except OSError:
        return None
    if lib is None:
        return None
    abi = getattr(lib, "tn_abi", None)
    if abi is None:
        return None  # (older than `tn_abi`: its resolver writes int64)
    abi.restype = ctypes.c_uint32
    abi.argtypes = []
    if abi() != ABI:
        return None
    lib.tn_build.restype = ctypes.c_void_p
    lib.tn_build.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]  # fmt: skip
    lib.tn_resolve.restype = ctypes.c_int64
    lib.tn_resolve.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                               ctypes.c_uint64]  # fmt: skip
    lib.tn_resolve_in.restype = ctypes.c_int64
    lib.tn_resolve_in.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64,
                                  ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p]  # fmt: skip
    lib.tn_free.restype = None
    lib.tn_free.argtypes = [ctypes.c_void_p]
    _library = lib
    return lib


class NativeNames:
    """A native table of the registered names (rows as `NameTable`'s, with their slots); freed
    with this object."""

    def __init__(self, lib: ctypes.CDLL, handle: int) -> None:
        self._resolve = lib.tn_resolve
        self._resolve_in = lib.tn_resolve_in
        self._handle = handle
        self._free = weakref.finalize(self, lib.tn_free, handle)

    @classmethod
    def load(cls, encoded: list[bytes], slots: np.ndarray, order: np.ndarray | None = None,
             lib: ctypes.CDLL | None = None) -> NativeNames | None:  # fmt: skip
        """A table of these names (UTF-8, distinct) with their slots by row; `order`: the rows
        in kube-scheduler's node order as guessed (default: by name), which lists made of runs
        of it are resolved fastest in (any list is resolved exactly). None without the library
        or when it refuses them."""
        lib = lib if lib is not None else library()
        if lib is None:
            return None
        if order is None:
            order = np.asarray(sorted(range(len(encoded)), key=encoded.__getitem__),
                               dtype=np.int64)  # fmt: skip
        lengths = np.fromiter(map(len, encoded), dtype=np.uint64, count=len(encoded))
        by_row = np.ascontiguousarray(slots, dtype=np.int64)
        ordered = np.ascontiguousarray(order, dtype=np.int64)
        if len(by_row) != len(encoded) or len(ordered) != len(encoded):
            return None
        seed = random.getrandbits(64)  # (a hash no list can be built against in advance)
        handle = lib.tn_build(b"".join(encoded), lengths.ctypes.data, by_row.ctypes.data,
                              ordered.ctypes.data, len(encoded), seed)  # fmt: skip
        return cls(lib, handle) if handle else None

    def resolve(self, array: bytes, narrow_from: int = 0
                ) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
        """(rows, slots) of the names of a JSON array (its bytes, `[` to `]`), in order; None
        unless every name is a registered node's and the array is in the compact form. As
        int32 when the array holds `narrow_from` names or more (a table's rows and slots are
        below 2^31: `tn_build` refuses others), else int64 (`_width`)."""
        # room for as many names as names 2 bytes shorter than the first would make (names
        # are often all as long: 15 % spare at 10 bytes, the pages past them never touched);
        # if the array holds more, room for every name it could hold, then cut to size
        first = array.find(b'"', 2) - 2
        if first < 1 or len(array) < 4:
            return None
        capacity = (len(array) - 1) // max(4, first + 1) + 1
        retried = False
        for _ in range(2):
            kind = _width(capacity, narrow_from)
            rows = np.empty(capacity, dtype=kind)
            slots = np.empty(capacity, dtype=kind)
            count = self._resolve(self._handle, array, len(array), address_of(rows),
                                  address_of(slots), kind.itemsize, capacity)  # fmt: skip
            if count != -2:
                break
            capacity = (len(array) - 1) // 4 + 1  # (a name takes at least `"x",`)
            retried = True
        if count < 0:
            return None
        if count < narrow_from and kind.itemsize == 4:  # (fewer names than room for)
            return rows[:count].astype(np.int64), slots[:count].astype(np.int64)
        if retried:  # (room for every name the bytes could hold: cut to size)
            return rows[:count].copy(), slots[:count].copy()
        return (rows, slots) if count == capacity else (rows[:count], slots[:count])

    def slots_in(self, body: bytes, start: int,
                 narrow_from: int = 0) -> tuple[np.ndarray, int] | None:  # fmt: skip
        """(slots, end) of the names of the JSON array that starts at `body[start]` (its `[`),
        read in place: no copy of the array and no search for its end first (it ends at the
        first `]` after a name's closing quote; `end` is just past it). None as `resolve`
        gives it, and also when a registered name holds a `"`, a backslash or a control
        character (the array's end is then not known before a pass over it: the caller cuts
        it out and calls `resolve`). The rows are not written (a placed pod's call reads only
        the slots; `NameTable.row_of_slot` gives them). The slots as `resolve` gives them:
        int32 from `narrow_from` names (80 KB written by C and read again by the walk at
        20,000 names, not 160), int64 below."""
        first = body.find(b'"', start + 2) - start - 2
        size = len(body) - start
        if first < 1 or size < 4:
            return None
        capacity = (size - 1) // max(4, first + 1) + 1  # (as `resolve`)
        for _ in range(2):
            kind = _width(capacity, narrow_from)
            # (then 8 bytes for where the array ends, a uint64 written by the call itself,
            # 8-byte aligned: numpy's buffers are 16-byte aligned)
            room = capacity + (capacity & 1) if kind.itemsize == 4 else capacity
            slots = np.empty(room + 8 // kind.itemsize, dtype=kind)
            at = address_of(slots)
            count = self._resolve_in(self._handle, body, len(body), start, None, at,
                                     kind.itemsize, capacity,
                                     at + kind.itemsize * room)  # fmt: skip
            if count != -2:
                break
            capacity = (size - 1) // 4 + 1  # (room for every name the bytes could hold)
        if count < 0:
            return None
        if kind.itemsize == 8:
            return slots[:count], int(slots[room])
        # (the end's two halves read as ints: ~0.3 us, a uint64 view of them ~1.1)
        end = int(slots[room]) & 0xFFFFFFFF | int(slots[room + 1]) << 32
        if count < narrow_from:  # (fewer names than room for)
            return slots[:count].astype(np.int64), end
        return slots[:count], end


_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)


def _width(capacity: int, narrow_from: int) -> np.dtype:
    """The integers a list with room for `capacity` names is resolved into: int32 from
    `narrow_from` names (what C reads, `native_walk`: half the memory), int64 below (numpy
    casts an index array that is not int64 to int64 at every gather, and a short list is
    gathered by a dozen)."""
    return _INT32 if capacity >= narrow_from else _INT64
