"""kube-scheduler's failedNodes as JSON bytes, for `node_reasons.NodeReasons.to_json`.

A bulk run of refused nodes (their rows in a `node_names.NameTable`, their reason ids, the
request's texts by id) is written in one pass in C from the table's pre-encoded keys and each
text's JSON (`native/refusals/src/reply.c`: a few hundred µs less a refusal at 20,000 nodes,
and one write of the reply's bytes instead of several, which left the next call's data out of
the caches: bench/RESULTS.md "reply"). Without the library: joined in Python from the same
pieces, once per call; or, when kube-scheduler lists the same nodes rotated and they refuse
alike, from the request's last reply's bytes rotated (`_LastReply`). Byte for byte what
`json.dumps(dict, ensure_ascii=False, separators=(",", ":"))` writes
(`tests/scheduler/test_node_reasons.py`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np

from .native_steps import PADDING, NativeSteps

_ENCODER = msgspec.json.Encoder()


class _LastReply:
    """A request's last bulk run's JSON entries (`"name":"text",` each), with what they were
    made of: kube-scheduler lists the same nodes rotated from call to call (its start index
    advances; a backlog pod's retry is refused by the same nodes for the same reasons), and
    such a run's JSON is the last one's bytes rotated (two slices) once its rows and ids are
    checked to be the last ones rotated (vectorised) and its texts the same: no per-node work.
    Kept per request (its memo's reason names list: `_Bulk.reasons`), the most recent first,
    up to `_REPLY_BYTES` of JSON in all."""

    __slots__ = ("ids", "joined", "lengths", "owner", "position", "rows", "table", "texts")

    def __init__(self, owner: Any, table: Any, rows: np.ndarray, ids: np.ndarray,
                 texts: list[Any], joined: bytes, lengths: np.ndarray) -> None:
        self.owner = owner  # (the memo's names list: its id is the key while it lives)
        self.table, self.rows, self.ids, self.texts = table, rows, ids, texts
        self.joined, self.lengths = joined, lengths  # (lengths: each id's `"text",` bytes)
        self.position: np.ndarray | None = None  # row -> its place in `rows` (on first reuse)

    def rotated(self, table: Any, rows: np.ndarray, ids: np.ndarray, texts: np.ndarray
                ) -> bytes | None:
        """The entries (with a trailing comma) for these rows and ids, when they are the last
        ones rotated and every text they use is the same; else None."""
        count = len(rows)
        if table is not self.table or count != len(self.rows) or not count:
            return None
        known = self.texts
        if len(texts) < len(known) or texts[: len(known)].tolist() != known:
            return None
        if self.position is None:
            position = np.full(len(table.keys), -1, dtype=np.int64)
            position[self.rows] = np.arange(count, dtype=np.int64)
            self.position = position
        first = int(rows[0])
        if first >= len(self.position):
            return None
        k = int(self.position[first])
        if k < 0:
            return None
        head = count - k
        old_rows, old_ids = self.rows, self.ids
        if not (np.array_equal(rows[:head], old_rows[k:])
                and np.array_equal(rows[head:], old_rows[:k])
                and np.array_equal(ids[:head], old_ids[k:])
                and np.array_equal(ids[head:], old_ids[:k])):  # fmt: skip
            return None
        if int(ids.max()) >= len(known):
            return None
        if not k:
            return self.joined
        at = int(_key_lengths(table)[old_rows[:k]].sum() + self.lengths[old_ids[:k]].sum())
        return self.joined[at:] + self.joined[:at]


_REPLY_BYTES = 16 << 20
_last_replies: OrderedDict[int, _LastReply] = OrderedDict()
_reply_bytes = 0
_replies_lock = threading.Lock()
_key_lengths_of: tuple[Any, np.ndarray] | None = None


def _key_lengths(table: Any) -> np.ndarray:
    """Each row's JSON key's length in bytes (`"name":`), per name table (built once)."""
    global _key_lengths_of
    kept = _key_lengths_of
    if kept is None or kept[0] is not table:
        lengths = np.fromiter(map(len, table.keys), dtype=np.int64, count=len(table.keys))
        kept = _key_lengths_of = (table, lengths)
    return kept[1]


def bulk_json(segment: Any) -> bytes:
    """A bulk run's JSON object (`node_reasons._Bulk`, its rows known): joined from the name
    table's key bytes and each distinct text's bytes, or the last run's bytes rotated
    (`_LastReply`)."""
    global _reply_bytes
    rows, ids = segment.refused_rows()
    if not len(rows):
        return b"{}"
    table, texts, owner = segment.table, segment.texts, segment.reasons
    written = _written_in_c(table, rows, ids, texts)
    if written is not None:
        return written
    last = _last_replies.get(id(owner))
    if last is not None and last.owner is owner:
        joined = last.rotated(table, rows, ids, texts)
        if joined is not None:
            return b"{" + joined[:-1] + b"}"
    values = np.empty(len(texts), dtype=object)
    lengths = np.zeros(len(texts), dtype=np.int64)
    used = np.unique(ids).tolist()
    for reason_id in used:
        values[reason_id] = encoded = encode_compact(texts[reason_id]) + b","
        lengths[reason_id] = len(encoded)
    pairs = np.empty(2 * len(rows), dtype=object)
    pairs[0::2] = table.keys[rows]
    pairs[1::2] = values[ids]
    joined = b"".join(pairs.tolist())
    reply = _LastReply(owner, table, rows, ids, texts[: used[-1] + 1].tolist(), joined, lengths)
    with _replies_lock:  # (replies may be encoded on several threads)
        kept = _last_replies.pop(id(owner), None)
        if kept is not None:
            _reply_bytes -= len(kept.joined)
        _last_replies[id(owner)] = reply
        _reply_bytes += len(joined)
        while _reply_bytes > _REPLY_BYTES and len(_last_replies) > 1:
            _reply_bytes -= len(_last_replies.popitem(last=False)[1].joined)
    return b"{" + joined[:-1] + b"}"


def _written_in_c(table: Any, rows: np.ndarray, ids: np.ndarray, texts: np.ndarray
                  ) -> bytes | None:
    """The bulk run's JSON object written in one pass by the refusals library
    (`native_steps.NativeSteps.reasons_json`) from the table's keys and every text's JSON (the
    refused ids' texts are never None: `_Bulk.refused_rows`); None without the library."""
    native = NativeSteps.load()
    keys = getattr(table, "json_keys", None) if native is not None else None
    if keys is None:
        return None
    encoded = [b"" if text is None else encode_compact(text) for text in texts.tolist()]
    text_at = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)),
              out=text_at[1:])  # fmt: skip
    blob = np.frombuffer(b"".join(encoded) + bytes(PADDING), dtype=np.uint8)
    return native.reasons_json(keys[0], keys[1], rows, blob, text_at, ids)  # type: ignore[union-attr]


def encode_compact(value: Any) -> bytes:
    """`json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))`'s UTF-8
    bytes for a value of dicts, lists, strings, ints, bools and None (msgspec: the same bytes
    for those, `test_node_reasons.py`; anything it cannot write goes through `json.dumps`)."""
    try:
        return _ENCODER.encode(value)
    except (msgspec.EncodeError, TypeError, UnicodeEncodeError):  # (e.g. a lone surrogate)
        return json.dumps(value, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()
