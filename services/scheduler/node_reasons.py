"""Why each node refused a pod, as kube-scheduler's `failedNodes` map, built only when read.

A refusal at 5,000 nodes words 5,000 reasons, but they are a handful of distinct texts
(`refusal_memo.py`: a reason id per node). Building the name → text dict for every refused
call cost about as much as the rest of the refusal, and serialising it with `json.dumps` more
(~2 ms at 5,000 nodes). `NodeReasons` keeps what the decision found as it found it: runs of
nodes worded one by one (a small dict) and bulk runs (the nodes' names gathered from the index
at the time, or their rows in the current name table, read from it only when asked; their
reason ids, the request's texts by id; id 0 / text None: the node fits, no entry). It is a
read-only `Mapping[str, str]` equal to the dict the decision used to build (same keys, texts,
order); the dict is built once, on first generic read (`explain`, a bind's
single-node filter), and the HTTP reply is encoded from it with msgspec (byte for byte what
`json.dumps(..., ensure_ascii=False, separators=(",", ":"))` wrote: `test_node_reasons.py`).
What every refused call reads is answered without the dict: the distinct texts, the counts
and example nodes per HAMi reason (the `FilteringFailed` event), the first entries (the bus
event), equality with the last refusal (the failure log's repeat check).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from .failed_nodes_json import bulk_json, encode_compact


class _Bulk:
    """Nodes worded in bulk: names (object array), reason ids, texts by id (None: fits), and
    where known the names' rows in a name table (`node_names.NameTable`: their JSON keys and
    names, by row, never changed). With rows, the names are gathered from the table only when
    read (`names`, `names_at`): a gather of 20,000 of the index's scattered strings touches
    each one (~1.3 ms at 20,000 nodes on a loaded machine), and what every refused call reads
    (the reply's JSON, the event's examples, the repeat check) needs the rows, or a few names."""

    __slots__ = ("_names", "ids", "keep", "reasons", "rows", "table", "texts")

    def __init__(self, names: np.ndarray | None, ids: np.ndarray, texts: np.ndarray,
                 reasons: list[tuple[str, ...]], rows: tuple[Any, np.ndarray] | None) -> None:
        self._names, self.ids, self.texts, self.reasons = names, ids, texts, reasons
        self.table, self.rows = rows if rows is not None else (None, None)
        if names is None and self.rows is None:
            raise ValueError("a bulk run needs its names or their rows in a name table")
        self.keep: np.ndarray | None = None

    @property
    def names(self) -> np.ndarray:
        """Every node's name, in order (gathered from the name table once, where not given)."""
        if self._names is None:
            self._names = self.table.names[self.rows]
        return self._names

    def names_at(self, positions: np.ndarray) -> np.ndarray:
        """The names of the nodes at these positions (only those gathered)."""
        if self._names is not None:
            return self._names[positions]
        return self.table.names[self.rows[positions]]

    def same_names(self, other: _Bulk) -> bool | None:
        """Whether both runs name the same nodes in the same order, read from their rows when
        both have them in one table (no name gathered); None when the lengths differ."""
        if len(self.ids) != len(other.ids):
            return None
        if self.table is not None and self.table is other.table:
            return bool((self.rows == other.rows).all())
        return bool((self.names == other.names).all())

    def _kept(self) -> np.ndarray | None:
        """Which nodes have a reason (None: all of them)."""
        if self.keep is None:
            texts = self.texts
            fits = np.fromiter((t is None for t in texts), dtype=bool, count=len(texts))
            self.keep = ~fits[self.ids] if fits.any() else np.ones(0, dtype=bool)
        return None if not len(self.keep) else self.keep

    def refused(self) -> tuple[np.ndarray, np.ndarray]:
        """(names, ids) of the nodes with a reason (the ones that fit dropped)."""
        keep = self._kept()
        if keep is None:
            return self.names, self.ids
        return self.names[keep], self.ids[keep]

    def refused_names(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(names, ids) of the first `count` nodes with a reason (only those names gathered)."""
        ids, where = self.refused_ids()
        at = np.arange(min(count, len(ids))) if where is None else where[:count]
        return self.names_at(at), self.ids[at]

    def refused_count(self) -> int:
        keep = self._kept()
        return len(self.ids) if keep is None else int(np.count_nonzero(keep))

    def refused_ids(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids of the nodes with a reason, their positions in `names`; None: all of them)."""
        keep = self._kept()
        if keep is None:
            return self.ids, None
        return self.ids[keep], np.flatnonzero(keep)

    def refused_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(name table rows, ids) of the nodes with a reason."""
        keep = self._kept()
        assert self.rows is not None
        if keep is None:
            return self.rows, self.ids
        return self.rows[keep], self.ids[keep]


class NodeReasons(Mapping[str, str]):
    """kube-scheduler's `failedNodes` (node name → HAMi's `N/M Reason, ...`), lazily built.

    Written by the decision in the order it words nodes (`add`: one node not worded before;
    `add_bulk`: a run of them); any other write (`__setitem__`, `update`) builds the dict
    first, so every read after it is the dict's."""

    __slots__ = ("_dict", "_owned", "_segments", "_tail")

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        self._segments: list[dict[str, str] | _Bulk] = []
        self._tail: dict[str, str] | None = None
        # the dict, once built; `_owned`: written from outside since (then it alone holds the
        # entries: the segments are dropped), else a cache beside the segments
        self._dict: dict[str, str] | None = dict(items) if items else None
        self._owned = self._dict is not None

    @classmethod
    def uniform(cls, names: list[str], text: str) -> NodeReasons:
        """Every one of `names` refused for the same reason."""
        reasons = cls()
        if names:
            array = np.empty(len(names), dtype=object)
            array[:] = names
            texts = np.array([None, text], dtype=object)
            reasons.add_bulk(array, np.ones(len(names), dtype=np.int64), texts, [(), ()])
        return reasons

    # --- written by the decision --------------------------------------------------------------
    def add(self, name: str, text: str) -> None:
        """A node not worded before in this refusal."""
        if self._owned:
            self._dict[name] = text  # type: ignore[index]
            return
        self._dict = None  # (a cache no longer whole)
        if self._tail is None:
            self._tail = {}
            self._segments.append(self._tail)
        self._tail[name] = text

    def add_bulk(self, names: np.ndarray | None, ids: np.ndarray, texts: np.ndarray,
                 reasons: list[tuple[str, ...]],
                 rows: tuple[Any, np.ndarray] | None = None) -> None:
        """Nodes not worded before: `names[i]` refused with `texts[ids[i]]` (None: it fits, no
        entry); `reasons[id]` the HAMi reason names of text `id`. The arrays are kept as given
        (the caller passes fresh gathers; `texts` and `reasons` only ever grow). `names` None:
        the names are the rows' in `rows`' table, gathered only when read."""
        if not len(ids):
            return
        if self._owned:
            if names is None:
                assert rows is not None
                names = rows[0].names[rows[1]]
            self._dict.update((n, t) for n, t in zip(names.tolist(), texts[ids].tolist(),  # type: ignore[union-attr]
                                                     strict=True) if t is not None)
            return
        self._dict = None
        self._segments.append(_Bulk(names, ids, texts, reasons, rows))
        self._tail = None

    # --- the dict -----------------------------------------------------------------------------
    def as_dict(self) -> dict[str, str]:
        """The name → text dict (built once and kept; the segments stay for the reads below
        until something writes it)."""
        if self._dict is None:
            built: dict[str, str] = {}
            for segment in self._segments:
                if isinstance(segment, dict):
                    built.update(segment)
                else:
                    names, ids = segment.refused()
                    built.update(zip(names.tolist(), segment.texts[ids].tolist(), strict=True))
            self._dict = built
        return self._dict

    def _own(self) -> dict[str, str]:
        """The dict, to be written: it alone holds the entries from now on."""
        mapping = self.as_dict()
        self._owned, self._segments, self._tail = True, [], None
        return mapping

    def __getitem__(self, name: str) -> str:
        return self.as_dict()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def __bool__(self) -> bool:
        if self._owned or self._dict is not None:
            return bool(self._dict)
        return any(bool(s) if isinstance(s, dict) else s.refused_count() > 0
                   for s in self._segments)  # fmt: skip

    def __contains__(self, name: object) -> bool:
        return name in self.as_dict()

    def __setitem__(self, name: str, text: str) -> None:
        self._own()[name] = text

    def update(self, other: Mapping[str, str]) -> None:
        if other:
            self._own().update(other)

    def __repr__(self) -> str:
        return f"NodeReasons({self.as_dict()!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NodeReasons) and not self._owned and not other._owned:
            same = _same_segments(self._segments, other._segments)
            if same is None:  # (another order, e.g. kube-scheduler's list rotated)
                same = _same_by_rows(self._by_rows(), other._by_rows())
            if same is not None:
                return same
        if not isinstance(other, Mapping):
            return NotImplemented
        mine = self.as_dict()
        return mine == (other.as_dict() if isinstance(other, NodeReasons) else other)

    __hash__ = None  # type: ignore[assignment]

    def _by_rows(self) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """(name table, the entries' rows sorted, their texts in that order), when every
        entry's row is known (unbuilt, one table) and no name is there twice; else None."""
        tables = {id(s.table): s.table for s in self._segments if not isinstance(s, dict)}
        if self._owned or len(tables) != 1 or None in tables.values():
            return None
        table = next(iter(tables.values()))
        rows: list[np.ndarray] = []
        texts: list[np.ndarray] = []
        for segment in self._segments:
            if isinstance(segment, dict):
                found = [table.row_of(name) for name in segment]
                if -1 in found:
                    return None
                rows.append(np.asarray(found, dtype=np.int64))
                values = np.empty(len(segment), dtype=object)
                values[:] = list(segment.values())
                texts.append(values)
            else:
                at, ids = segment.refused_rows()
                rows.append(at)
                texts.append(segment.texts[ids])
        every = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        order = np.argsort(every, kind="stable")
        every = every[order]
        if len(every) > 1 and not bool((every[1:] != every[:-1]).all()):
            return None  # (a name twice: the dict's rules)
        return table, every, (np.concatenate(texts) if texts else np.zeros(0, dtype=object))[order]

    # --- what every refused call reads, without the dict --------------------------------------
    def to_json(self) -> bytes:
        """The JSON object, as `json.dumps(dict, ensure_ascii=False, separators=(",", ":"))`
        encoded it. Unbuilt, with every bulk run's rows known: joined from the name table's
        key bytes (allocated together when the table was built) and each distinct text's
        bytes, without the dict or the index's scattered strings (a name listed twice by the
        caller then appears twice, with the same text: the same map once decoded)."""
        segments = self._segments
        if self._owned or self._dict is not None or any(
            not isinstance(s, dict) and s.table is None for s in segments
        ):
            return encode_compact(self.as_dict())
        if len(segments) == 1 and not isinstance(segments[0], dict):
            return bulk_json(segments[0])
        parts: list[bytes] = []
        for segment in segments:
            if isinstance(segment, dict):
                if segment:
                    parts.append(encode_compact(segment)[1:-1] + b",")
                continue
            parts.append(bulk_json(segment)[1:-1])
            if len(parts[-1]):
                parts[-1] += b","
        body = b"".join(parts)
        return b"{" + body[:-1] + b"}" if body else b"{}"

    def count(self) -> int:
        """How many nodes refused, without building the dict (a name the caller listed twice
        and worded in bulk counts twice; kube-scheduler lists each node once)."""
        if self._owned:
            return len(self._dict)
        return sum(len(s) if isinstance(s, dict) else s.refused_count() for s in self._segments)

    def texts(self) -> set[str]:
        """The distinct reason texts."""
        if self._owned:
            return set(self._dict.values())
        found: set[str] = set()
        for segment in self._segments:
            if isinstance(segment, dict):
                found.update(segment.values())
            else:
                ids, _where = segment.refused_ids()
                found.update(segment.texts[np.unique(ids)].tolist())
        return found

    def head(self, count: int) -> dict[str, str]:
        """The first `count` entries, in order."""
        if self._owned or self._dict is not None:
            return dict(islice(self._dict.items(), count))
        out: dict[str, str] = {}
        for segment in self._segments:
            left = count - len(out)
            if left <= 0:
                break
            if isinstance(segment, dict):
                out.update(islice(segment.items(), left))
            else:
                names, ids = segment.refused_names(left)
                out.update(zip(names.tolist(), segment.texts[ids].tolist(), strict=True))
        return out

    def by_reason(self, examples: int) -> dict[str, tuple[int, list[str]]]:
        """Per HAMi reason name (`CardInsufficientMemory`, ...; what precedes `:` for other
        texts), how many nodes give it and the first `examples` of them, in order."""
        tally: dict[str, list[Any]] = {}

        def count(reason: str, nodes: int, names: list[str]) -> None:
            entry = tally.setdefault(reason, [0, []])
            entry[0] += nodes
            if len(entry[1]) < examples:
                entry[1].extend(names[: examples - len(entry[1])])

        if self._owned:
            for name, text in self._dict.items():  # type: ignore[union-attr]
                for reason in reason_names(text):
                    count(reason, 1, [name])
        for segment in self._segments:
            if isinstance(segment, dict):
                for name, text in segment.items():
                    for reason in reason_names(text):
                        count(reason, 1, [name])
                continue
            ids, where = segment.refused_ids()  # (only the examples' names gathered)
            totals = np.bincount(ids)
            for reason_id in np.flatnonzero(totals).tolist():
                at = np.flatnonzero(ids == reason_id)[:examples]
                first = segment.names_at(at if where is None else where[at]).tolist()
                named = segment.reasons[reason_id] if reason_id < len(segment.reasons) else ()
                for reason in named or reason_names(segment.texts[reason_id]):
                    count(reason, int(totals[reason_id]), first)
        return {reason: (nodes, names) for reason, (nodes, names) in tally.items()}


def reason_names(text: str) -> list[str]:
    """HAMi's reason names in a node's text: `3/8 CardInsufficientMemory, 5/8 X` → both names;
    any other text (`NodeUnregistered: ...`, `RequestInvalid: ...`) → what precedes its `:`."""
    head = text.split(" [", 1)[0]  # (a note about HAMi's pods follows in brackets)
    names = []
    for part in head.split(", "):
        count, _, name = part.strip().partition(" ")
        if name and "/" in count and count.replace("/", "").isdigit():
            names.append(name.split(":", 1)[0])
    return names or [text.split(":", 1)[0].strip() or text]


def _same_by_rows(mine: Any, theirs: Any) -> bool | None:
    """Whether two refusals' entries (`NodeReasons._by_rows`) are the same; None when either
    could not be read by rows."""
    if mine is None or theirs is None or mine[0] is not theirs[0]:
        return None
    if len(mine[1]) != len(theirs[1]):
        return False
    return bool((mine[1] == theirs[1]).all()) and bool((mine[2] == theirs[2]).all())


def _same_segments(mine: list[Any], theirs: list[Any]) -> bool | None:
    """Whether two unbuilt refusals hold the same entries in the same order, read segment by
    segment (vectorised); None when the layouts differ (then the dicts are compared)."""
    if len(mine) != len(theirs):
        return None
    for a, b in zip(mine, theirs, strict=True):
        if isinstance(a, dict) or isinstance(b, dict):
            if not (isinstance(a, dict) and isinstance(b, dict)):
                return None
            if list(a) != list(b):
                return None
            if a != b:
                return False  # (the same names in the same places, another text)
            continue
        if not a.same_names(b):  # (the same nodes in the same order, those that fit too)
            return None
        keep_a, keep_b = a._kept(), b._kept()
        if (keep_a is None) != (keep_b is None) or (
            keep_a is not None and not (keep_a == keep_b).all()
        ):  # fmt: skip
            return None
        if not (a.texts[a.ids] == b.texts[b.ids]).all():
            return False
    return True
