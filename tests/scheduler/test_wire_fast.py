"""The scheduler's fast decode (msgspec, wire_fast.py) against the shared codec (msgpack +
pydantic): on generated valid and hostile payloads the fast path either gives exactly the value
`tessera.codec.decode` gives (same fields, same types, same fields-set) or declines, and the
scheduler's codecs then give the same value or the same CodecError as the shared codec. The
index summarises an entry the same whether it holds the checked wire form or the built models."""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from tessera.scheduler import wire_fast
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.ledger_codec import LedgerCodec
from tessera.scheduler.registration_codec import RegistrationCodec

from tessera.codec import CodecError, decode, encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
)
from tessera.validation import Bounds, ledger_problem, registration_problem

# Values a hostile writer may put anywhere: wrong types, lax-mode coercions pydantic accepts
# (1.0 for 1, "1" for 1, 1 for True, bytes for str), broken constraints, odd containers.
HOSTILE: list[Any] = [
    None, True, False, 0, 1, -1, 2**63, 2**64 - 1, -(2**63), 0.0, 1.0, 1.5, -0.0, math.inf,
    math.nan, "", "x", "1", "true", "reserved", "bound", "RESERVED", b"x", b"\xff", [], [1],
    [[]], [["x"]], {}, {"a": 1}, {1: 2}, {"uuid": "g"}, msgpack.ExtType(5, b"x"),
]  # fmt: skip


def strict_same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (a float is not an int; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strict_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(strict_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, BaseModel):
        return (
            a.__pydantic_fields_set__ == b.__pydantic_fields_set__
            and strict_same(dict(a.__dict__), dict(b.__dict__))
        )
    return a == b


def grant_data(i: int) -> dict[str, Any]:
    return DeviceGrant(
        uuid=f"GPU-{i}", type="NVIDIA-H100", memory_mib=1000 * i, cores=10
    ).model_dump(mode="json")


def allocation_data(uid: str, node: str = "n1", **extra: Any) -> dict[str, Any]:
    value = Allocation(
        pod_uid=uid, namespace="ns", name=f"pod-{uid}", node=node,
        containers=[[DeviceGrant(uuid="GPU-0", type="NVIDIA-H100", memory_mib=1000, cores=10)],
                    []],
        state=AllocationState.RESERVED, created_at=1.0, updated_at=2.0, expires_at=30.0,
        init_count=1, sidecars=[0], container_names=["init", "main"],
    )  # fmt: skip
    return value.model_dump(mode="json") | extra


def ledger_data() -> dict[str, Any]:
    claim = InFlightClaim(pod_uid="u1", namespace="ns", name="pod-u1", taken_at=1.0,
                          expires_at=9.0, holder="a")  # fmt: skip
    return {
        "node": "n1",
        "allocations": {"u1": allocation_data("u1"), "u2": allocation_data("u2")},
        "claim": None,
        "claims": {"u1": claim.model_dump(mode="json")},
    }


def envelope(data: Any, schema: str = "NodeLedger", version: Any = 1) -> bytes:
    return msgpack.packb({"schema": schema, "version": version, "data": data}, use_bin_type=True)


def paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a nested value (dict keys and list positions)."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += paths(v, (*prefix, i))
    return out


def mutate(data: Any, path: tuple, how: str, value: Any) -> Any:
    """A copy of `data` with the value at `path` replaced, dropped, or given an extra key."""
    data = msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False,
                           strict_map_key=False)  # fmt: skip
    if not path:
        return value if how == "replace" else data
    parent = data
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if how == "replace":
        parent[last] = value
    elif how == "drop" and isinstance(parent, dict):
        del parent[last]
    elif how == "extra" and isinstance(parent[last], dict):
        parent[last]["unexpected"] = value
    return data


def check_ledger(payload: bytes) -> None:
    # Fields a payload omits may default to now(): one clock for both paths.
    with mock.patch("time.time", return_value=1234.5):
        _check_ledger(payload)


def _check_ledger(payload: bytes) -> None:
    try:
        expected: NodeLedger | None = decode(payload, NodeLedger)
        error = ""
    except CodecError as exc:
        expected, error = None, str(exc)
    fast = wire_fast.decode_ledger(payload)
    if fast is not None:
        assert expected is not None, f"fast path accepted what pydantic refuses: {error}"
        assert strict_same(fast, expected)
        for uid, allocation in fast.allocations.items():
            assert strict_same(allocation, expected.allocations[uid])
            assert strict_same(allocation.containers, expected.allocations[uid].containers)
    for warm in (False, True):
        codec = LedgerCodec()
        if warm:  # a previous valid value of the node must not mask anything
            codec.decode("n1", envelope(ledger_data()))
        try:
            ours = codec.decode("n1", payload)
        except CodecError as exc:
            assert str(exc) == error
        else:
            assert expected is not None and strict_same(ours, expected)
            for uid, allocation in ours.allocations.items():
                assert strict_same(allocation, expected.allocations[uid])
        try:
            read = LedgerCodec().read("n1", payload)
        except CodecError as exc:
            assert str(exc) == error
        else:
            built = read.materialize() if isinstance(read, wire_fast.LedgerWire) else read
            assert expected is not None and strict_same(built, expected)
            for uid, allocation in built.allocations.items():
                assert strict_same(allocation, expected.allocations[uid])


LEDGER_PATHS = paths(ledger_data())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(LEDGER_PATHS), st.sampled_from(["replace", "drop", "extra"]),
                  st.sampled_from(HOSTILE)),
        min_size=0, max_size=3,
    ),
    st.sampled_from([1, 2, True, 1.0, "1", None]),
)  # fmt: skip
def test_hostile_ledger_entries_are_judged_as_the_shared_codec_judges_them(
    changes: list[tuple[tuple, str, Any]], version: Any
) -> None:
    data: Any = ledger_data()
    for path, how, value in changes:
        try:
            data = mutate(data, path, how, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed the place
    try:
        payload = envelope(data, version=version)
    except (TypeError, ValueError, OverflowError):
        return
    check_ledger(payload)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_bytes_are_judged_as_the_shared_codec_judges_them(data: st.DataObject) -> None:
    payload = bytearray(envelope(ledger_data()))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    check_ledger(bytes(payload))


@pytest.mark.parametrize("payload", [
    envelope(ledger_data()),
    envelope({"node": "n1"}),  # every optional field missing: defaults, fields-set as pydantic
    envelope({"node": "n1", "allocations": {"u": {k: v for k, v in allocation_data("u").items()
                                                  if k in ("pod_uid", "namespace", "name",
                                                           "node", "containers")}}}),
    envelope(ledger_data(), version=True),  # pydantic's path accepts it; the fast one declines
    envelope(ledger_data()) + b"\x00",  # trailing bytes
    envelope({"node": "n1", "allocations": {"u1": allocation_data("u1", priority=True)}}),
    envelope({"node": "n1", "allocations": {"u1": allocation_data("u1", reason=b"\xff")}}),
    b"\xa2\xff\xfe",
])  # fmt: skip
def test_edge_cases(payload: bytes) -> None:
    check_ledger(payload)


def test_canonical_entries_take_the_fast_path() -> None:
    value = decode(envelope(ledger_data()), NodeLedger)
    assert wire_fast.decode_ledger(encode(value)) is not None
    wire = LedgerCodec().read("n1", encode(value))
    assert isinstance(wire, wire_fast.LedgerWire)
    assert wire.materialize() == value


def test_the_index_summarises_the_wire_form_as_the_built_one() -> None:
    registration = NodeRegistration(node="n1", devices=[
        DeviceInfo(uuid=f"GPU-{i}", index=i, type="NVIDIA-H100", memory_mib=80_000)
        for i in range(2)
    ], heartbeat_at=1.0)  # fmt: skip
    payload = envelope(ledger_data())
    built, lazy = ClusterIndex(), ClusterIndex()
    for index, value in ((built, decode(payload, NodeLedger)),
                         (lazy, LedgerCodec().read("n1", payload))):  # fmt: skip
        index.set_registration("n1", registration, 5.0)
        index.set_ledger("n1", value, 1, 5.0)
    assert isinstance(lazy.entries["n1"].view, wire_fast.LedgerWire)
    assert lazy.entries["n1"].cards == built.entries["n1"].cards
    assert lazy.pod_nodes == built.pod_nodes and lazy.pod_uids == built.pod_uids
    assert lazy.sweepable == built.sweepable
    assert lazy.claims_held(5.0) == built.claims_held(5.0) == 1
    assert lazy.entries["n1"].reserved_until == built.entries["n1"].reserved_until
    for name in ("free_gpus", "card_mem", "card_cores", "scores", "busy"):
        assert (getattr(lazy, name) == getattr(built, name)).all()
    # First use builds the models: the value the shared codec reads.
    assert lazy.entries["n1"].ledger == built.entries["n1"].ledger
    assert isinstance(lazy.entries["n1"].view, NodeLedger)


def registration_payload(**changes: Any) -> bytes:
    value = NodeRegistration(node="n1", devices=[
        DeviceInfo(uuid="GPU-0", index=0, type="NVIDIA-H100", memory_mib=80_000,
                   links={"GPU-1": 60})
    ], heartbeat_at=1.0)  # fmt: skip
    data = value.model_dump(mode="json") | changes
    return envelope(data, schema="NodeRegistration")


REGISTRATION_PATHS = paths(msgpack.unpackb(registration_payload())["data"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(REGISTRATION_PATHS),
                  st.sampled_from(["replace", "drop", "extra"]), st.sampled_from(HOSTILE)),
        min_size=0, max_size=3,
    )
)  # fmt: skip
def test_hostile_registrations_are_judged_as_the_shared_codec_judges_them(
    changes: list[tuple[tuple, str, Any]],
) -> None:
    data: Any = msgpack.unpackb(registration_payload())["data"]
    for path, how, value in changes:
        try:
            data = mutate(data, path, how, value)
        except (KeyError, IndexError, TypeError):
            continue
    try:
        payload = envelope(data, schema="NodeRegistration")
    except (TypeError, ValueError, OverflowError):
        return
    with mock.patch("time.time", return_value=1234.5):
        check_registration(payload)


def check_registration(payload: bytes) -> None:
    try:
        expected: NodeRegistration | None = decode(payload, NodeRegistration)
        error = ""
    except CodecError as exc:
        expected, error = None, str(exc)
    parsed = wire_fast.parse_registration(payload)
    if parsed is not None:
        assert expected is not None
        assert strict_same(wire_fast.registration_from(parsed), expected)
    codec = RegistrationCodec()
    try:
        ours = codec.decode(payload)
    except CodecError as exc:
        assert str(exc) == error
    else:
        assert expected is not None and strict_same(ours, expected)
    try:
        read = RegistrationCodec().read(payload)
    except CodecError as exc:
        assert str(exc) == error
    else:  # kept unbuilt or built: the same value, judged the same by validation
        assert expected is not None
        built = read.materialize() if isinstance(read, wire_fast.RegistrationWire) else read
        assert strict_same(built, expected)
        bounds = Bounds()
        assert registration_problem("n1", read, bounds) == registration_problem(
            "n1", expected, bounds
        )
    # A heartbeat shortcut is taken only for a payload equal to an accepted one but for it.
    good = registration_payload()
    codec.accepted("n1", good, codec.decode(good))
    beat = codec.heartbeat_only("n1", payload)
    if beat is not None:
        assert expected is not None and strict_same(beat, expected)


@pytest.mark.parametrize("beat", [math.nan, math.inf, 5, 2.5])
def test_heartbeats_of_any_float_reuse_the_registration_as_a_decode_would_read_them(
    beat: float,
) -> None:
    payload = registration_payload(heartbeat_at=beat)
    with mock.patch("time.time", return_value=1234.5):
        check_registration(payload)


def test_a_slimmed_entry_builds_exactly_the_decoded_value() -> None:
    """Kept unbuilt, empty lists are shared and strings interned; built, it is the value the
    shared codec reads, type for type (lists, not the shared empties)."""
    data = ledger_data()
    data["allocations"]["u2"] |= {"container_names": [], "sidecars": [], "init_count": 0}
    payload = envelope(data)
    wire = LedgerCodec().read("n1", payload)
    assert isinstance(wire, wire_fast.LedgerWire)
    built = wire.materialize()
    expected = decode(payload, NodeLedger)
    assert strict_same(built, expected)
    for uid, allocation in built.allocations.items():
        assert strict_same(allocation, expected.allocations[uid])
        assert strict_same(allocation.containers, expected.allocations[uid].containers)


def test_a_registration_kept_unbuilt_is_read_validated_and_built_as_the_decoded_one() -> None:
    payload = registration_payload()
    codec = RegistrationCodec()
    wire = codec.read(payload)
    assert isinstance(wire, wire_fast.RegistrationWire)
    expected = decode(payload, NodeRegistration)
    assert strict_same(wire.materialize(), expected)
    # A bad amount is refused with the same sentence either way (one check per GPU shape).
    bad = registration_payload(devices=[
        DeviceInfo(uuid=f"GPU-{i}", index=i, type="NVIDIA-H100", memory_mib=900_000)
        .model_dump(mode="json") for i in range(2)
    ])  # fmt: skip
    problem = registration_problem("n1", codec.read(bad), Bounds())
    assert problem == registration_problem("n1", decode(bad, NodeRegistration), Bounds())
    assert problem is not None and "GPU 'GPU-0'" in problem.detail
    # A heartbeat of it keeps the devices (nothing to rebuild) and reads as a decode would.
    codec.accepted("n1", payload, wire)
    beat = codec.heartbeat_only("n1", registration_payload(heartbeat_at=7.0))
    assert isinstance(beat, wire_fast.RegistrationWire) and beat.devices is wire.devices
    assert strict_same(beat.materialize(), decode(registration_payload(heartbeat_at=7.0),
                                                  NodeRegistration))  # fmt: skip
    assert codec.heartbeat_only("n1", registration_payload(agent_version="9")) is None


def test_the_index_reads_an_unbuilt_registration_as_the_built_one() -> None:
    payload = registration_payload(devices=[
        DeviceInfo(uuid=f"GPU-{i}", index=i, type="NVIDIA-H100", memory_mib=80_000,
                   healthy=i != 1).model_dump(mode="json") for i in range(3)
    ])  # fmt: skip
    ledger = decode(envelope(ledger_data()), NodeLedger)
    built, lazy = ClusterIndex(), ClusterIndex(frozenset({"GPU-2"}))
    built.global_cordon = frozenset({"GPU-2"})
    for index, value in ((built, decode(payload, NodeRegistration)),
                         (lazy, RegistrationCodec().read(payload))):  # fmt: skip
        index.set_registration("n1", value, 5.0)
        index.set_ledger("n1", ledger, 1, 5.0)
    assert isinstance(lazy.entries["n1"].registered, wire_fast.RegistrationWire)
    for name in ("free_gpus", "card_mem", "card_pct", "card_cores", "card_computing",
                 "card_idle", "scores", "busy"):  # fmt: skip
        assert (getattr(lazy, name) == getattr(built, name)).all(), name
    assert lazy.entries["n1"].cards == built.entries["n1"].cards
    assert ledger_problem("n1", ledger, lazy.entries["n1"].registered, Bounds()) is None
    # First use builds the model: the value the shared codec reads.
    assert lazy.entries["n1"].registration == decode(payload, NodeRegistration)
    assert isinstance(lazy.entries["n1"].registered, NodeRegistration)
    # A heartbeat of it re-dates the built model: nothing rebuilt, nothing built again.
    codec = RegistrationCodec()
    wire = codec.read(payload)
    lazy.set_registration("n1", wire, 6.0)
    built_model = lazy.entries["n1"].registration
    cards = lazy.entries["n1"].cards
    codec.accepted("n1", payload, wire)
    lazy.set_registration("n1", codec.heartbeat_only("n1", registration_payload(
        heartbeat_at=9.0, devices=msgpack.unpackb(payload)["data"]["devices"])), 7.0)  # fmt: skip
    entry = lazy.entries["n1"]
    assert isinstance(entry.registered, NodeRegistration) and entry.cards is cards
    assert entry.registration.heartbeat_at == 9.0
    assert entry.registration.devices is built_model.devices
