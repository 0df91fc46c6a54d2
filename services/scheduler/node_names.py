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
from collections.abc import Callable
from typing import Any

import numpy as np

_KEY = b'"nodenames"'
_PLACEHOLDER = "\\u0000tessera-nodenames"
_PLACEHOLDER_JSON = b'"' + _PLACEHOLDER.encode() + b'"'
_PLACEHOLDER_VALUE = json.loads(_PLACEHOLDER_JSON)
_WS = b" \t\r\n"
_MIN_BYTES = 4096  # shorter lists are cheap to parse; not worth remembering
_REMEMBERED = 4
_tokens = itertools.count(1)
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
    copies of the calls in flight); whoever needs a changed list builds a new one."""

    token: int = 0
    # (topology version, slots): resolved from the bytes by the index's `NameTable` when the
    # list was parsed; the index uses them while its topology is that version
    resolved: tuple[int, np.ndarray] | None = None

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
        resolve_from: int = _RESOLVE_FROM,
    ) -> None:
        self.max_names = max_names
        self.remembered = remembered
        self.resolver = resolver
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
            known = self._learn(body[start:end])
            if known is None:
                return None
        else:
            known, end = found
        rest = body[:start] + _PLACEHOLDER_JSON + body[end:]
        if rest.count(_PLACEHOLDER_JSON) != 1:
            return None
        try:
            data = json.loads(rest)
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

    def _learn(self, array: bytes) -> NodeNames | None:
        found = None
        if self.resolver is not None and len(array) >= self.resolve_from:
            found = self.resolver(array)
        resolved = None
        if found is not None and len(found[0]) <= self.max_names:
            names, resolved = found  # every name a registered node's, read from the bytes
        else:
            try:
                names = json.loads(array)
            except (ValueError, RecursionError):
                return None  # e.g. a `]` inside a name: the cut was not the whole array
            if not isinstance(names, list) or len(names) > self.max_names:
                return None
            if not all(type(name) is str for name in names):
                return None
        known = NodeNames(names)
        known.resolved = resolved
        known.token = next(_tokens)
        self._recent.insert(0, (array, known))
        del self._recent[self.remembered :]
        return known


_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


class NameTable:
    """Every registered node's name as bytes, for resolving a `nodenames` array straight from
    the body's bytes (kube-scheduler's lists change every cycle: a new list of 20,000 names
    would otherwise be decoded into 20,000 new strings, each hashed and compared with the
    index's in a dict lookup, ~0.2-0.4 µs a name on a large heap).

    The names are padded to `width` bytes (a multiple of 8) and viewed as uint64 words; each
    name's words and length are hashed (vectorised) and the hashes sorted. A list is looked up
    with the same operations over all its names at once (`lookup`): a hash found must also
    match the name's every word and its length, so a name resolves only to the node whose name
    is byte for byte the same (the hash only finds where to compare). What the fast path cannot
    prove it reads exactly (escapes, control characters, spacing other than kube-scheduler's
    compact `["a","b"]`, a name longer than the widest known one, any unknown name) returns
    None: the caller decodes the list as before. Built per topology (`ClusterIndex.name_table`);
    tests: `tests/scheduler/test_node_names.py`."""

    _MIX = np.uint64(0x9E3779B97F4A7C15)

    def __init__(self, names: list[str], slots: list[int]) -> None:
        encoded = [name.encode() for name in names]
        longest = max((len(e) for e in encoded), default=1)
        self.width = max(8, -(-longest // 8) * 8)
        self.usable = bool(encoded)
        padded = b"".join(e.ljust(self.width, b"\0") for e in encoded)
        words = np.frombuffer(padded, dtype=np.uint64).reshape(len(encoded), self.width // 8)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        hashes = self._hash(words, lengths)
        order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[order]
        if len(self.hashes) > 1 and bool((self.hashes[1:] == self.hashes[:-1]).any()):
            self.usable = False  # two names with one hash: not worth telling apart here
        self.words = words[order]
        self.lengths = lengths[order]
        self.slots = np.asarray(slots, dtype=np.int64)[order]

    def _hash(self, words: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        hashes = lengths.astype(np.uint64)
        with np.errstate(over="ignore"):
            for column in range(words.shape[1]):
                hashes = hashes * self._MIX + words[:, column]
                hashes ^= hashes >> np.uint64(29)
        return hashes

    def lookup(self, array: bytes) -> np.ndarray | None:
        """The slots of the names of a JSON array (its bytes, `[` to `]`), in order; None
        unless every name is a known node's and the array is in the compact form."""
        if not self.usable or len(array) < 4 or b"\\" in array:
            return None
        raw = np.frombuffer(array, dtype=np.uint8)
        if raw[0] != 0x5B or raw[-1] != 0x5D or int(raw.min()) < 0x20:  # `[` `]`, no controls
            return None
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
        if int(lengths.max()) > self.width:
            return None
        # Each name's words read straight from the bytes: a uint64 view at every byte offset
        # (unaligned, stride 1; 8 zero bytes appended so the last word stays inside), the
        # bytes past the name's end masked off (as the table's names are zero-padded).
        padded = array + bytes(8)
        at_byte = np.ndarray((len(padded) - 7,), dtype=np.uint64, buffer=padded, strides=(1,))
        words = np.empty((len(starts), self.width // 8), dtype=np.uint64)
        last = len(at_byte) - 1
        for column in range(self.width // 8):
            left = np.clip(lengths - 8 * column, 0, 8).astype(np.uint64)
            mask = np.where(left >= 8, _ALL, (np.uint64(1) << (left * np.uint64(8))) - np.uint64(1))
            where = starts + 8 * column if column else starts
            if column:  # (a shorter name's later words are masked off whole: read anywhere)
                np.minimum(where, last, out=where)
            words[:, column] = at_byte[where] & mask
        hashes = self._hash(words, lengths)
        at = np.searchsorted(self.hashes, hashes)
        np.minimum(at, len(self.hashes) - 1, out=at)
        if not (
            bool((self.hashes[at] == hashes).all()) and bool((self.lengths[at] == lengths).all())
            and bool((self.words[at] == words).all())
        ):  # fmt: skip
            return None
        return self.slots[at]
