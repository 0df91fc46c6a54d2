"""The ledger's wire codec as the scheduler runs it: only what changed is encoded or decoded.

A node's entry holds every allocation on the node (tens of them), and a write changes one. The
wire format is `tessera.codec`'s, byte for byte (any reader decodes what this writes, and this
reads whatever any writer wrote); what changes is the work:

- encode: each allocation's msgpack bytes are kept beside the allocation object they were made
  from (for the nodes written most recently); an allocation that is the same object as at the
  last write of the node is not dumped again. Mutate functions are copy-on-write, so an
  unchanged allocation is the same object, and a changed one is a new object.
- decode: msgspec checks the entry and leaves each allocation as its bytes (wire_fast.py); each
  allocation's bytes are hashed and compared with the hash of the bytes the node's previous
  value of that allocation came from. Only new or changed allocations are decoded and checked
  (by msgspec Structs that accept exactly the canonical subset of what the pydantic model
  accepts); the others are the previous objects. Anything not canonical falls back to
  `tessera.codec.decode` (same result, same errors).
- splice: a payload that differs from the node's last one (written or read here) in at most
  one allocation and the claims (a bind, the agent's Allocate) is read without decoding the
  rest: its bytes before the first allocation that differs are compared with the last
  payload's (a few slice comparisons), the allocation that differs is measured (msgpack's
  Unpacker) and decoded, the allocations after it must be the same bytes, and the claims are
  decoded on their own. msgpack is a prefix code, so payload bytes equal to those of a valid
  payload at the same place parse to the same values; anything else (a different count, two
  allocations changed, a key that moved) is decoded as above.
- memory: decoded objects share one fields-set per distinct set of fields and their repeated
  strings (namespace, node, GPU type and UUID) are interned; their dicts are key-sharing.

Reused allocation objects are shared between successive ledger values; nothing in the scheduler
modifies an allocation in place (the index's objects are read-only by contract).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from itertools import accumulate
from typing import Any, NamedTuple

import msgpack

from tessera.codec import CodecError, decode
from tessera.models import Allocation, DeviceGrant, InFlightClaim, NodeLedger

from . import wire_fast

_ENCODE_NODES = 512  # nodes whose allocations' bytes are kept for the next write
_SCHEMA = NodeLedger.__name__
_FIELDS = tuple(NodeLedger.model_fields)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


_HEAD = b"".join([
    b"\x83", _pack("schema"), _pack(_SCHEMA), _pack("version"), _pack(NodeLedger.SCHEMA_VERSION),
    _pack("data"),
])  # fmt: skip
_KEYS = {name: _pack(name) for name in _FIELDS}
# The encode below writes `node`, `allocations`, then these, as `tessera.codec.encode` does.
_TAIL = _FIELDS[2:]
assert _FIELDS[:2] == ("node", "allocations"), "NodeLedger's field order changed: see encode"
assert _TAIL == ("claim", "claims"), "NodeLedger's fields changed: see _pack_tail"
_NIL = _pack(None)


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


class _Wire(NamedTuple):
    """A node's last payload (written or read here) and where its allocations lie in it."""

    node: str  # the entry's `node` (in `head`)
    payload: bytes
    head: bytes  # everything before the first allocation (the allocations' count included)
    offsets: list[int]  # where each allocation's map entry starts, then where the last ends
    uids: list[str]  # the allocations' keys, in order
    allocations: dict[str, Allocation]  # the value's allocations
    claim: Any
    claims: Any
    digests: dict[str, tuple[Allocation, bytes, int]]  # what `_decoded` holds for this value


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


class LedgerCodec:
    """Encode and decode ledger entries, reusing the allocations that did not change."""

    def __init__(self, encode_nodes: int = _ENCODE_NODES) -> None:
        # node -> uid -> (the allocation, its map entry's bytes or b"", the hash of its bytes)
        self._decoded: dict[str, dict[str, tuple[Allocation, bytes, int]]] = {}
        # node -> uid -> (allocation, its key and bytes, their hash), for the nodes written
        # most recently
        self._encoded: OrderedDict[str, dict[str, tuple[Allocation, bytes, int]]] = OrderedDict()
        self._encode_nodes = encode_nodes
        # node -> (claim, claims, the bytes of the fields after `allocations`, uid -> (a claim,
        # its map entry's bytes)) of its last write
        self._tails: dict[str, tuple[Any, Any, bytes, dict[str, tuple[Any, bytes]]]] = {}
        self._interned = _Interned()
        # node -> its last payload and layout, for the nodes written or spliced most recently
        self._wire: dict[str, _Wire] = {}

    # --- encode ---------------------------------------------------------------------------------
    def encode(self, ledger: NodeLedger) -> bytes:
        """The same bytes as `tessera.codec.encode(ledger)`."""
        node = ledger.node
        previous = self._encoded.pop(node, None) or {}
        tail = self._tails.get(node)
        if tail is None or tail[0] is not ledger.claim or tail[1] is not ledger.claims:
            # The fields after `allocations`: claims change on a claim or an Allocate, not on a
            # reservation's or a bind's write (the same objects: mutate functions copy on write).
            tail = self._tails[node] = self._pack_tail(ledger, tail[3] if tail else {})
        # uid -> (allocation, its map entry: key and value, the hash of its value)
        kept: dict[str, tuple[Allocation, bytes, int]] = {}
        head = b"".join([_HEAD, _map_header(len(_FIELDS)), _KEYS["node"], _pack(node),
                         _KEYS["allocations"], _map_header(len(ledger.allocations))])  # fmt: skip
        entries: list[bytes] = []
        append = entries.append
        for uid, allocation in ledger.allocations.items():
            cached = previous.get(uid)
            if cached is None or cached[0] is not allocation:
                packed = _pack(allocation.model_dump(mode="json"))
                cached = (allocation, _pack(uid) + packed, hash(packed))
            kept[uid] = cached
            append(cached[1])
        payload = b"".join([head, *entries, tail[2]])
        self._encoded[node] = kept
        while len(self._encoded) > self._encode_nodes:
            gone, _ = self._encoded.popitem(last=False)
            self._tails.pop(gone, None)
        # What this write leaves in the KV is what the next decode compares against.
        self._decoded[node] = kept
        offsets = list(accumulate(map(len, entries), initial=len(head)))
        self._remember(node, _Wire(
            node, payload, head, offsets, list(ledger.allocations), ledger.allocations,
            ledger.claim, ledger.claims, kept,
        ))  # fmt: skip
        return payload

    def _remember(self, node: str, wire: _Wire) -> None:
        known = self._wire
        known.pop(node, None)
        known[node] = wire  # (insertion order: the least recent first)
        if len(known) > self._encode_nodes:
            del known[next(iter(known))]

    @staticmethod
    def _pack_tail(
        ledger: NodeLedger, before: dict[str, tuple[Any, bytes]]
    ) -> tuple[Any, Any, bytes, dict[str, tuple[Any, bytes]]]:
        """(claim, claims, their bytes as `model_dump` then msgpack write them, each claim's map
        entry). A claim that was in the node's last write is the same object (claims are
        immutable, mutate functions copy on write): its bytes (`before`) are reused, so a
        reservation claiming ahead dumps its own claim only, not the ledger with `include`."""
        claim, claims = ledger.claim, ledger.claims
        if type(claims) is not dict or (claim is not None and type(claim) is not InFlightClaim):
            rest = ledger.model_dump(mode="json", include=set(_TAIL))
            packed = b"".join(_KEYS[name] + _pack(rest[name]) for name in _TAIL)
            return claim, claims, packed, {}
        entries: dict[str, tuple[Any, bytes]] = {}
        parts = [_KEYS["claim"], _NIL if claim is None else _pack(claim.model_dump(mode="json")),
                 _KEYS["claims"], _map_header(len(claims))]  # fmt: skip
        for uid, one in claims.items():
            entry = before.get(uid)
            if entry is None or entry[0] is not one:
                entry = (one, _pack(uid) + _pack(one.model_dump(mode="json")))
            entries[uid] = entry
            parts.append(entry[1])
        return claim, claims, b"".join(parts), entries

    # --- decode ---------------------------------------------------------------------------------
    def decode(self, node: str, payload: bytes) -> NodeLedger:
        """The same value (and the same CodecError) as `tessera.codec.decode(payload,
        NodeLedger)`, decoding only the allocations whose bytes changed."""
        spliced = self._splice(node, payload)
        if spliced is not None:
            return spliced
        self._wire.pop(node, None)
        envelope = wire_fast.split_ledger(payload)
        if envelope is None:
            return self._full(node, payload)  # not canonical: the ordinary decode judges
        data = envelope.data
        if data.allocations is wire_fast.UNSET:
            self.forget(node)
            return wire_fast.ledger_from(data, wire_fast.UNSET)
        previous = self._decoded.get(node, {})
        known: dict[str, tuple[Allocation, bytes, int]] = {}
        merged: dict[str, Allocation] = {}
        for uid, raw in data.allocations.items():
            digest = hash(bytes(raw))
            seen = previous.get(uid)
            if seen is not None and seen[2] == digest:
                allocation = seen[0]
            else:
                fresh = wire_fast.decode_allocation(raw)
                if fresh is None:
                    return self._full(node, payload)  # not canonical: the ordinary decode judges
                allocation = fresh
            merged[uid] = allocation
            known[uid] = (allocation, b"", digest)
        self._decoded[node] = known
        return wire_fast.ledger_from(data, merged)

    def _splice(self, node: str, payload: bytes) -> NodeLedger | None:
        """The entry read against the node's last payload when it differs from it in at most
        one allocation (same key, same place) and the claims; None: decode it otherwise."""
        wire = self._wire.get(node)
        if wire is None:
            return None
        old, offsets = wire.payload, wire.offsets
        start, end = offsets[0], offsets[-1]
        if not payload.startswith(wire.head):
            return None
        # The first allocation whose bytes differ (every one before it is the same bytes).
        lo, hi = 0, len(wire.uids)
        if payload[start:end] != old[start:end]:
            while lo < hi:
                mid = (lo + hi) // 2
                a, b = offsets[lo], offsets[mid + 1]
                if payload[a:b] == old[a:b]:
                    lo = mid + 1
                else:
                    hi = mid
        else:
            lo = len(wire.uids)
        allocations = dict(wire.allocations)
        digests = wire.digests
        if lo < len(wire.uids):
            at = offsets[lo]
            unpacker = msgpack.Unpacker(raw=False)
            try:
                unpacker.feed(memoryview(payload)[at:])
                key = unpacker.unpack()
                value_at = at + unpacker.tell()
                unpacker.skip()
                value_end = at + unpacker.tell()
            except Exception:
                return None  # not one key and one value there: the ordinary decode judges
            uid = wire.uids[lo]
            rest = old[offsets[lo + 1]:end]  # the allocations after it: the same bytes
            if key != uid or payload[value_end:value_end + len(rest)] != rest:
                return None
            value = payload[value_at:value_end]
            allocation = wire_fast.decode_allocation(value)
            if allocation is None:
                return None  # not canonical: the ordinary decode judges
            allocations[uid] = allocation
            digests = dict(digests)
            digests[uid] = (allocation, b"", hash(value))
            shift = value_end - offsets[lo + 1]
            if shift:
                offsets = offsets[:lo + 1] + [o + shift for o in offsets[lo + 1:]]
            end += shift
        tail = payload[end:]
        if tail == old[wire.offsets[-1]:]:
            claim = wire.claim
            claims = dict(wire.claims) if isinstance(wire.claims, dict) else wire.claims
        else:
            decoded = wire_fast.decode_tail(tail)
            if decoded is None:
                return None
            claim, claims = decoded
        ledger = wire_fast.ledger_of(wire.node, allocations, claim, claims)
        self._decoded[node] = digests
        self._remember(node, wire._replace(payload=payload, offsets=offsets,
                                           allocations=allocations, claim=claim, claims=claims,
                                           digests=digests))  # fmt: skip
        return ledger

    def read(self, node: str, payload: bytes) -> NodeLedger | wire_fast.LedgerWire:
        """`decode`, except that an entry of a node this codec holds nothing of (start-up, or a
        node only others write) is checked but not built: a LedgerWire, which the index
        summarises as it is and builds into the same NodeLedger when something needs it."""
        if node in self._decoded:
            return self.decode(node, payload)
        whole = wire_fast.whole_ledger(payload)
        if whole is not None and whole.data.allocations is not wire_fast.UNSET:
            data = whole.data
            data.node = node_name = sys.intern(data.node)
            usage = wire_fast.slim_all(data.allocations, node_name)
            return wire_fast.LedgerWire(data, data.allocations, usage)
        envelope = wire_fast.split_ledger(payload)
        if envelope is None:
            return self._full(node, payload)  # not canonical: the ordinary decode judges
        data = envelope.data
        if data.allocations is wire_fast.UNSET:
            return self.decode(node, payload)
        checked = {}
        for uid, raw in data.allocations.items():
            item = wire_fast.parse_allocation(raw)
            if item is None:
                return self._full(node, payload)
            if not wire_fast.complete(item):
                return self.decode(node, payload)  # fields to default: built at once
            checked[uid] = wire_fast.slim(uid, item)
        return wire_fast.LedgerWire(data, checked)

    def _full(self, node: str, payload: bytes) -> NodeLedger:
        self.forget(node)
        ledger = decode(payload, NodeLedger)  # raises CodecError with the reason
        for allocation in ledger.allocations.values():
            self._interned.slim(allocation)
        return ledger

    def forget(self, node: str) -> None:
        """The node's entry is gone (or unreadable): hold nothing of it."""
        self._wire.pop(node, None)
        self._decoded.pop(node, None)
        self._encoded.pop(node, None)
        self._tails.pop(node, None)


__all__ = ["CodecError", "LedgerCodec"]
