"""kube-scheduler's candidate list, parsed once per distinct list.

With `nodeCacheCapable` every filter call carries every candidate node's name (260 KB at 20,000
nodes), and the list rarely changes between calls. Parsing it, checking it and hashing it to find
its slots in the index cost more than the placement itself. So the `nodenames` array's bytes are
compared (memcmp) with the arrays of recent calls; on a match the list parsed and checked then is
reused, and only the rest of the body (the pod) is parsed. The list carries a token the index
caches its slots under (`ClusterIndex.resolve`).

Exactness: the array is cut out of the body up to its first `]`. A previously parsed array is a
complete JSON array, so when those bytes start at the `nodenames` value they are that whole
value. (A new array read in place by the native resolver, `NodeNamesCache._in_place`, is not
cut: the resolver proves where its compact form ends.) The rest of the body, with a placeholder
string in place of the array, must parse as a
JSON object whose `nodenames` key holds the placeholder, and the placeholder must occur in it
exactly once; anything else falls back to parsing the whole body, as before. When the body is
ExtenderArgs as kube-scheduler writes it (`{"Pod":...,"Nodes":null,"NodeNames":[...]}`: its Go
struct has no JSON tags) the pod is decoded where it lies instead, with no copy (`_pod_around`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np

_KEY = b'"nodenames"'
_KEY_TAIL = _KEY[6:]  # `ames"`: looked for, then the key before it compared lower-cased
_PLACEHOLDER = "\\u0000tessera-nodenames"
_PLACEHOLDER_JSON = b'"' + _PLACEHOLDER.encode() + b'"'
_PLACEHOLDER_VALUE = json.loads(_PLACEHOLDER_JSON)
_WS = b" \t\r\n"
_MIN_BYTES = 4096  # shorter lists are cheap to parse; not worth remembering
_REMEMBERED = 4
_ROTATION_TRIES = 8  # new arrays in a row that were no rotation before one in 8 is looked at
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
    # (names by table row, table row by slot, slots): unfilled, its rows not gathered either
    _by_slot: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    compact: bool = False  # its array was read as `["a","b"]` with no escape (`_rotated`)

    @classmethod
    def of_rows(cls, names: np.ndarray, rows: np.ndarray) -> NodeNames:
        """The names `names[rows]`, gathered when first read."""
        made = cls()
        made._source = (names, rows)
        return made

    @classmethod
    def of_slots(cls, names: np.ndarray, row_of_slot: np.ndarray, slots: np.ndarray) -> NodeNames:
        """The names `names[row_of_slot[slots]]`, gathered when first read (a list read from
        its bytes by slot only: `NameTable.slots_in`)."""
        made = cls()
        made._by_slot = (names, row_of_slot, slots)
        return made

    def rotated(self, shift: int) -> NodeNames:
        """The same names from the `shift`-th on, then those before it (its slots rolled too,
        at the same topology version)."""
        if self._by_slot is not None:
            names, of_slot, slots = self._by_slot
            made = NodeNames.of_slots(names, of_slot, np.roll(slots, -shift))
        elif self._source is not None:
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
        by_slot = self._by_slot
        if by_slot is not None:
            self._by_slot = None
            list.extend(self, by_slot[0][by_slot[1][by_slot[2]]].tolist())
        return self

    def __len__(self) -> int:
        source = self._source
        if source is not None:
            return len(source[1])
        by_slot = self._by_slot
        return len(by_slot[2]) if by_slot is not None else list.__len__(self)

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
# `ClusterIndex.names_in_body`: the array at the body's offset read in place: (the names,
# (topology version, their slots), where the array ends) or None
InPlace = Callable[[bytes, int], "tuple[NodeNames, tuple[int, np.ndarray], int] | None"]


def _skip_back(body: bytes, at: int) -> int:
    """The index of the last byte before `at` that is not JSON whitespace (-1: none)."""
    at -= 1
    while at >= 0 and body[at] in _WS:
        at -= 1
    return at


_POD_KEYS = (b'"pod"', b'"Pod"')  # (kube-scheduler's ExtenderArgs has no JSON tags: "Pod")
_NODES_KEYS = (b'"nodes"', b'"Nodes"')
_NULL = b"null"


def _pod_around(body: bytes, start: int, end: int) -> dict[str, Any] | None:
    """The body's members other than `nodenames` (lower-cased, in order), decoded from the
    body where they lie, when the body is ExtenderArgs as kube-scheduler writes it:
    `{"Pod":<pod>,"Nodes":null,"NodeNames":[...]}` (or with `pod`, `nodes`, any whitespace,
    `Nodes` left out) with the array at `start:end`; None for any other body (`parse` then
    decodes it with the array cut out, as before).

    Exact: the bytes from `{` to the pod value's start and from its end to the array are
    checked to be exactly those members' keys, colons, commas and whitespace (and `null`), the
    array ends the object, and the pod's bytes must decode as one JSON value (msgspec refuses
    trailing bytes): so the body is that object, whose decoding is these members and the array.
    A pod msgspec refuses (NaN, 1e400, lone surrogates, depth) goes the old way, to json."""
    close = end
    n = len(body)
    while close < n and body[close] in _WS:
        close += 1
    if close >= n or body[close] != 0x7D:  # `}`: the array must be the last member
        return None
    close += 1
    while close < n and body[close] in _WS:
        close += 1
    if close != n:
        return None
    at = _skip_back(body, start)  # the `:` after the array's key
    if at < 0 or body[at] != 0x3A:
        return None
    at = _skip_back(body, at)  # the key's closing quote
    if at < 10 or body[at - 10 : at + 1].lower() != b'"nodenames"':
        return None
    at = _skip_back(body, at - 10)  # the comma before the array's key
    if at < 0 or body[at] != 0x2C:
        return None
    pod_end = _skip_back(body, at) + 1
    nodes = False
    if body.endswith(_NULL, 0, pod_end):  # `"Nodes": null,` before it?
        colon = _skip_back(body, pod_end - 4)
        if colon >= 0 and body[colon] == 0x3A:
            quote = _skip_back(body, colon)
            if quote >= 6 and body[quote - 6 : quote + 1] in _NODES_KEYS:
                comma = _skip_back(body, quote - 6)
                if comma >= 0 and body[comma] == 0x2C:
                    nodes = True
                    pod_end = _skip_back(body, comma) + 1
    at = 0
    while at < n and body[at] in _WS:
        at += 1
    if at >= n or body[at] != 0x7B:  # `{`
        return None
    at += 1
    while at < n and body[at] in _WS:
        at += 1
    if body[at : at + 5] not in _POD_KEYS:
        return None
    at += 5
    while at < n and body[at] in _WS:
        at += 1
    if at >= n or body[at] != 0x3A:
        return None
    at += 1
    while at < n and body[at] in _WS:
        at += 1
    if at >= pod_end:
        return None
    try:
        pod = _decode(memoryview(body)[at:pod_end])
    except (msgspec.MsgspecError, RecursionError):
        return None
    return {"pod": pod, "nodes": None} if nodes else {"pod": pod}


class NodeNamesCache:
    def __init__(
        self, max_names: int, remembered: int = _REMEMBERED, resolver: Resolver | None = None,
        resolve_from: int = _RESOLVE_FROM, runs: Resolver | None = None,
        in_place: InPlace | None = None,
    ) -> None:
        """`resolver` (`ClusterIndex.names_from_bytes`): any new array it can read; `runs`
        (`ClusterIndex.names_of_run`): a new array that is a run of the node order, tried
        first (cheaper than `_rotated`, which looks for the array in the remembered ones);
        `in_place` (`ClusterIndex.names_in_body`): a new array read where it lies in the body
        once lists are no longer looked at first as runs or rotations (`_in_place`)."""
        self.max_names = max_names
        self.remembered = remembered
        self.resolver = resolver
        self.runs = runs
        self.in_place = in_place
        self.resolve_from = resolve_from  # arrays from this many bytes go to the resolver
        # (bytes, start, end, names): remembered arrays, each `bytes[start:end]` (a body's
        # array read in place is kept as the body and its bounds: never copied)
        self._recent: list[tuple[bytes, int, int, NodeNames]] = []
        self._not_rotated = 0  # new arrays since the last one read as a rotation

    def parse(self, body: bytes) -> dict[str, Any] | None:
        """The body as a JSON object with lower-cased keys and `nodenames` a NodeNames, or
        None when the fast path does not apply (the caller parses the whole body)."""
        start = self._start(body)
        if start is None:
            return None
        found = self._lookup(body, start)
        if found is None and self.in_place is not None:
            found = self._in_place(body, start)
        if found is None:
            end = body.find(b"]", start)
            if end < 0 or end + 1 - start < _MIN_BYTES:
                return None
            end += 1
            array = body[start:end]
            known = self._run(array) if self.runs is not None else None
            if known is None:
                known = self._rotation(array)
            if known is None:
                known = self._learn(array)
            if known is None:
                return None
        else:
            known, end = found
        members = _pod_around(body, start, end)
        if members is not None:
            members["nodenames"] = known
            return members
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
        """Where the array after the first `"nodenames":` starts (its `[`), the key in any case
        whose last letters are lower-case (kube-scheduler's `"NodeNames"`, kube-sim's
        `"nodenames"`). (The first such, not the last: kube-scheduler writes the pod first and
        the list after it, and a search from the end walks back through the whole list. Which
        occurrence is cut does not matter for exactness: the rest must parse with the
        placeholder as the top-level `nodenames`, its key lower-cased.)"""
        at = body.find(_KEY_TAIL)
        n = len(body)
        while at >= 0:
            i = at + len(_KEY_TAIL)
            if at < 6 or body[at - 6 : i].lower() != _KEY:
                at = body.find(_KEY_TAIL, at + 1)
                continue
            while i < n and body[i] in _WS:
                i += 1
            if i < n and body[i] == ord(":"):
                i += 1
                while i < n and body[i] in _WS:
                    i += 1
                if i < n and body[i] == ord("["):
                    return i
            at = body.find(_KEY_TAIL, at + 1)
        return None

    def _lookup(self, body: bytes, start: int) -> tuple[NodeNames, int] | None:
        """A remembered array whose bytes the body holds at `start` (compared in place), and
        where it ends. A remembered array is a whole JSON array (cut up to the first `]` and
        parsed, or proven compact by the resolver in place), so a match is that whole value."""
        for i, (buffer, at, end, names) in enumerate(self._recent):
            if body.startswith(memoryview(buffer)[at:end], start):
                if i:
                    self._recent.insert(0, self._recent.pop(i))
                return names, start + end - at
        return None

    def _in_place(self, body: bytes, start: int) -> tuple[NodeNames, int] | None:
        """A new array read where it lies in the body (`in_place`: the native resolver, no
        copy of the array, no search for its end: kube-scheduler's parallel filters send every
        list in a new order), and where it ends; None while every list is looked at as a
        rotation (the first `_ROTATION_TRIES` after one was, `_rotation`) or as runs of the node
        order (`NameOrder.eager`), for an array under `_MIN_BYTES`, and where the resolver
        cannot read it: the array is then cut out and read as before. A list due a rotation
        look (one in `_ROTATION_TRIES`) is looked at once read (a rotation found: that one is
        used, the same names, and the next lists are looked at first again). Exact: the
        resolver proves the bytes from `start` to `end` a compact JSON array (`["a","b"]`,
        every name byte for byte a registered one, which holds no `"` or backslash): that
        array is the `nodenames` value there, whatever follows it."""
        if len(body) - start < _MIN_BYTES or self._not_rotated < _ROTATION_TRIES:
            return None
        found = self.in_place(body, start) if self.in_place is not None else None
        if found is None:
            return None
        known, resolved, end = found
        if end - start < _MIN_BYTES or len(known) > self.max_names:
            return None
        if self._rotation_looks():
            rotated = self._rotated(body, start, end)  # (remembered when found; in place)
            if rotated is not None:
                self._not_rotated = 0
                return rotated, end
        self._not_rotated += 1
        known.resolved = resolved
        known.compact = True
        known.token = next(_tokens)
        self._recent.insert(0, (body, start, end, known))
        del self._recent[self.remembered :]
        return known, end

    def _rotation_looks(self) -> bool:
        """Whether `_rotation` looks at the next new array."""
        tried = self._not_rotated + 1
        return tried <= _ROTATION_TRIES or tried % _ROTATION_TRIES == 0

    def _rotation(self, array: bytes) -> NodeNames | None:
        """`_rotated`, looked for in every new array until `_ROTATION_TRIES` in a row were no
        rotation, then in every `_ROTATION_TRIES`-th: kube-scheduler's parallel filters (16
        workers on a many-core host) send every list in a new order, which no look finds, and
        a look costs a search through the remembered array (~0.06 ms at 20,000 names); lists
        that are rotations (its filters run one at a time) are found again within that many
        lists, the ones in between resolved name by name (`_learn`), as exactly."""
        looks = self._rotation_looks()
        self._not_rotated += 1
        if not looks:
            return None
        found = self._rotated(array)
        if found is not None:
            self._not_rotated = 0
        return found

    def _rotated(self, data: bytes, start: int = 0, end: int | None = None) -> NodeNames | None:
        """The list when its array is a rotation of a remembered one (kube-scheduler with every
        node feasible and scored walks its node list from a start index that advances every
        cycle: the same names, another first one), read with a few memchr/memcmp passes and an
        np.roll instead of resolving every name again (20,000 names: ~0.1 ms instead of ~0.8).

        Exact: a remembered array is a compact JSON array (`["a","b"]`, what `NameTable` reads;
        no backslash, so every `"` bounds a name) with no `]` before its end. The new array's
        first name is found in it as `,"name",` (or `,"name"]`: the last), which can only be a
        whole name there; the new array must then be byte for byte the remembered one's names
        from there to the end, a comma, and those before it.

        The new array is `data[start:end]` (a body's, compared where it lies: no copy)."""
        stop = len(data) if end is None else end
        length = stop - start
        first_end = data.find(b'"', start + 2, stop)
        if length < 4 or data[start + 1] != 0x22 or first_end < 0:
            return None
        name = data[start + 1 : first_end + 1]  # `"name"`
        for buffer, at, until, names in self._recent:
            size = until - at  # (the remembered array: `buffer[at:until]`)
            if size != length or not names.compact:
                continue
            # (only the latest such array: each look costs a search through it, and a list
            # in another order every call, kube-scheduler's parallel filters', matches none)
            comma = buffer.find(b"," + name + b",", at, until) - at
            if comma < 0:
                comma = size - len(name) - 2
                if comma < 0 or not buffer.endswith(b"," + name + b"]", at, until):
                    return None
            tail = size - 1 - (comma + 1)  # bytes of the names from `name` on
            view = memoryview(buffer)[at:until]  # (compared in place, not copied)
            if not (data.startswith(view[comma + 1 : -1], start + 1)
                    and data[start + 1 + tail] == 0x2C
                    and data.startswith(view[1:comma], start + 2 + tail)):  # fmt: skip
                return None
            shift = buffer.count(b'","', at, at + comma + 2)  # names before `name`
            rotated = names.rotated(shift)
            rotated.token = next(_tokens)
            self._recent.insert(0, (data, start, stop, rotated))
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
        self._recent.insert(0, (array, 0, len(array), known))
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
        self._recent.insert(0, (array, 0, len(array), known))
        del self._recent[self.remembered :]
        return known
