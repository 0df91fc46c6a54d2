"""kube-scheduler's candidate list, parsed once per distinct list.

With `nodeCacheCapable` every filter call carries every candidate node's name (260 KB at 20,000
nodes), and the list rarely changes between calls. Parsing it, checking it and hashing it to find
its slots in the index cost more than the placement itself. So the `nodenames` array's bytes are
compared (memcmp) with the arrays of recent calls; on a match the list parsed and checked then is
reused, and only the rest of the body (the pod) is parsed. The list carries a token the index
caches its slots under (`ClusterIndex.resolve`).

Exactness: the array is cut out of the body up to its first `]`. A previously parsed array is a
complete JSON array, so when those bytes start at the `nodenames` value they are that whole
value. The rest of the body, with a placeholder string in place of the array, must parse as a
JSON object whose `nodenames` key holds the placeholder, and the placeholder must occur in it
exactly once; anything else falls back to parsing the whole body, as before.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np

_KEY = b'"nodenames"'
_PLACEHOLDER = "\\u0000tessera-nodenames"
_PLACEHOLDER_JSON = b'"' + _PLACEHOLDER.encode() + b'"'
_PLACEHOLDER_VALUE = json.loads(_PLACEHOLDER_JSON)
_WS = b" \t\r\n"
_MIN_BYTES = 4096  # shorter lists are cheap to parse; not worth remembering
_REMEMBERED = 4
_tokens = itertools.count(1)
# The rest of the body (the pod): msgspec's JSON decoder gives the values `json.loads` gives for
# whatever it accepts (tests/scheduler/test_node_names.py); what it refuses goes to json.loads.
_decode = msgspec.json.Decoder().decode
# A new array this long or longer is resolved from its bytes (NameTable). Every remembered
# array is (`_MIN_BYTES` and up): its parse costs more than decoding (500 names 0.28 vs 0.08
# ms), but the decision then looks no name up, and parse + decision is cheaper at 500, 5,000
# and 20,000 names (bench/RESULTS.md, "scheduler as kube-scheduler calls it").
_RESOLVE_FROM = 0


class NodeNames(list[str]):
    """A candidate list already checked (strings, within the limit). `token` names its content:
    two lists with one token have the same names in the same order.

    Read-only: one instance is handed to every call with that list (a copy per call of 5,000 to
    20,000 names cost more than the copy is worth, most of it in the cyclic GC walking the
    copies of the calls in flight); whoever needs a changed list builds a new one.

    A list resolved from its bytes (`NameTable`) holds no strings until something reads them
    (`of_rows`): a placed pod's call needs only the slots, and gathering 20,000 of the index's
    strings into a list costs 1-3 ms on a large heap (an incref per string, each a cache miss).
    Every read method fills it first (from the table's own snapshot of the names, which never
    changes); `len` needs no filling. Do not hand an unfilled one to C code that reads a list's
    storage directly (`json.dumps`, `str.join`): use `list(names)`, as the filter does."""

    token: int = 0
    # (topology version, slots): resolved from the bytes by the index's `NameTable` when the
    # list was parsed; the index uses them while its topology is that version
    resolved: tuple[int, np.ndarray] | None = None
    _source: tuple[np.ndarray, np.ndarray] | None = None  # (names by table row, rows): unfilled
    compact: bool = False  # its array was read as `["a","b"]` with no escape (`_rotated`)

    @classmethod
    def of_rows(cls, names: np.ndarray, rows: np.ndarray) -> NodeNames:
        """The names `names[rows]`, gathered when first read."""
        made = cls()
        made._source = (names, rows)
        return made

    def rotated(self, shift: int) -> NodeNames:
        """The same names from the `shift`-th on, then those before it (its slots rolled too,
        at the same topology version)."""
        if self._source is not None:
            names, rows = self._source
            made = NodeNames.of_rows(names, np.roll(rows, -shift))
        else:
            made = NodeNames(list.__getitem__(self, slice(shift, None))
                             + list.__getitem__(self, slice(None, shift)))  # fmt: skip
        if self.resolved is not None:
            made.resolved = (self.resolved[0], np.roll(self.resolved[1], -shift))
        made.compact = self.compact
        return made

    def _filled(self) -> NodeNames:
        source = self._source
        if source is not None:
            self._source = None
            list.extend(self, source[0][source[1]].tolist())
        return self

    def __len__(self) -> int:
        source = self._source
        return len(source[1]) if source is not None else list.__len__(self)

    def __iter__(self) -> Iterator[str]:
        return list.__iter__(self._filled())

    def __reversed__(self) -> Iterator[str]:
        return list.__reversed__(self._filled())

    def __getitem__(self, index: Any) -> Any:
        return list.__getitem__(self._filled(), index)

    def __contains__(self, name: object) -> bool:
        return list.__contains__(self._filled(), name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NodeNames):
            other._filled()
        return list.__eq__(self._filled(), other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return list.__repr__(self._filled())

    def __add__(self, other: Any) -> list[str]:  # type: ignore[override]
        return list(self) + list(other)

    def __radd__(self, other: Any) -> list[str]:
        return list(other) + list(self)

    def __mul__(self, times: Any) -> list[str]:  # type: ignore[override]
        return list(self) * times

    __rmul__ = __mul__  # type: ignore[assignment]

    def copy(self) -> list[str]:
        return list(self)

    def index(self, *args: Any) -> int:
        return list.index(self._filled(), *args)

    def count(self, name: Any) -> int:
        return list.count(self._filled(), name)

    def _read_only(self, *_args: object, **_kwargs: object) -> None:
        raise TypeError("NodeNames is shared between calls: build a new list instead")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only  # type: ignore[assignment]
    append = extend = insert = pop = remove = _read_only  # type: ignore[assignment]
    clear = sort = reverse = _read_only  # type: ignore[assignment]


# `ClusterIndex.names_from_bytes`: (the names, (topology version, their slots)) or None
Resolver = Callable[[bytes], "tuple[list[str], tuple[int, np.ndarray]] | None"]


class NodeNamesCache:
    def __init__(
        self, max_names: int, remembered: int = _REMEMBERED, resolver: Resolver | None = None,
        resolve_from: int = _RESOLVE_FROM, runs: Resolver | None = None,
    ) -> None:
        """`resolver` (`ClusterIndex.names_from_bytes`): any new array it can read; `runs`
        (`ClusterIndex.names_of_run`): a new array that is a run of the node order, tried
        first (cheaper than `_rotated`, which looks for the array in the remembered ones)."""
        self.max_names = max_names
        self.remembered = remembered
        self.resolver = resolver
        self.runs = runs
        self.resolve_from = resolve_from  # arrays from this many bytes go to the resolver
        self._recent: list[tuple[bytes, NodeNames]] = []  # (array bytes, names)

    def parse(self, body: bytes) -> dict[str, Any] | None:
        """The body as a JSON object with lower-cased keys and `nodenames` a NodeNames, or
        None when the fast path does not apply (the caller parses the whole body)."""
        start = self._start(body)
        if start is None:
            return None
        found = self._lookup(body, start)
        if found is None:
            end = body.find(b"]", start)
            if end < 0 or end + 1 - start < _MIN_BYTES:
                return None
            end += 1
            array = body[start:end]
            known = self._run(array) if self.runs is not None else None
            if known is None:
                known = self._rotated(array)
            if known is None:
                known = self._learn(array)
            if known is None:
                return None
        else:
            known, end = found
        rest = body[:start] + _PLACEHOLDER_JSON + body[end:]
        if rest.count(_PLACEHOLDER_JSON) != 1:
            return None
        try:
            data = _decode(rest)  # (a real pod's JSON is a few kB: ~4x faster than json)
        except (msgspec.MsgspecError, RecursionError):  # NaN, 1e400, lone surrogates, depth
            try:
                data = json.loads(rest)  # is json's to read, as the whole body would be
            except (ValueError, RecursionError):
                return None
        if not isinstance(data, dict):
            return None
        lowered = {str(k).lower(): v for k, v in data.items()}
        if lowered.get("nodenames") != _PLACEHOLDER_VALUE:
            return None
        lowered["nodenames"] = known
        return lowered

    @staticmethod
    def _start(body: bytes) -> int | None:
        """Where the array after the first `"nodenames":` starts (its `[`). (The first such,
        not the last: kube-scheduler writes the pod first and the list after it, and a search
        from the end walks back through the whole list. Which occurrence is cut does not matter
        for exactness: the rest must parse with the placeholder as the top-level `nodenames`.)"""
        at = body.find(_KEY)
        n = len(body)
        while at >= 0:
            i = at + len(_KEY)
            while i < n and body[i] in _WS:
                i += 1
            if i < n and body[i] == ord(":"):
                i += 1
                while i < n and body[i] in _WS:
                    i += 1
                if i < n and body[i] == ord("["):
                    return i
            at = body.find(_KEY, at + 1)
        return None

    def _lookup(self, body: bytes, start: int) -> tuple[NodeNames, int] | None:
        """A remembered array whose bytes the body holds at `start` (compared in place), and
        where it ends. A remembered array is a whole JSON array holding no `]` but its last
        byte, so a match is exactly the cut up to the first `]`."""
        for i, (known, names) in enumerate(self._recent):
            if body.startswith(known, start):
                if i:
                    self._recent.insert(0, self._recent.pop(i))
                return names, start + len(known)
        return None

    def _rotated(self, array: bytes) -> NodeNames | None:
        """The list when its array is a rotation of a remembered one (kube-scheduler with every
        node feasible and scored walks its node list from a start index that advances every
        cycle: the same names, another first one), read with a few memchr/memcmp passes and an
        np.roll instead of resolving every name again (20,000 names: ~0.1 ms instead of ~0.8).

        Exact: a remembered array is a compact JSON array (`["a","b"]`, what `NameTable` reads;
        no backslash, so every `"` bounds a name) with no `]` before its end. The new array's
        first name is found in it as `,"name",` (or `,"name"]`: the last), which can only be a
        whole name there; the new array must then be byte for byte the remembered one's names
        from there to the end, a comma, and those before it."""
        first_end = array.find(b'"', 2)
        if len(array) < 4 or array[1] != 0x22 or first_end < 0:
            return None
        name = array[1 : first_end + 1]  # `"name"`
        for known, names in self._recent:
            if len(known) != len(array) or not names.compact:
                continue
            # (only the latest such array: each look costs a search through it, and a list
            # in another order every call, kube-scheduler's parallel filters', matches none)
            comma = known.find(b"," + name + b",")
            if comma < 0:
                comma = len(known) - len(name) - 2
                if comma < 0 or not known.endswith(b"," + name + b"]"):
                    return None
            tail = len(known) - 1 - (comma + 1)  # bytes of the names from `name` on
            view = memoryview(known)  # (compared in place, not copied)
            if not (array.startswith(view[comma + 1 : -1], 1)
                    and array[1 + tail] == 0x2C
                    and array.startswith(view[1:comma], 2 + tail)):  # fmt: skip
                return None
            shift = known.count(b'","', 0, comma + 2)  # names before `name`
            rotated = names.rotated(shift)
            rotated.token = next(_tokens)
            self._recent.insert(0, (array, rotated))
            del self._recent[self.remembered :]
            return rotated
        return None

    def _run(self, array: bytes) -> NodeNames | None:
        """The list when its array is a run of the node order (`runs`), remembered."""
        found = self.runs(array) if self.runs is not None else None
        if found is None or len(found[0]) > self.max_names:
            return None
        known = found[0]
        if not isinstance(known, NodeNames):
            known = NodeNames(known)
        known.resolved = found[1]
        known.compact = True  # (a run of a compact text: no backslash)
        known.token = next(_tokens)
        self._recent.insert(0, (array, known))
        del self._recent[self.remembered :]
        return known

    def _learn(self, array: bytes) -> NodeNames | None:
        found = None
        if self.resolver is not None and len(array) >= self.resolve_from:
            found = self.resolver(array)
        resolved = None
        known: NodeNames | None = None
        if found is not None and len(found[0]) <= self.max_names:
            names, resolved = found  # every name a registered node's, read from the bytes
            if isinstance(names, NodeNames):
                known = names  # (its strings gathered when first read)
        else:
            try:
                names = json.loads(array)
            except (ValueError, RecursionError):
                return None  # e.g. a `]` inside a name: the cut was not the whole array
            if not isinstance(names, list) or len(names) > self.max_names:
                return None
            if not all(type(name) is str for name in names):
                return None
        if known is None:
            known = NodeNames(names)
        known.resolved = resolved
        known.compact = resolved is not None and b"\\" not in array
        known.token = next(_tokens)
        self._recent.insert(0, (array, known))
        del self._recent[self.remembered :]
        return known


_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*\Z')  # a name JSON writes as it is, between quotes
# _MASKS[k]: the low k bytes of a little-endian uint64 word (a name shorter than 8 bytes)
_PROBES = 16  # buckets read at once for a name not in its own
_TAG = np.uint64(33)  # a name's tag in the table: 31 bits (`NameTable._tag`)
_ROW = np.uint64(0xFFFF_FFFF)
_EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)  # (a tag part of 32 ones: no tag has it)
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
    (vectorised) into an open-addressing table (a power of two at least 6× the names, linear
    probing) whose entries are a 31-bit tag of the hash and the row: a list is looked up with
    the same operations over all its names at once (`_found`: the tag at the name's bucket, the
    names whose bucket holds another tag looked for in the next 16 at once), and the row found
    must hold the name's length and every word, so a name resolves only to the node whose name
    is byte for byte the same (the hash only finds where to compare). What the fast path cannot
    prove it reads exactly (escapes, control characters, spacing other than kube-scheduler's
    compact `["a","b"]`, a name longer than the widest known one, any unknown name) returns
    None: the caller decodes the list as before. Built per topology
    (`ClusterIndex.name_table`), with the node order's serialisation (`NameOrder`); tests:
    `tests/scheduler/test_node_names.py`. (Sorted hashes binary-searched, masked words: 1.3 ms
    for 20,000 names; the table 4× the names probed a round at a time over every name: ~1.3
    ms for 20,000 equal-length names in a new order at load 15; this ~0.9, 1,000 names ~0.1.)"""

    _MIX = np.uint64(0x9E3779B97F4A7C15)
    _TAG_MIX = np.uint64(0xC2B2AE3D27D4EB4F)

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
        self.lengths = lengths
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
        hashes = self._hash(self.words, lengths)
        size = 16
        while size < 6 * len(hashes):
            size *= 2
        self.shift = np.uint64(64 - (size.bit_length() - 1))  # the bucket: the top bits
        # bucket -> the name there: its tag (the hash's top 31 bits) << 32 | its row; _EMPTY
        # (whose tag part no name has) where none
        self.table = np.full(size, _EMPTY, dtype=np.uint64)
        pending = np.arange(len(hashes), dtype=np.int64)
        buckets = self._bucket(hashes)
        while len(pending):  # linear probing, vectorised: one name per free bucket per round
            free = self.table[buckets] == _EMPTY
            first = np.unique(buckets[free], return_index=True)[1]
            placed = np.flatnonzero(free)[first]
            self.table[buckets[placed]] = (self._tag(hashes[pending[placed]]) << np.uint64(32)
                                           | pending[placed].astype(np.uint64))  # fmt: skip
            left = np.ones(len(pending), dtype=bool)
            left[placed] = False
            pending, buckets = pending[left], (buckets[left] + 1) & (size - 1)
        # two names whose tags meet on one's probe path would find the wrong row (and step
        # aside to the decoder) every time: not worth telling apart here (rare: 31-bit tags)
        if self.usable and len(names) > 1:
            found = self._found(self.words, lengths)
            if found is None or not bool((found == np.arange(len(names))).all()):
                self.usable = False

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

    def _bucket(self, hashes: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((hashes * self._MIX) >> self.shift).astype(np.int64)

    def _tag(self, hashes: np.ndarray) -> np.ndarray:
        """31 bits of the hash for the table's entries, mixed apart from the bucket's."""
        with np.errstate(over="ignore"):
            return (hashes * self._TAG_MIX) >> _TAG

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

    def rows(self, array: bytes) -> np.ndarray | None:
        """`lookup`, as the table's rows (`names`, `slots` by row)."""
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
        each), None unless every one is a known name's, byte for byte: a name's tag is looked
        for from its bucket on (linear probing) and the row it leads to must hold its length
        and every word."""
        hashes = self._hash(words, lengths)
        buckets = self._bucket(hashes)
        tags = self._tag(hashes)
        table = self.table
        held = np.take(table, buckets)
        at = np.flatnonzero((held >> np.uint64(32)) != tags)  # (a sixth at a third full)
        if len(at):  # probed on, these only, the next `_PROBES` buckets of each at once
            if bool((np.take(held, at) == _EMPTY).any()):
                return None  # an empty bucket met: a name the table lacks
            size_mask = len(table) - 1
            home, wanted = buckets[at][:, None], tags[at][:, None]
            for first in range(1, len(table), _PROBES):
                seen = np.take(table, (home + np.arange(first, first + _PROBES)) & size_mask)
                hit = (seen >> np.uint64(32)) == wanted
                found = hit.any(axis=1)
                held[at[found]] = seen[found, hit[found].argmax(axis=1)]
                if bool(found.all()):
                    break
                missed = ~found
                if bool((seen[missed] == _EMPTY).any()):
                    return None  # (a name in the table is met before any empty bucket)
                at, home, wanted = at[missed], home[missed], wanted[missed]
        rows = (held & _ROW).astype(np.int64)
        if not bool((np.take(self.lengths, rows) == lengths).all()):
            return None
        for known, word in zip(self.words, words, strict=True):
            if not bool((np.take(known, rows) == word).all()):
                return None
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
    rows and slots are slices of arrays kept here, O(1) beside the memcmp. Anything else (a
    list in another order, e.g. kube-scheduler's parallel filters finishing out of order, a
    node its filters refused, a name not registered) returns None and is resolved name by name
    (`NameTable.rows`). Built with the table, per topology; only when every name is plain."""

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
