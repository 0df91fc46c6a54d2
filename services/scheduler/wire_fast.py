"""A fast path for decoding ledger entries and registrations: msgspec instead of msgpack+pydantic.

At start-up the scheduler decodes every node's registration and ledger entry once (5,000 nodes:
~80,000 allocations); through msgpack and pydantic that was most of the time to ready. Here the
payload is decoded and type-checked in one pass by msgspec Structs that mirror the pydantic models
(`tessera.models`), and the pydantic objects are then built without validating again.

Exactly the same rules: msgspec runs in strict mode, so it accepts a *subset* of what pydantic
(lax mode) accepts: the canonical form every Tessera writer produces (`str` for str, `int` for
int, int or float for float, `bool` for bool, every constraint such as `ge=0`). Anything else
(a key it does not know, an int written as a float, bytes for a str, a constraint broken, a
payload that is not msgpack) makes the fast path answer None, and the caller decodes the payload
the ordinary way (`tessera.codec.decode`), which accepts or refuses it with its usual error.
Unknown keys are refused here (`forbid_unknown_fields`) so that every byte of an accepted payload
was type-checked: msgpack's own decode rejects things (non-string map keys, bad UTF-8) inside
values pydantic would ignore. tests/scheduler/test_wire_fast.py checks the two paths against each
other on generated valid and hostile payloads.

Built objects: fields a payload omits get the pydantic field's default (factories called, as
pydantic does) and are left out of the fields-set; instance dicts are the class's key-sharing
dicts, fields-sets are shared per distinct set, and repeated strings (namespace, node, GPU UUID
and type, device mode) are interned: a decoded allocation takes about a sixth of the memory a
validated one does. Nothing in the scheduler modifies these objects in place (copy-on-write).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from pydantic import BaseModel

from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
)
from tessera.validation import MAX_CONTAINERS

NonNegative = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
_State = Literal["reserved", "bound", "allocated", "released", "failed"]
_REQUIRED = object()  # a field without a default
# MIG records (a grant's instance, a card's dynamic-MIG capability, its static instances) are
# rare and carry rules of their own: the fast path takes only their absence, anything else is
# decoded the ordinary way.
_Empty = Annotated[list[Any], Meta(max_length=0)]

# Each model's fields in order: (name, wire type, whether pydantic has a default for it).
# Strict msgspec types; `ge` as the pydantic Field says. Nested models by name.
_SPECS: dict[str, list[tuple[str, Any, bool]]] = {
    "Grant": [("uuid", str, False), ("type", str, False), ("memory_mib", NonNegative, False),
              ("cores", NonNegative, False), ("mig", None, True),
              ("memory_limit_mib", NonNegative, True),
              ("cores_limit", Annotated[int, Meta(ge=0, le=100)], True)],
    "Allocation": [
        ("pod_uid", str, False), ("namespace", str, False), ("name", str, False),
        ("node", str, False), ("containers", "list[list[Grant]]", False),
        ("init_count", NonNegative, True), ("init_done", bool, True), ("state", _State, True),
        ("created_at", float, True), ("updated_at", float, True),
        ("expires_at", float | None, True), ("priority", int, True), ("core_policy", str, True),
        ("scrub_on_free", bool, True), ("reason", str, True), ("container_names", list[str], True),
        ("quota_held", bool, True), ("sidecars", list[int], True), ("preempted_by", str, True),
        ("preempted_until", float | None, True),
        ("memory_reclaim", Literal["fail", "evict"], True),
        ("memory_wait_s", Annotated[float, Meta(ge=0, le=3600)], True),
    ],
    "Claim": [("pod_uid", str, False), ("namespace", str, False), ("name", str, False),
              ("taken_at", float, True), ("expires_at", float, False), ("holder", str, True)],
    "Ledger": [("node", str, False), ("allocations", "dict[str, Allocation]", True),
               ("claim", "Claim | None", True), ("claims", "dict[str, Claim]", True)],
    "Device": [
        ("uuid", str, False), ("index", NonNegative, False), ("type", str, False),
        ("memory_mib", NonNegative, False), ("physical_memory_mib", NonNegative, True),
        ("cores", NonNegative, True), ("split_count", Positive, True), ("numa", int, True),
        ("healthy", bool, True), ("mode", str, True), ("links", dict[str, int], True),
        ("mig", None, True), ("mig_instances", _Empty, True),
        ("part_ids", Annotated[list[str], Meta(max_length=8)], True),
    ],
    "Registration": [("node", str, False), ("devices", "list[Device]", False),
                     ("heartbeat_at", float, True), ("agent_version", str, True)],
}  # fmt: skip
_MODELS = {
    "Grant": DeviceGrant, "Allocation": Allocation, "Claim": InFlightClaim, "Ledger": NodeLedger,
    "Device": DeviceInfo, "Registration": NodeRegistration,
}  # fmt: skip


class _AllocationReads(Struct):
    """What the index reads of an allocation, borrowed from the model (one home for the rules):
    a checked allocation answers these before, or without, being built (LedgerWire)."""

    active = Allocation.active
    app_grants = Allocation.app_grants
    init_grants = Allocation.init_grants


def _structs(complete: bool) -> dict[str, type[Struct]]:
    """One Struct per model. `complete`: every field required (what every Tessera writer
    writes: nothing to default); else the optional ones default to UNSET."""
    made: dict[str, type[Struct]] = {}

    def resolve(kind: Any) -> Any:
        if not isinstance(kind, str):
            return kind
        return eval(kind, {"list": list, "dict": dict, "str": str, **made})

    for name, spec in _SPECS.items():
        fields = []
        for field_name, kind, optional in spec:
            kind = resolve(kind)
            if optional and not complete:
                fields.append((field_name, kind | UnsetType, UNSET))
            else:
                fields.append((field_name, kind))
        made[name] = msgspec.defstruct(
            f"{name}{'Complete' if complete else 'Partial'}", fields, kw_only=True,
            forbid_unknown_fields=True, bases=(_AllocationReads,) if name == "Allocation" else None,
            gc=False,  # no cycles through them: the cyclic GC need not walk 100,000s of them
        )  # fmt: skip
    return made


_COMPLETE = _structs(True)
_PARTIAL = _structs(False)
_FULL_ALLOCATION = _COMPLETE["Allocation"]


def _envelope(data: type[Struct]) -> type[Struct]:
    return msgspec.defstruct(
        f"Envelope{data.__name__}", [("schema", str), ("version", int), ("data", data)],
        forbid_unknown_fields=True,
    )  # fmt: skip


_ALLOCATION_DECODERS = [msgspec.msgpack.Decoder(s["Allocation"]) for s in (_COMPLETE, _PARTIAL)]
_REGISTRATION_DECODERS = [
    msgspec.msgpack.Decoder(_envelope(s["Registration"])) for s in (_COMPLETE, _PARTIAL)
]
RegistrationEnvelope = Any  # a decoded registration envelope (either variant)
_STATES = {state.value: state for state in AllocationState}
_intern = sys.intern


def _check_specs() -> None:
    """The specs name exactly the models' fields, in order, optional where pydantic has a
    default: a model change that forgets this file fails at import, not silently."""
    for name, spec in _SPECS.items():
        fields = _MODELS[name].model_fields
        mine = [(f, optional) for f, _kind, optional in spec]
        theirs = [(f, not info.is_required()) for f, info in fields.items()]
        if mine != theirs:
            raise RuntimeError(f"wire_fast: {name} does not mirror {_MODELS[name].__name__}")


_check_specs()


class _Builder:
    """Pydantic instances from checked values, without validating again."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model
        self.names = tuple(model.model_fields)
        self.full = set(self.names)
        self.sets: dict[frozenset[str], set[str]] = {}

    def build(self, values: Any, complete: bool = True) -> Any:
        """`values`: every field's, in order (with UNSET where the payload has none unless
        `complete`)."""
        if not complete:
            return self._build_defaults(values)
        obj = self.model.__new__(self.model)
        obj.__dict__.update(zip(self.names, values, strict=True))  # the key-sharing dict
        setter = object.__setattr__
        setter(obj, "__pydantic_fields_set__", self.full)
        setter(obj, "__pydantic_extra__", None)
        setter(obj, "__pydantic_private__", None)
        return obj

    def _build_defaults(self, values: Any) -> Any:
        data: dict[str, Any] = {}
        given = []
        fields = self.model.model_fields
        for name, value in zip(self.names, values, strict=True):
            if value is UNSET:
                value = fields[name].get_default(call_default_factory=True, validated_data=data)
            else:
                given.append(name)
            data[name] = value
        key = frozenset(given)
        shared = self.sets.get(key)
        if shared is None:
            shared = self.sets[key] = set(key)
        obj = self.model.__new__(self.model)
        obj.__dict__.update(data)
        setter = object.__setattr__
        setter(obj, "__pydantic_fields_set__", shared)
        setter(obj, "__pydantic_extra__", None)
        setter(obj, "__pydantic_private__", None)
        return obj


_GRANT = _Builder(DeviceGrant)
_ALLOCATION = _Builder(Allocation)
_CLAIM = _Builder(InFlightClaim)
_LEDGER = _Builder(NodeLedger)
_DEVICE = _Builder(DeviceInfo)
_REGISTRATION = _Builder(NodeRegistration)
_STATES: dict[Any, Any] = {state.value: state for state in AllocationState}
_STATES[UNSET] = UNSET
_astuple = msgspec.structs.astuple
_intern = sys.intern
_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)


def _decode(decoders: list[msgspec.msgpack.Decoder], payload: bytes) -> Any:
    """The complete variant first (the common case), then the one with defaults; None when
    neither accepts the payload."""
    try:
        return decoders[0].decode(payload)
    except msgspec.ValidationError:
        pass
    except _ERRORS:
        return None
    try:
        return decoders[1].decode(payload)
    except _ERRORS:
        return None


def _allocation(item: Any) -> Allocation:
    values = list(_astuple(item))
    values[1] = _intern(values[1])  # namespace
    values[3] = _intern(values[3])  # node
    grant = _GRANT.build
    values[4] = [
        [grant((_intern(g.uuid), _intern(g.type), g.memory_mib, g.cores, g.mig,
                g.memory_limit_mib, g.cores_limit),
               g.mig is not UNSET and g.memory_limit_mib is not UNSET
               and g.cores_limit is not UNSET) for g in grants]
        for grants in values[4]
    ]  # fmt: skip
    values[7] = _STATES[values[7]]
    if type(values[15]) is tuple:  # slimmed (see `slim`)
        values[15] = list(values[15])
    if type(values[17]) is tuple:
        values[17] = list(values[17])
    return _ALLOCATION.build(values, type(item) is _FULL_ALLOCATION)


def _claim(item: Any) -> Any:
    if item is None or item is UNSET:
        return item
    values = list(_astuple(item))
    values[1] = _intern(values[1])
    return _CLAIM.build(values, UNSET not in values)


_READABLE = {
    model: frozenset(model.READABLE_VERSIONS | {model.SCHEMA_VERSION})  # type: ignore[attr-defined]
    for model in (NodeLedger, NodeRegistration)
}  # fmt: skip


def _schema_ok(envelope: Any, model: type[BaseModel]) -> bool:
    return envelope.schema == model.__name__ and envelope.version in _READABLE[model]


# A ledger entry with each allocation left as its msgpack bytes (msgspec checks they are one
# well-formed value): decoded one by one, only those whose bytes changed (ledger_codec.py).
_Claim = _PARTIAL["Claim"]
_SPLIT_DECODER = msgspec.msgpack.Decoder(_envelope(msgspec.defstruct("LedgerSplit", [
    ("node", str),
    ("allocations", dict[str, msgspec.Raw] | UnsetType, UNSET),
    ("claim", _Claim | None | UnsetType, UNSET),
    ("claims", dict[str, _Claim] | UnsetType, UNSET),
], kw_only=True, forbid_unknown_fields=True)))  # fmt: skip


# The same with every allocation decoded at once, complete (start-up: one C call per node).
_WHOLE_DECODER = msgspec.msgpack.Decoder(_envelope(msgspec.defstruct("LedgerWhole", [
    ("node", str),
    ("allocations", dict[str, _FULL_ALLOCATION] | UnsetType, UNSET),
    ("claim", _Claim | None | UnsetType, UNSET),
    ("claims", dict[str, _Claim] | UnsetType, UNSET),
], kw_only=True, forbid_unknown_fields=True)))  # fmt: skip


def whole_ledger(payload: bytes) -> Any | None:
    """The checked entry with every allocation complete (a Struct with all its fields), or
    None: not so (split_ledger then tells which allocation, if any, is not canonical)."""
    try:
        envelope = _WHOLE_DECODER.decode(payload)
    except _ERRORS:
        return None
    return envelope if _schema_ok(envelope, NodeLedger) else None


def split_ledger(payload: bytes) -> Any | None:
    """The checked entry with its allocations still encoded (`.data.allocations`: uid -> the
    allocation's bytes, or UNSET), or None: not in the canonical form (decode it the ordinary
    way, which accepts it or words the refusal)."""
    try:
        envelope = _SPLIT_DECODER.decode(payload)
    except _ERRORS:
        return None
    return envelope if _schema_ok(envelope, NodeLedger) else None


def ledger_from(data: Any, allocations: dict[str, Allocation] | Any) -> NodeLedger:
    """The NodeLedger of a split entry's data, with its allocations decoded (or UNSET)."""
    claims = data.claims
    if claims is not UNSET:
        claims = {uid: _claim(c) for uid, c in claims.items()}
    values = (data.node, allocations, _claim(data.claim), claims)
    return _LEDGER.build(values, UNSET not in values)


# The fields of a ledger entry after its allocations, as a map of their own: what follows the
# last allocation in every canonical entry (ledger_codec.py splices entries that changed in one
# allocation and these; both are required, so anything else is decoded the ordinary way).
_TAIL_DECODER = msgspec.msgpack.Decoder(msgspec.defstruct("LedgerTail", [
    ("claim", _Claim | None), ("claims", dict[str, _Claim]),
], kw_only=True, forbid_unknown_fields=True))  # fmt: skip
_TAIL_HEADER = b"\x82"  # a map of those two fields


def decode_tail(tail: bytes) -> tuple[Any, Any] | None:
    """(claim, claims) built from the bytes of an entry's last two fields (`claim`, `claims`,
    keys included), or None when they are not exactly those in the canonical form."""
    try:
        data = _TAIL_DECODER.decode(_TAIL_HEADER + tail)
    except _ERRORS:
        return None
    return _claim(data.claim), {uid: _claim(c) for uid, c in data.claims.items()}


def ledger_of(node: str, allocations: dict[str, Allocation], claim: Any, claims: Any) -> NodeLedger:
    """A NodeLedger from values already built (every field given, as `ledger_from` builds a
    complete entry)."""
    return _LEDGER.build((node, allocations, claim, claims))


def decode_allocation(raw: Any) -> Allocation | None:
    """One allocation's msgpack map as pydantic would validate it, or None (see split_ledger)."""
    item = _decode(_ALLOCATION_DECODERS, raw)
    return None if item is None else _allocation(item)


def decode_ledger(payload: bytes) -> NodeLedger | None:
    """The entry as `tessera.codec.decode(payload, NodeLedger)` reads it, or None (not in the
    canonical form)."""
    envelope = split_ledger(payload)
    if envelope is None:
        return None
    data = envelope.data
    allocations = data.allocations
    if allocations is not UNSET:
        decoded = {}
        for uid, raw in allocations.items():
            allocation = decode_allocation(raw)
            if allocation is None:
                return None
            decoded[uid] = allocation
        allocations = decoded
    return ledger_from(data, allocations)


def parse_registration(payload: bytes) -> RegistrationEnvelope | None:
    """The checked registration envelope, or None (not canonical: decode it the ordinary way)."""
    envelope = _decode(_REGISTRATION_DECODERS, payload)
    if envelope is None or not _schema_ok(envelope, NodeRegistration):
        return None
    return envelope


def registration_from(envelope: RegistrationEnvelope) -> NodeRegistration:
    data = envelope.data
    devices = []
    build, full = _DEVICE.build, _COMPLETE["Device"]
    for device in data.devices:
        values = list(_astuple(device))
        values[0] = _intern(values[0])  # uuid
        values[2] = _intern(values[2])  # type
        if type(values[9]) is str:
            values[9] = _intern(values[9])  # mode
        devices.append(build(values, type(device) is full))
    return _REGISTRATION.build(
        (data.node, devices, data.heartbeat_at, data.agent_version),
        type(data) is _COMPLETE["Registration"],
    )


class RegistrationWire:
    """A checked registration whose devices are not built into pydantic objects yet (the
    registration's LedgerWire): its devices are the checked Structs, with the attributes of
    `DeviceInfo` (validation, the index's rows and cards read them as they are), and
    `materialize()` builds the NodeRegistration `tessera.codec.decode` gives when something
    needs the model. Only a complete payload (every field given, as every node agent writes it)
    is kept so: nothing to default. Read-only, like every value the index holds."""

    __slots__ = ("_version", "agent_version", "devices", "heartbeat_at", "node")

    def __init__(
        self, node: str, devices: list[Any], heartbeat_at: float, agent_version: str,
        version: int,
    ) -> None:  # fmt: skip
        self.node = node
        self.devices = devices
        self.heartbeat_at = heartbeat_at
        self.agent_version = agent_version
        self._version = version  # the envelope's (the fingerprint covers it)

    def materialize(self) -> NodeRegistration:
        build = _DEVICE.build
        devices = [build(list(_astuple(d))) for d in self.devices]
        return _REGISTRATION.build((self.node, devices, self.heartbeat_at, self.agent_version))

    def with_heartbeat(self, heartbeat_at: float) -> RegistrationWire:
        """The same registration (the same devices list) with a new heartbeat."""
        return RegistrationWire(self.node, self.devices, heartbeat_at, self.agent_version,
                                self._version)  # fmt: skip

    def fingerprint(self) -> int:
        """`fingerprint` of the envelope it was read from."""
        return hash((NodeRegistration.__name__, self._version, self.node, self.agent_version,
                     _COMPLETE["Registration"].__name__, _ENCODE(self.devices)))  # fmt: skip


def registration_wire(envelope: RegistrationEnvelope) -> RegistrationWire | None:
    """The checked registration kept unbuilt (strings interned), or None: a payload that leaves
    fields to default (build it: `registration_from`)."""
    data = envelope.data
    if type(data) is not _COMPLETE["Registration"]:
        return None
    full = _COMPLETE["Device"]
    devices = data.devices
    for device in devices:
        if type(device) is not full:
            return None
    for device in devices:
        device.uuid = _intern(device.uuid)
        device.type = _intern(device.type)
        device.mode = _intern(device.mode)
    return RegistrationWire(data.node, devices, data.heartbeat_at, data.agent_version,
                            envelope.version)  # fmt: skip


_ENCODE = msgspec.msgpack.Encoder().encode


def fingerprint(envelope: RegistrationEnvelope) -> int | None:
    """A hash of everything in a checked registration but its heartbeat (None without one:
    such a payload never matches)."""
    data = envelope.data
    if data.heartbeat_at is UNSET:
        return None
    return hash((envelope.schema, envelope.version, data.node, data.agent_version,
                 type(data).__name__, _ENCODE(data.devices)))  # fmt: skip


def parse_allocation(raw: Any) -> Any | None:
    """One allocation checked but not built: a Struct with the model's fields (None: not
    canonical). `complete(item)`: it has every field (nothing left to default)."""
    return _decode(_ALLOCATION_DECODERS, raw)


def complete(item: Any) -> bool:
    return type(item) is _FULL_ALLOCATION


def slim(uid: str, item: Any, node: str = "") -> Any:
    """A checked allocation kept as it is (LedgerWire) shares the strings many repeat: its
    namespace, node (`node`, interned, when it is the entry's), policy, GPU UUIDs and types
    interned, its pod uid the map's key."""
    intern = _intern
    item.namespace = intern(item.namespace)
    item.node = node if node and item.node == node else intern(item.node)
    item.core_policy = intern(item.core_policy)
    if item.pod_uid == uid:
        item.pod_uid = uid
    if not item.container_names:
        item.container_names = ()  # read-only here; built as a new list (_allocation)
    if not item.sidecars:
        item.sidecars = ()
    for grants in item.containers:
        for grant in grants:
            grant.uuid = intern(grant.uuid)
            grant.type = intern(grant.type)
    return item


_HOLDING = frozenset({AllocationState.BOUND.value, AllocationState.ALLOCATED.value})


def slim_all(allocations: dict[str, Any], node: str) -> dict[str, list[int]] | None:
    """`slim` of every allocation of one entry (`node`: its node name, interned), in one pass
    that also counts what they hold per GPU when that needs no clock.

    A string equal to the one before it in the entry (the namespace, policy, GPU type, often
    the GPU) takes that one's shared copy without being hashed again; the strings are shared
    as `slim` shares them (interned), so the memory is the same.

    Returns GPU UUID -> [memory, cores, slots] held, exactly what
    `node_usage.NodeUsage._count_all` counts at any time, when every allocation is bound or
    allocated, unmarked and without init containers (such an allocation always counts: the
    common entry) and passes the checks of `tessera.validation.ledger_problem` that read it
    alone (filed under its pod uid, on this node, at most MAX_CONTAINERS containers, no GPU
    twice in one container); None when one is not (the index then counts at its time, and
    validation judges the entry allocation by allocation). So a count also tells validation
    that only the sums per GPU are left to judge against the node's cards
    (`validation.LedgerGuard`)."""
    intern = _intern
    holding = _HOLDING
    most_containers = MAX_CONTAINERS
    usage: dict[str, list[int]] | None = {}
    namespace = policy = uuid = kind = None
    for uid, item in allocations.items():
        value = item.namespace
        if value != namespace:
            namespace = intern(value)
        item.namespace = namespace
        value = item.node
        if value == node:
            item.node = node
        else:
            item.node = intern(value)
            usage = None
        value = item.core_policy
        if value != policy:
            policy = intern(value)
        item.core_policy = policy
        if item.pod_uid == uid:
            item.pod_uid = uid
        else:
            usage = None
        if not item.container_names:
            item.container_names = ()
        if not item.sidecars:
            item.sidecars = ()
        containers = item.containers
        if usage is not None and (
            item.state not in holding or item.preempted_by or item.init_count
            or item.preempted_until is not None or len(containers) > most_containers
        ):  # fmt: skip
            usage = None
        for grants in containers:
            if usage is not None and len(grants) > 1 and (
                len({grant.uuid for grant in grants}) != len(grants)
            ):  # fmt: skip
                usage = None
            for grant in grants:
                value = grant.uuid
                if value != uuid:
                    uuid = intern(value)
                grant.uuid = uuid
                value = grant.type
                if value != kind:
                    kind = intern(value)
                grant.type = kind
                if usage is not None:
                    used = usage.get(uuid)
                    if used is None:
                        usage[uuid] = [grant.memory_mib, grant.cores, 1]
                    else:
                        used[0] += grant.memory_mib
                        used[1] += grant.cores
                        used[2] += 1
    return usage


class LedgerWire:
    """A checked ledger entry whose allocations are not built into pydantic objects yet: the
    index summarises it (cards, pods, claims) as it is, and `materialize()` builds the
    NodeLedger (the same value `tessera.codec.decode` gives) when something needs the models.
    At start-up most nodes are never touched before their next change, so most entries are
    never built. Read-only, like every ledger value the index holds."""

    __slots__ = ("_claims_given", "allocations", "claim", "claims", "holding", "node", "usage")
    in_flight = NodeLedger.in_flight

    def __init__(
        self, data: Any, allocations: dict[str, Any], usage: dict[str, list[int]] | None = None
    ) -> None:
        claims = data.claims
        # What the allocations hold per GPU, when `slim_all` could count it without a clock
        # (taken once by the index at start-up, then dropped: `take_usage`).
        self.usage = usage
        # Every allocation bound or allocated and unmarked (so active, none reserved): known
        # when `slim_all` counted them.
        self.holding = usage is not None
        self.node: str = data.node
        self.allocations = allocations  # uid -> complete allocation Struct
        self.claim: InFlightClaim | None = _claim(data.claim) if data.claim is not UNSET else None
        self.claims: dict[str, InFlightClaim] = (
            {} if claims is UNSET else {uid: _claim(c) for uid, c in claims.items()}
        )
        self._claims_given = (data.claim is not UNSET, claims is not UNSET)

    def take_usage(self) -> dict[str, list[int]] | None:
        """The usage `slim_all` counted, once (None after, or when it could not)."""
        usage, self.usage = self.usage, None
        return usage

    def materialize(self) -> NodeLedger:
        allocations = {uid: _allocation(a) for uid, a in self.allocations.items()}
        given_claim, given_claims = self._claims_given
        values = (
            self.node, allocations, self.claim if given_claim else UNSET,
            self.claims if given_claims else UNSET,
        )  # fmt: skip
        return _LEDGER.build(values, UNSET not in values)
