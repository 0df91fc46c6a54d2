"""Resolving kube-scheduler's `nodenames` array straight from the body's bytes: the index's
name table (`NameTable`: any list of registered names) and the node order it guesses
(`NameOrder`: a run of it, one memcmp). Pure; built per topology by `ClusterIndex.name_table`,
used by `NodeNamesCache` (node_names.py) through `ClusterIndex.names_from_bytes` /
`names_of_run`. Tests: `tests/scheduler/test_node_names.py`."""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from functools import cached_property
from typing import Any

import numpy as np

from .native_names import NativeNames
from .native_walk import NATIVE_FROM

_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*\Z')  # a name JSON writes as it is, between quotes
# _MASKS[k]: the low k bytes of a little-endian uint64 word (a name shorter than 8 bytes)
_ROOM = 2  # a level's table: a power of two at least this many times its names
_ROOM_SECOND = 16  # the second level's (given ~1/7 of the names: a sixteenth of the first's)
# each level's bucket multiplier (odd 64-bit constants)
_LEVEL_MIXES = tuple(np.uint64(m) for m in (
    0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB,
    0x8EBC6AF09C88C6E3, 0x589965CC75374CC3, 0x1D8E4E27C47D124F, 0xF1357AEA2E62A9C5,
))  # fmt: skip
_HEAD_BYTES = 4096  # of a list read in place, looked at as runs (`NameOrder.starts_with_runs`)
RUN_TRIES = 8  # lists in a row that were no runs before one in 8 is looked at (`NameOrder`)
_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)


class NameTable:
    """Every registered node's name as bytes, for resolving a `nodenames` array straight from
    the body's bytes (kube-scheduler's lists change every cycle: a new list of 20,000 names
    would otherwise be decoded into 20,000 new strings, each hashed and compared with the
    index's in a dict lookup, ~0.2-0.4 µs a name on a large heap).

    A name is read as `columns` little-endian uint64 words taken inside it: word k starts at
    byte min(8k, length - 8), so a name of 8 bytes or more is covered, last word overlapping,
    with no masking at all; a shorter one is its bytes zero-padded. A list whose names all have
    its first name's length is a grid of `"name",` rows: checked column by column (and no other
    quote in it), each column of words is a strided view of the body (`_even`: no search, no
    gather); any other list's names are found by their quotes and their words gathered, one
    unaligned gather per column (`_uneven`). Each name's words and length are hashed
    (vectorised) into levels of tables of rows (4 bytes an entry, each table a power of two at
    least twice the names it is given; a name goes to the first level where its bucket is
    free, so a lookup never probes on): a list is looked up with the same operations over all
    its names at once (`_found`: the row in the name's bucket of the first level, which must
    hold the name's length and every word; the names it does not hold, about a seventh, looked
    for in the second level, a table 16-32× the names it is given, which holds all but ~1/40
    of them; those few found by their 64-bit hash in a sorted array, one searchsorted, when no
    two share a hash, else in more levels), so a name resolves only to the node whose name is
    byte for byte the same (the hash only finds where to compare). What the fast path cannot
    prove it reads exactly (escapes, control characters, spacing other than kube-scheduler's
    compact `["a","b"]`, a name longer than the widest known one, any unknown name) returns
    None: the caller decodes the list as before. Built per topology
    (`ClusterIndex.name_table`), with the node order's serialisation (`NameOrder`); tests:
    `tests/scheduler/test_node_names.py`. (Sorted hashes binary-searched, masked words: 1.3 ms
    for 20,000 names; the table 4× the names probed a round at a time over every name: ~1.3
    ms for 20,000 equal-length names in a new order at load 15; one table of tags and rows 6×
    the names, probed on 16 buckets at once, ~0.9, 1,000 names ~0.1; levels of it, ~0.1 ms
    less at 20,000; these levels of rows, checked as they are read, ~0.05 less again, the
    tables a quarter the size: a lookup between decisions, its cache lines evicted, ~0.6; two
    levels and the sorted overflow instead of 5-6 levels of the same room: ~0.04 less, the
    fixed cost of the levels that held a few names each.)"""

    _MIX = np.uint64(0x9E3779B97F4A7C15)

    def __init__(self, names: list[str], slots: list[int]) -> None:
        encoded = [name.encode() for name in names]
        longest = max((len(e) for e in encoded), default=1)
        self.width = max(8, -(-longest // 8) * 8)
        self.columns = self.width // 8
        self.usable = bool(encoded)
        # the same words `lookup` reads, from the names laid out as in a compact list
        array = b'["' + b'","'.join(encoded) + b'"]'
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        starts = np.empty(len(encoded), dtype=np.int64)
        if len(encoded):
            starts[0] = 2
            np.cumsum(lengths[:-1] + 3, out=starts[1:])
            starts[1:] += 2
        self.words = self._words(array, starts, lengths)
        # (by row, for the check of a found row: 2 bytes each, a quarter of the cache lines)
        self.lengths = lengths.astype(np.uint16) if longest < 1 << 16 else lengths
        # every name's length when they all have one (`_found` then checks no row's length for
        # a list read as a grid of that length), else -1
        self.one_length = (int(lengths[0]) if len(encoded)
                           and bool((lengths == lengths[0]).all()) else -1)  # fmt: skip
        self.slots = np.asarray(slots, dtype=np.int64)
        self.names = np.empty(len(names), dtype=object)  # by row (never changed)
        self.names[:] = names
        # by slot: the row (-1: none); by row: the name as a JSON object key, `"name":` (what
        # json.dumps writes for it, ensure_ascii=False), allocated together here so that a
        # refusal's reply joins them without touching the index's scattered strings
        self.row_of_slot = np.full(max(slots, default=-1) + 1, -1, dtype=np.int64)
        self.row_of_slot[self.slots] = np.arange(len(names), dtype=np.int64)
        self._row_of: dict[str, int] | None = None
        self.keys: np.ndarray | None = np.empty(len(names), dtype=object)
        try:
            self.keys[:] = [b'"' + e + b'":' if _PLAIN.match(e)
                            else json.dumps(n, ensure_ascii=False).encode() + b":"
                            for n, e in zip(names, encoded, strict=True)]  # fmt: skip
        except UnicodeEncodeError:  # (a lone surrogate: the reply encodes it the slow way)
            self.keys = None
        self.order = NameOrder(encoded, self.slots) if self.keys is not None and all(
            _PLAIN.match(e) for e in encoded) else None  # fmt: skip
        # the same table in C (`native_names`: one pass over a list's bytes, fastest on runs
        # of the node order as `NameOrder` guesses it), where built
        self.native = NativeNames.load(
            encoded, self.slots, self.order.rows[: self.order.count] if self.order else None
        ) if encoded else None  # fmt: skip
        hashes = self._hash(self.words, lengths)
        # levels of tables, each entry a name's row (-1 where none): every name sits in its own
        # bucket of the first level whose bucket for it was free (the first name in row order
        # takes it), so a lookup reads one bucket per level and never probes on. 4 bytes an
        # entry, a table 2-4× the names it is given: a lookup of 20,000 names touches ~4,000
        # cache lines of it, not ~16,000 (a decision between two calls evicts them all)
        self.levels: list[tuple[np.ndarray, np.uint64, np.uint64]] = []  # (table, mix, shift)
        pending = np.arange(len(hashes), dtype=np.int64)
        if len(pending):
            pending = self._level(hashes, pending, _LEVEL_MIXES[0], _ROOM)
        if len(pending):  # (a second level far emptier: all but ~1/40 of what it is given)
            pending = self._level(hashes, pending, _LEVEL_MIXES[1], _ROOM_SECOND)
        # the names neither level holds (~1/300 of them), by their 64-bit hash, sorted: found
        # with one searchsorted instead of 3-4 more levels (each ~10 numpy calls, ~25 µs of
        # overhead at any size). Only when no two of them share a hash (else: more levels)
        self.overflow: tuple[np.ndarray, np.ndarray] | None = None
        if len(pending):
            by_hash = pending[np.argsort(hashes[pending], kind="stable")]
            sorted_hashes = hashes[by_hash]
            if bool((sorted_hashes[1:] != sorted_hashes[:-1]).all()):
                self.overflow = (sorted_hashes, by_hash)
                pending = pending[:0]
            else:
                for mix in _LEVEL_MIXES[2:]:
                    if not len(pending):
                        break
                    pending = self._level(hashes, pending, mix, _ROOM)
        # names left over after every level (each level takes all but ~1/7 of what it is
        # given: 20,000 names need 5-6) would never be found: the table is not used
        if len(pending) or len(names) >= 1 << 31:
            self.usable = False

    def _level(self, hashes: np.ndarray, pending: np.ndarray, mix: np.uint64,
               room: int) -> np.ndarray:
        """A new level holding one name of `pending` per bucket (the first in row order);
        the names it could not take."""
        size = 16
        while size < room * len(pending):
            size *= 2
        shift = np.uint64(64 - (size.bit_length() - 1))  # the bucket: the top bits
        table = np.full(size, -1, dtype=np.int32)
        buckets = self._bucket(hashes[pending], mix, shift)
        taken, first = np.unique(buckets, return_index=True)
        table[taken] = pending[first]
        self.levels.append((table, mix, shift))
        left = np.ones(len(pending), dtype=bool)
        left[first] = False
        return pending[left]

    @cached_property
    def json_keys(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Every row's `keys` entry back to back (uint8, 64 zero bytes after the last: the C
        writer's padding) and where each starts (row r's is `blob[at[r]:at[r + 1]]`), for a
        refusal's reply written in C (`failed_nodes_json`); built once per table; None without
        `keys`."""
        if self.keys is None:
            return None
        keys = self.keys.tolist()
        at = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)), out=at[1:])
        return np.frombuffer(b"".join(keys) + bytes(64), dtype=np.uint8), at

    def row_of(self, name: str) -> int:
        """A name's row, -1 when the table has none (a dict built on first use)."""
        if self._row_of is None:
            self._row_of = {n: i for i, n in enumerate(self.names.tolist())}
        return self._row_of.get(name, -1)

    def _words(self, array: bytes, starts: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Each name's words (see the class), one array per column, read straight from the
        array's bytes: a uint64 view at every byte offset (unaligned, stride 1; 8 zero bytes
        appended so a short last name's word stays inside)."""
        padded = array + bytes(8)
        at_byte = np.ndarray((len(padded) - 7,), dtype=np.uint64, buffer=padded, strides=(1,))
        first = at_byte[starts]
        short = np.flatnonzero(lengths < 8)
        if len(short):  # shorter than a word: its bytes only, every column alike
            first[short] &= _MASKS[lengths[short]]
        words = [first]
        back = lengths - 8
        for column in range(1, self.columns):
            word = at_byte[starts + np.minimum(8 * column, back)]
            if len(short):
                word[short] = first[short]
            words.append(word)
        return words

    @staticmethod
    def _bucket(hashes: np.ndarray, mix: np.uint64, shift: np.uint64) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((hashes * mix) >> shift).astype(np.int64)

    def _hash(self, words: list[np.ndarray], lengths: np.ndarray) -> np.ndarray:
        hashes = lengths.astype(np.uint64)
        with np.errstate(over="ignore"):
            for column in words:
                hashes = hashes * self._MIX + column
                hashes ^= hashes >> np.uint64(29)
        return hashes

    def lookup(self, array: bytes) -> np.ndarray | None:
        """The slots of the names of a JSON array (its bytes, `[` to `]`), in order; None
        unless every name is a known node's and the array is in the compact form."""
        rows = self.rows(array)
        return None if rows is None else self.slots[rows]

    def rows_and_slots(self, array: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, slots) of the names of a JSON array, as `rows` and `lookup` give them: by the
        native resolver where it is built (one pass in C; int32 for a list long enough to be
        walked in C, `native_walk.NATIVE_FROM`, int64 for a shorter one, which numpy walks:
        `NativeNames.resolve`), else in numpy."""
        if self.native is not None:
            return self.native.resolve(array, NATIVE_FROM)
        rows = self.numpy_rows(array)
        return None if rows is None else (rows, self.slots[rows])

    def slots_in(self, body: bytes, start: int) -> tuple[np.ndarray, int] | None:
        """(slots, end) of the names of the JSON array at `body[start]`, read in place by the
        native resolver (`NativeNames.slots_in`: no copy of the array, no search for its end;
        `end` just past its `]`); None without the library or when it cannot read it there (the
        caller cuts the array out and calls `rows_and_slots`). The slots' width as
        `rows_and_slots` gives it."""
        return None if self.native is None else self.native.slots_in(body, start, NATIVE_FROM)

    def rows(self, array: bytes) -> np.ndarray | None:
        """`lookup`, as the table's rows (`names`, `slots` by row)."""
        found = self.rows_and_slots(array)
        return None if found is None else found[0]

    def numpy_rows(self, array: bytes) -> np.ndarray | None:
        """`rows`, always in numpy (the fallback without the native library)."""
        if not self.usable or len(array) < 4 or b"\\" in array:
            return None
        raw = np.frombuffer(array, dtype=np.uint8)
        if raw[0] != 0x5B or raw[-1] != 0x5D or int(raw.min()) < 0x20:  # `[` `]`, no controls
            return None
        read = self._even(array, raw)
        if read is None:
            read = self._uneven(array, raw)
        if read is None:
            return None
        words, lengths = read
        return self._found(words, lengths)

    def _even(self, array: bytes, raw: np.ndarray) -> tuple[list[np.ndarray], Any] | None:
        """The names' words and length when every name of the array has the first one's length
        (generated node names usually do): the array is then a grid of `"name",` rows (the last
        `"name"]`), and each column of words a strided view of its bytes, read with no gather.
        None when it is not such a grid (`_uneven` reads it)."""
        first_end = array.find(b'"', 2)
        length = first_end - 2
        step = length + 3
        if raw[1] != 0x22 or length < 1 or length > self.width or (len(array) - 1) % step:
            return None
        count = (len(array) - 1) // step
        grid = np.ndarray((count, step), dtype=np.uint8, buffer=array, offset=1)
        # each row `"name",` (the last `"name"]`: its `]` is the array's, checked) and no other
        # quote anywhere: every name is `length` bytes with no quote (nor backslash, control)
        if not (bool((grid[:, 0] == 0x22).all()) and bool((grid[:, length + 1] == 0x22).all())
                and bool((grid[:-1, length + 2] == 0x2C).all())
                and int(np.count_nonzero(raw == 0x22)) == 2 * count):  # fmt: skip
            return None
        source = array if length >= 8 else array + bytes(8)
        words = []
        for column in range(self.columns):
            at = 2 + min(8 * column, length - 8) if length >= 8 else 2
            word = np.ndarray((count,), dtype=np.uint64, buffer=source, offset=at,
                              strides=(step,))  # fmt: skip
            # (a contiguous copy: the strided view is slower to compute with, and read twice)
            words.append(word & _MASKS[length] if length < 8 else np.ascontiguousarray(word))
        return words, np.int64(length)

    def _uneven(self, array: bytes, raw: np.ndarray) -> tuple[list[np.ndarray], Any] | None:
        """The names' words and lengths, each name found by its quotes."""
        quotes = np.flatnonzero(raw == 0x22)
        if len(quotes) % 2 or quotes[0] != 1 or quotes[-1] != len(raw) - 2:
            return None
        starts, ends = quotes[0::2] + 1, quotes[1::2]
        # between a name's closing quote and the next one's opening quote: exactly one `,`
        if len(starts) > 1 and not (
            bool((starts[1:] - ends[:-1] == 3).all()) and bool((raw[ends[:-1] + 1] == 0x2C).all())
        ):
            return None
        lengths = ends - starts
        if int(lengths.max()) > self.width or int(lengths.min()) < 1:
            return None
        return self._words(array, starts, lengths), lengths

    def _found(self, words: list[np.ndarray], lengths: Any) -> np.ndarray | None:
        """The rows of the names with these words and lengths (one length for all, or one
        each), None unless every one is a known name's, byte for byte: each name's bucket of
        the first level gives a row, which must hold the name's length and every word; the
        names whose row does not (~1/7 of registered names) are looked for in the next level,
        and so on. A name whose bucket is empty at some level is no registered name (each
        registered name met a taken bucket at every level before its own)."""
        hashes = self._hash(words, lengths)
        at: np.ndarray | None = None  # the names looked for at this level (None: every one)
        rows = np.empty(0, dtype=np.int64)
        one_length = isinstance(lengths, np.integer) and int(lengths) == self.one_length
        for table, mix, shift in self.levels:
            wanted = hashes if at is None else hashes[at]
            found = np.take(table, self._bucket(wanted, mix, shift)).astype(np.int64)
            if bool((found < 0).any()):
                return None  # an empty bucket met: a name the table lacks
            same = None if one_length else (np.take(self.lengths, found) == (
                lengths if at is None or not isinstance(lengths, np.ndarray) else lengths[at]))
            for known, word in zip(self.words, words, strict=True):
                equal = np.take(known, found) == (word if at is None else word[at])
                same = equal if same is None else same & equal
            assert same is not None
            if at is None:
                rows = found
                missed = np.flatnonzero(~same)
            else:
                rows[at[same]] = found[same]
                missed = at[~same]
            if not len(missed):
                return rows
            at = missed
        if self.overflow is not None and at is not None:  # (in no level: the overflow's?)
            return self._overflowed(words, lengths, hashes, rows, at)
        return None  # not in its bucket at any level


    def _overflowed(self, words: list[np.ndarray], lengths: Any, hashes: np.ndarray,
                    rows: np.ndarray, at: np.ndarray) -> np.ndarray | None:
        """`_found` for the names at `at`, which the first level does not hold: each is a
        registered name only if it is the overflow's name with its hash (no two overflow names
        share one: a registered name not in the first level is the only one with its hash
        there), byte for byte."""
        assert self.overflow is not None
        sorted_hashes, by_hash = self.overflow
        wanted = hashes[at]
        place = np.searchsorted(sorted_hashes, wanted)
        np.minimum(place, len(sorted_hashes) - 1, out=place)
        if not bool((np.take(sorted_hashes, place) == wanted).all()):
            return None  # a hash no registered name has
        found = np.take(by_hash, place)
        if not (isinstance(lengths, np.integer) and int(lengths) == self.one_length):
            wanted_lengths = lengths[at] if isinstance(lengths, np.ndarray) else lengths
            if not bool((np.take(self.lengths, found) == wanted_lengths).all()):
                return None
        for known, word in zip(self.words, words, strict=True):
            if not bool((np.take(known, found) == word[at]).all()):
                return None
        rows[at] = found
        return rows


class NameOrder:
    """kube-scheduler's node order as this table guesses it, for reading a list that is a
    contiguous run of it (issue 35) with one memcmp instead of resolving every name.

    kube-scheduler walks its nodes from `nextStartNodeIndex`, which advances every cycle, and
    stops at `numFeasibleNodesToFind`: when its own filters pass every node (the GPU resources
    are the extender's, `ignoredByScheduler`) and it checks them in order, its list is the run
    of its node order that starts there, wrapping at the end (a window; with every node scored,
    the whole order rotated). Its node order is its node tree's: in one zone, the nodes as its
    informer listed them, by name, then those added since. So the registered names, sorted, are
    serialised here as a compact JSON list twice over (`"a","b",...,"z","a",...,"z"`): every
    run of up to all the names, wrapped or not, is a slice of that text. A list whose first name
    is found (a dict of the names' bytes), whose bytes from its first `"` to its last are byte
    for byte the text from that name's opening quote on, and which ends where a name of the text
    ends, is exactly those names in that order (the text is valid compact JSON of plain names:
    no quote, backslash or control character in any, so every `"` of it bounds a name): its
    rows and slots are slices of arrays kept here, O(1) beside the memcmp. A list of a few
    such runs (the order with nodes its filters refused left out) is read run by run (`runs`).
    Anything else (a list in another order, e.g. kube-scheduler's parallel filters appending
    their workers' nodes one by one, a name not registered) returns None and is resolved name
    by name (`NameTable.rows`). Built with the table, per topology; only when every name is
    plain."""

    def __init__(self, encoded: list[bytes], slots: np.ndarray) -> None:
        order = sorted(range(len(encoded)), key=encoded.__getitem__)
        count = len(order)
        ordered = [encoded[i] for i in order]
        once = b'","'.join(ordered)
        self.text = b'"' + once + b'","' + once + b'"' if count else b""
        lengths = np.fromiter(map(len, ordered), dtype=np.int64, count=count)
        lengths = np.concatenate([lengths, lengths])
        self.starts = np.zeros(2 * count, dtype=np.int64)  # each name's opening quote
        np.cumsum(lengths[:-1] + 3, out=self.starts[1:])
        self.ends = self.starts + lengths + 2  # just past each name's closing quote
        rows = np.asarray(order, dtype=np.int64)
        self.rows = np.concatenate([rows, rows])
        self.slots = slots[self.rows]
        self.rows.setflags(write=False)  # (a run's arrays are views of these)
        self.slots.setflags(write=False)
        self.position = {name: i for i, name in enumerate(ordered)}  # by the name's bytes
        self.count = count
        # (`runs`: read one run at a time, so Python ints and a view, not numpy scalars/copies)
        self._ends = self.ends.tolist()
        self._text = memoryview(self.text)
        self._missed = 0  # lists in a row that were neither a run nor a few runs (`resting`)

    def resting(self) -> bool:
        """Whether the next list is not looked at as runs (`run`, `runs`): after `RUN_TRIES`
        lists in a row that were no runs (kube-scheduler's parallel filters: every list in a
        new interleaved order; both looks cost ~0.05 ms of a 20,000-name list for nothing),
        only every `RUN_TRIES`-th is, so lists that are runs again (its filters run one at a
        time) are found again within that many lists; those in between are resolved name by
        name, as exactly. (As `NodeNamesCache` does for rotations.)"""
        return self._missed > RUN_TRIES and self._missed % RUN_TRIES != 0

    def eager(self) -> bool:
        """Whether every list is looked at as runs (fewer than `RUN_TRIES` lists in a row were
        none): the lists after one that was, or the first ones."""
        return self._missed <= RUN_TRIES

    def looked(self, found: bool) -> None:
        """A list was looked at (or would have been, `resting`) as runs: found or not."""
        self._missed = 0 if found else self._missed + 1

    def starts_with_runs(self, body: bytes, start: int, end: int) -> bool:
        """Whether the compact array `body[start:end]` (one the native resolver proved compact)
        starts as a few runs of the order (`runs` of its names in its first ~4 KB): whether
        lists are runs again, to look at the next ones first (`looked`). Only that decision
        rests on it: a list is read as runs only by `run` / `runs` over all its bytes.

        A head whose first three names are three runs of one name each, ending before a
        quarter of it (kube-scheduler's parallel order: every list), is answered from those
        three names alone, as `runs` answers it (its third run's rate check; the
        `_three_single_runs` test), without a copy of the head or a look at its runs: 7 lists
        in 8 of that order rest (`resting`), and the eighth paid ~5 us warm, ~20 cold here."""
        whole = end - start <= _HEAD_BYTES
        cut = -1 if whole else body.rfind(b'","', start, start + _HEAD_BYTES)
        close = end - 1 - start if whole or cut < 0 else cut + 1 - start  # the head's `]`
        if self._three_single_runs(body, start, close):
            return False
        head = body[start:end] if whole or cut < 0 else body[start : cut + 1] + b"]"
        return self.runs(head) is not None

    def _three_single_runs(self, body: bytes, start: int, close: int) -> bool:
        """Whether `runs` gives None for the head (`body[start:]` with its `]` at `close`, a
        compact array proven by the native resolver) at its third run: its first three names
        registered, none the order's next after the one before it (three runs of one name;
        `runs` compares each name with the order's next, and in a compact array of plain
        names bytes equal a name's exactly when it is that name), a `,` after the third (not
        the `]`), and the rate check `runs` makes there (three runs ending before about a
        quarter of the array). False whenever that is not shown: `runs` then decides."""
        position, count = self.position, self.count
        last = -1  # the last name's position in the order
        off = start + 1  # a name's opening quote
        for _ in range(3):
            quote = body.find(b'"', off + 1, start + close)
            found = position.get(body[off + 1 : quote]) if quote > 0 else None
            if found is None or (last >= 0 and found == (last + 1) % count):
                return False
            last = found
            off = quote + 2  # (past the `,`)
        third_end = off - 1 - start  # just past the third name's closing quote, in the head
        if third_end >= close or body[off - 1] != 0x2C:
            return False  # (the head's `]` after the third name, or not compact)
        # the fourth name (in the head: a `,` precedes it) must not continue the third's run
        # (unregistered: `runs` gives None at the latest when it looks it up)
        quote = body.find(b'"', off + 1, start + close)
        if quote < 0 or position.get(body[off + 1 : quote], -1) == (last + 1) % count:
            return False
        return 2 * 3 * close > 3 * third_end * (8 + close // 16384)  # (`runs`' rate check)

    def run(self, array: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, slots) of the names of a JSON array (`[` to `]`) that is a run of the order,
        else None."""
        if len(array) < 4 or array[0] != 0x5B or array[1] != 0x22 or array[-1] != 0x5D:
            return None
        first_end = array.find(b'"', 2)
        if first_end < 0:
            return None
        at = self.position.get(array[2:first_end])
        if at is None:
            return None
        start = int(self.starts[at])
        end = start + len(array) - 2
        if not self.text.startswith(memoryview(array)[1:-1], start):
            return None
        last = int(np.searchsorted(self.ends, end))
        if last >= len(self.ends) or int(self.ends[last]) != end or last - at >= self.count:
            return None
        return self.rows[at : last + 1], self.slots[at : last + 1]

    def runs(self, array: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, slots) of the names of a JSON array (`[` to `]`) that is a few runs of the
        order one after another (a run: consecutive names of the order, wrapping at its end),
        else None. kube-scheduler's list in its node order with the nodes its own filters
        refused left out (a cordoned node, one without the CPU the pod asks: `run` fails on
        the first) is such: each gap starts a new run. A run is read with one lookup (its first
        name's bytes in `position`) and a few memcmps (the longest prefix of the array from
        there that is the order's text from that name on: the whole rest tried first, then
        galloping), so a 20,000-name list with a few gaps costs a few dozen operations, not a
        lookup per name (`NameTable.rows`).

        Exact as `run` is: every byte of the array is `[`, `]`, a `,` checked between two runs,
        or inside a run compared equal to the text, which is compact JSON of plain names (every
        `"` of it bounds a whole name), so the array is those runs' names in that order, each
        name byte for byte a registered one; duplicates (a name in two runs) resolve as
        `NameTable.rows` resolves them. A run costs ~10 µs (a lookup, ~2 log2(its names)
        memcmps), `NameTable.rows` ~20-40 ns a name: more runs than 8 + one per 16 KB of the
        array (20,000 names: 24) return None, and so do, from the third run on, runs that at
        their rate over the array's bytes would make 1.5 times that. So a list in
        kube-scheduler's parallel order (its workers' nodes appended one by one as each passes:
        runs of ~1 name) is given up after 3 runs, a few µs."""
        close = len(array) - 1  # the `]`
        count = self.count
        if close < 3 or not count or array[0] != 0x5B or array[1] != 0x22 or array[close] != 0x5D:
            return None
        ends, text, position = self._ends, self._text, self.position
        found: list[tuple[int, int]] = []  # (the run's first position, its names)
        most_runs = 8 + close // 16384  # (~1,000 names of 10-13 bytes a run above 8)
        names = 0
        off = 1  # the run's opening quote
        while True:
            quote = array.find(b'"', off + 1)
            at = position.get(array[off + 1 : quote]) if quote > 0 else None
            if at is None:
                return None
            start = ends[at] - (quote + 1 - off)  # its opening quote in the text
            # the most names from `at` whose bytes fit before the `]` (at most every name)
            most = bisect_right(ends, start + close - off, at, at + count) - at
            good = most  # names from `at` equal to the array from `off` (the first: looked up)
            if most > 1 and not array.startswith(text[start : ends[at + most - 1]], off):
                # galloping, then halving: `good` names equal, `bad` names not; each memcmp
                # compares only the names between the two (a run's bytes about thrice in all)
                good, bad, k = 1, most, 2
                while k < bad:
                    if array.startswith(text[ends[at + good - 1] : ends[at + k - 1]],
                                        off + ends[at + good - 1] - start):  # fmt: skip
                        good, k = k, 2 * k
                    else:
                        bad = k
                while bad - good > 1:
                    mid = (good + bad) // 2
                    if array.startswith(text[ends[at + good - 1] : ends[at + mid - 1]],
                                        off + ends[at + good - 1] - start):  # fmt: skip
                        good = mid
                    else:
                        bad = mid
            found.append((at, good))
            names += good
            end = off + ends[at + good - 1] - start  # just past the run's last name
            if end == close:
                break
            if array[end] != 0x2C:
                return None  # not `,` between two names
            runs = len(found)
            if runs > most_runs or (runs > 2 and 2 * runs * close > 3 * end * most_runs):
                return None  # too many runs (or 1.5x too many ahead at this rate): docstring
            off = end + 1
            if array[off] != 0x22:
                return None
        if len(found) == 1:
            at, good = found[0]
            return self.rows[at : at + good], self.slots[at : at + good]
        return (np.concatenate([self.rows[at : at + good] for at, good in found]),
                np.concatenate([self.slots[at : at + good] for at, good in found]))  # fmt: skip
