"""The versioned msgpack codec: round trips for every model, clear errors for bad payloads."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera import models
from tessera.codec import CodecError, Message, decode, encode
from tessera.events import decode_event

ALL_MODELS = [
    obj
    for obj in vars(models).values()
    if isinstance(obj, type) and issubclass(obj, Message) and obj not in (Message, models.Event)
]

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
grant = st.builds(
    models.DeviceGrant,
    uuid=names,
    type=names,
    memory_mib=st.integers(0, 2**40),
    cores=st.integers(0, 100),
)
allocation = st.builds(
    models.Allocation,
    pod_uid=names,
    namespace=names,
    name=names,
    node=names,
    containers=st.lists(st.lists(grant, max_size=3), max_size=4),
    init_count=st.integers(0, 4),
    state=st.sampled_from(list(models.AllocationState)),
    created_at=st.floats(0, 2e9),
    expires_at=st.none() | st.floats(0, 2e9),
)
ledger = st.builds(
    models.NodeLedger,
    node=names,
    allocations=st.dictionaries(names, allocation, max_size=3),
    claim=st.none()
    | st.builds(
        models.InFlightClaim,
        pod_uid=names,
        namespace=names,
        name=names,
        expires_at=st.floats(0, 2e9),
    ),
)
registration = st.builds(
    models.NodeRegistration,
    node=names,
    devices=st.lists(
        st.builds(
            models.DeviceInfo,
            uuid=names,
            index=st.integers(0, 64),
            type=names,
            memory_mib=st.integers(0, 2**30),
            numa=st.integers(0, 8),
            healthy=st.booleans(),
            links=st.dictionaries(names, st.integers(0, 1000), max_size=3),
        ),
        max_size=4,
    ),
)
quota = st.builds(
    models.QuotaState,
    namespace=names,
    limits=st.builds(models.QuotaAmount, memory_mib=st.none() | st.integers(0, 2**40)),
    charges=st.dictionaries(
        names,
        st.builds(models.QuotaCharge, pod_uid=names, memory_mib=st.integers(0, 2**40)),
        max_size=3,
    ),
)
alloc_event = st.builds(
    models.AllocationEvent,
    action=st.sampled_from(["reserved", "bound", "allocated", "released", "failed", "mismatch"]),
    node=names,
    pod_uid=names,
    namespace=names,
    name=names,
    containers=st.lists(st.lists(grant, max_size=2), max_size=2),
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(allocation, ledger, registration, quota, alloc_event))
def test_every_model_survives_a_round_trip(message: Message) -> None:
    assert decode(encode(message), type(message)) == message


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_every_model_has_a_schema_version(model: type[Message]) -> None:
    assert isinstance(model.SCHEMA_VERSION, int) and model.SCHEMA_VERSION >= 1


def test_unknown_version_is_refused_with_a_clear_error() -> None:
    payload = msgpack.packb({"schema": "NodeLedger", "version": 99, "data": {"node": "n"}})
    with pytest.raises(CodecError, match="NodeLedger schema version 99 is not supported"):
        decode(payload, models.NodeLedger)


def test_a_quota_hand_on_is_written_so_that_only_a_service_that_knows_it_reads_it() -> None:
    """A plain reserve stays version 1 (every quota service reads it); a hand-on is version 2,
    which a service built before `handed_from_keeps` refuses instead of misreading."""
    plain = models.QuotaRequest(namespace="ns", pod_uid="p", memory_mib=10)
    handed = models.QuotaRequest(namespace="ns", pod_uid="p", memory_mib=10, handed_from="q",
                                 handed_from_keeps=models.QuotaShare(memory_mib=5))  # fmt: skip
    assert msgpack.unpackb(encode(plain))["version"] == 1
    assert msgpack.unpackb(encode(handed))["version"] == 2
    assert decode(encode(handed), models.QuotaRequest) == handed
    older = msgpack.packb({**msgpack.unpackb(encode(handed)), "version": 3})
    with pytest.raises(CodecError, match="QuotaRequest schema version 3 is not supported"):
        decode(older, models.QuotaRequest)


def test_wrong_schema_and_garbage_are_refused() -> None:
    ledger_bytes = encode(models.NodeLedger(node="n1"))
    with pytest.raises(CodecError, match="expected a QuotaState message"):
        decode(ledger_bytes, models.QuotaState)
    for garbage in (b"", b"\xc1", b"not msgpack at all", msgpack.packb([1, 2, 3])):
        with pytest.raises(CodecError):
            decode(garbage, models.NodeLedger)
    with pytest.raises(CodecError, match="invalid NodeLedger"):
        decode(msgpack.packb({"schema": "NodeLedger", "version": 1, "data": {}}), models.NodeLedger)


def test_events_decode_by_their_schema_name() -> None:
    event = models.OomEvent(node="n1", pod="p", device_uuid="GPU-1", oom_count=2)
    decoded = decode_event(encode(event))
    assert isinstance(decoded, models.OomEvent) and decoded == event
    with pytest.raises(CodecError, match="unknown event schema"):
        decode_event(encode(models.NodeLedger(node="n1")))


def test_replies_decode_as_the_model_or_raise_the_endpoints_error() -> None:
    from tessera.models import ErrorReply, QuotaReply, RemoteError, decode_reply

    assert decode_reply(encode(QuotaReply(ok=True)), QuotaReply).ok
    with pytest.raises(RemoteError, match="quota state is busy"):
        decode_reply(encode(ErrorReply(reason="quota state is busy")), QuotaReply)
    with pytest.raises(CodecError):
        decode_reply(b"garbage", QuotaReply)
