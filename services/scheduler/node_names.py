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
from typing import Any

_KEY = b'"nodenames"'
_PLACEHOLDER = "\\u0000tessera-nodenames"
_PLACEHOLDER_JSON = b'"' + _PLACEHOLDER.encode() + b'"'
_PLACEHOLDER_VALUE = json.loads(_PLACEHOLDER_JSON)
_WS = b" \t\r\n"
_MIN_BYTES = 4096  # shorter lists are cheap to parse; not worth remembering
_REMEMBERED = 4
_tokens = itertools.count(1)


class NodeNames(list[str]):
    """A candidate list already checked (strings, within the limit). `token` names its content:
    two lists with one token have the same names in the same order.

    Read-only: one instance is handed to every call with that list (a copy per call of 5,000 to
    20,000 names cost more than the copy is worth, most of it in the cyclic GC walking the
    copies of the calls in flight); whoever needs a changed list builds a new one."""

    token: int = 0

    def _read_only(self, *_args: object, **_kwargs: object) -> None:
        raise TypeError("NodeNames is shared between calls: build a new list instead")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only  # type: ignore[assignment]
    append = extend = insert = pop = remove = _read_only  # type: ignore[assignment]
    clear = sort = reverse = _read_only  # type: ignore[assignment]


class NodeNamesCache:
    def __init__(self, max_names: int, remembered: int = _REMEMBERED) -> None:
        self.max_names = max_names
        self.remembered = remembered
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
        try:
            names = json.loads(array)
        except (ValueError, RecursionError):
            return None  # e.g. a `]` inside a name: the cut was not the whole array
        if not isinstance(names, list) or len(names) > self.max_names:
            return None
        if not all(type(name) is str for name in names):
            return None
        known = NodeNames(names)
        known.token = next(_tokens)
        self._recent.insert(0, (array, known))
        del self._recent[self.remembered :]
        return known
