"""The ledger's wire codec as the scheduler runs it: only what changed is encoded or decoded.

A node's entry holds every allocation on the node (tens of them), and a write changes one. The
wire format is `tessera.codec`'s, byte for byte (any reader decodes what this writes, and this
reads whatever any writer wrote); what changes is the work:

- encode: each allocation's msgpack bytes are kept beside the allocation object they were made
  from (for the nodes written most recently); an allocation that is the same object as at the
  last write of the node is not dumped again. Mutate functions are copy-on-write, so an
  unchanged allocation is the same object, and a changed one is a new object.
- decode: the entry is walked with msgpack's streaming unpacker; each allocation's bytes are
  hashed and compared with the hash of the bytes the node's previous value of that allocation
  came from. Only new or changed allocations are unpacked and validated (by the same pydantic
  model, so the same rules and errors); the others are the previous objects. Anything the walk
  does not expect falls back to `tessera.codec.decode` (same result, same errors).
- memory: decoded allocations share one interned fields-set per distinct set of fields and
  their repeated strings (namespace, node, GPU type and UUID, state) are interned.

Reused allocation objects are shared between successive ledger values; nothing in the scheduler
modifies an allocation in place (the index's objects are read-only by contract).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import msgpack
from pydantic import ValidationError

from tessera.codec import CodecError, decode
from tessera.models import Allocation, DeviceGrant, NodeLedger

_ENCODE_NODES = 512  # nodes whose allocations' bytes are kept for the next write
_SCHEMA = NodeLedger.__name__
_VERSIONS = NodeLedger.READABLE_VERSIONS | {NodeLedger.SCHEMA_VERSION}
_FIELDS = tuple(NodeLedger.model_fields)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


_HEAD = b"".join([
    b"\x83", _pack("schema"), _pack(_SCHEMA), _pack("version"), _pack(NodeLedger.SCHEMA_VERSION),
    _pack("data"),
])  # fmt: skip
_KEYS = {name: _pack(name) for name in _FIELDS}


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


class _Interned:
    """Canonical copies of values many objects repeat (strings, fields-sets)."""

    def __init__(self) -> None:
        self.sets: dict[frozenset[str], set[str]] = {}

    def fields_set(self, names: set[str]) -> set[str]:
        key = frozenset(names)
        shared = self.sets.get(key)
        if shared is None:
            shared = self.sets[key] = set(key)
        return shared

    def slim(self, allocation: Allocation) -> Allocation:
        """Share what every allocation repeats (saves ~40 % of an allocation's memory)."""
        setter = object.__setattr__
        setter(allocation, "__pydantic_fields_set__",
               self.fields_set(allocation.__pydantic_fields_set__))  # fmt: skip
        values = allocation.__dict__
        for name in ("namespace", "node", "core_policy", "reason"):
            value = values[name]
            if type(value) is str:
                values[name] = sys.intern(value)
        for grants in allocation.containers:
            for grant in grants:
                self._slim_grant(grant)
        return allocation

    def _slim_grant(self, grant: DeviceGrant) -> None:
        object.__setattr__(grant, "__pydantic_fields_set__",
                           self.fields_set(grant.__pydantic_fields_set__))  # fmt: skip
        values = grant.__dict__
        for name in ("uuid", "type"):
            value = values[name]
            if type(value) is str:
                values[name] = sys.intern(value)


class _Fallback(Exception):
    """The payload is not shaped as this fast path expects: decode it the ordinary way."""


def _walk(payload: bytes) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """(envelope without data, data without allocations, uid -> that allocation's bytes)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(payload) + 1)
    unpacker.feed(payload)
    envelope: dict[str, Any] = {}
    data: dict[str, Any] | None = None
    slices: dict[str, bytes] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if type(key) is not str:
                raise _Fallback
            if key != "data":
                envelope[key] = unpacker.unpack()
                continue
            if data is not None:
                raise _Fallback
            data = {}
            for _ in range(unpacker.read_map_header()):
                name = unpacker.unpack()
                if type(name) is not str:
                    raise _Fallback
                if name != "allocations":
                    data[name] = unpacker.unpack()
                    continue
                if "allocations" in data:
                    raise _Fallback
                data["allocations"] = None
                for _ in range(unpacker.read_map_header()):
                    uid = unpacker.unpack()
                    if type(uid) is not str or uid in slices:
                        raise _Fallback
                    start = unpacker.tell()
                    unpacker.skip()
                    slices[uid] = payload[start : unpacker.tell()]
        if unpacker.tell() != len(payload) or data is None:
            raise _Fallback
    except _Fallback:
        raise
    except Exception as exc:  # not a map where one is expected, truncated, ...
        raise _Fallback from exc
    data.pop("allocations", None)
    return envelope, data, slices


class LedgerCodec:
    """Encode and decode ledger entries, reusing the allocations that did not change."""

    def __init__(self, encode_nodes: int = _ENCODE_NODES) -> None:
        # node -> uid -> (hash of the allocation's bytes, the allocation decoded from them)
        self._decoded: dict[str, dict[str, tuple[int, Allocation]]] = {}
        # node -> uid -> (allocation, its bytes), for the nodes written most recently
        self._encoded: OrderedDict[str, dict[str, tuple[Allocation, bytes]]] = OrderedDict()
        self._encode_nodes = encode_nodes
        self._interned = _Interned()

    # --- encode ---------------------------------------------------------------------------------
    def encode(self, ledger: NodeLedger) -> bytes:
        """The same bytes as `tessera.codec.encode(ledger)`."""
        node = ledger.node
        previous = self._encoded.pop(node, None) or {}
        kept: dict[str, tuple[Allocation, bytes]] = {}
        parts = [_HEAD]
        rest = ledger.model_dump(mode="json", exclude={"allocations"})
        parts.append(_map_header(len(rest) + 1))
        for name in _FIELDS:
            if name != "allocations":
                if name in rest:
                    parts.append(_KEYS[name])
                    parts.append(_pack(rest[name]))
                continue
            parts.append(_KEYS[name])
            parts.append(_map_header(len(ledger.allocations)))
            for uid, allocation in ledger.allocations.items():
                cached = previous.get(uid)
                if cached is not None and cached[0] is allocation:
                    packed = cached[1]
                else:
                    packed = _pack(allocation.model_dump(mode="json"))
                kept[uid] = (allocation, packed)
                parts.append(_pack(uid))
                parts.append(packed)
        self._encoded[node] = kept
        while len(self._encoded) > self._encode_nodes:
            self._encoded.popitem(last=False)
        # What this write leaves in the KV is what the next decode compares against.
        self._decoded[node] = {uid: (hash(b), a) for uid, (a, b) in kept.items()}
        return b"".join(parts)

    # --- decode ---------------------------------------------------------------------------------
    def decode(self, node: str, payload: bytes) -> NodeLedger:
        """The same value (and the same CodecError) as `tessera.codec.decode(payload,
        NodeLedger)`, decoding only the allocations whose bytes changed."""
        try:
            envelope, data, slices = _walk(payload)
        except _Fallback:
            return self._full(node, payload)
        if envelope.get("schema") != _SCHEMA or envelope.get("version") not in _VERSIONS:
            return self._full(node, payload)  # the ordinary decode words the error
        previous = self._decoded.get(node, {})
        hashes: dict[str, int] = {}
        reused: dict[str, Allocation] = {}
        fresh: dict[str, Any] = {}
        for uid, raw in slices.items():
            digest = hashes[uid] = hash(raw)
            known = previous.get(uid)
            if known is not None and known[0] == digest:
                reused[uid] = known[1]
            else:
                try:
                    fresh[uid] = msgpack.unpackb(raw, raw=False, strict_map_key=True)
                except Exception:
                    return self._full(node, payload)
        try:
            ledger = NodeLedger.model_validate({**data, "allocations": fresh})
        except ValidationError:
            return self._full(node, payload)  # the ordinary decode words the error
        validated = ledger.allocations
        merged = {}
        for uid in slices:
            allocation = reused.get(uid)
            merged[uid] = allocation if allocation is not None else self._interned.slim(
                validated[uid]
            )
        ledger.allocations = merged
        ledger.__pydantic_fields_set__.add("allocations")
        self._decoded[node] = {uid: (hashes[uid], a) for uid, a in merged.items()}
        return ledger

    def _full(self, node: str, payload: bytes) -> NodeLedger:
        self.forget(node)
        ledger = decode(payload, NodeLedger)  # raises CodecError with the reason
        for allocation in ledger.allocations.values():
            self._interned.slim(allocation)
        return ledger

    def forget(self, node: str) -> None:
        """The node's entry is gone (or unreadable): hold nothing of it."""
        self._decoded.pop(node, None)
        self._encoded.pop(node, None)


__all__ = ["CodecError", "LedgerCodec"]
