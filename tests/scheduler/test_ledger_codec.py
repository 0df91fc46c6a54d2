"""The scheduler's incremental ledger codec writes exactly tessera.codec's bytes and reads
exactly what tessera.codec reads (same values, same refusals), decoding only what changed."""

from __future__ import annotations

import msgpack
import pytest
from tessera.scheduler.ledger import bound_mutate, release_mutate
from tessera.scheduler.ledger_codec import LedgerCodec

from tessera.codec import CodecError, decode, encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    InFlightClaim,
    NodeLedger,
)


def allocation(
    uid: str, gpu: str = "GPU-0", mem: int = 1000,
    state: AllocationState = AllocationState.ALLOCATED,
) -> Allocation:
    return Allocation(
        pod_uid=uid, namespace="ns", name=f"pod-{uid}", node="n1",
        containers=[[DeviceGrant(uuid=gpu, type="NVIDIA-H100", memory_mib=mem, cores=10)]],
        state=state, created_at=1.0, updated_at=1.0,
    )  # fmt: skip


def ledger(count: int = 5) -> NodeLedger:
    allocations = {f"u{i}": allocation(f"u{i}", f"GPU-{i % 4}") for i in range(count)}
    return NodeLedger(node="n1", allocations=allocations)


def test_encode_is_byte_for_byte_the_shared_codec() -> None:
    codec = LedgerCodec()
    value = ledger()
    assert codec.encode(value) == encode(value)
    claimed = value.model_copy(update={"claims": {"u1": InFlightClaim(
        pod_uid="u1", namespace="ns", name="pod-u1", taken_at=2.0, expires_at=9.0, holder="a",
    )}})  # fmt: skip
    assert codec.encode(claimed) == encode(claimed)  # cached allocations, new claims
    bound = bound_mutate("u2", 3.0, claimed.model_copy(update={"allocations": {
        **claimed.allocations, "u2": allocation("u2", state=AllocationState.RESERVED),
    }}))  # fmt: skip
    assert codec.encode(bound) == encode(bound)
    assert codec.encode(NodeLedger(node="n1")) == encode(NodeLedger(node="n1"))
    big = ledger(40)  # a map header beyond fixmap
    assert codec.encode(big) == encode(big)


def test_claims_are_written_as_the_shared_codec_writes_them_write_after_write() -> None:
    """Each claim's bytes are kept for the next write of the node: a claim that came, went, was
    replaced by another of the same pod or stands as the legacy single claim is written exactly
    as `tessera.codec.encode` writes the entry, every time."""
    codec = LedgerCodec()
    value = ledger()

    def claim(uid: str, expires_at: float) -> InFlightClaim:
        return InFlightClaim(pod_uid=uid, namespace="ns", name=f"pod-{uid}", taken_at=2.0,
                             expires_at=expires_at, holder="a")  # fmt: skip

    a, b = claim("u1", 9.0), claim("u2", 9.5)
    steps = [
        {"claims": {"u1": a}},
        {"claims": {"u1": a, "u2": b}},
        {"claims": {"u1": claim("u1", 12.0), "u2": b}},  # u1 claimed afresh: new bytes
        {"claims": {"u2": b}},
        {"claims": {}, "claim": claim("u3", 4.0)},  # an older scheduler's single claim
        {"claims": {"u2": b}, "claim": claim("u3", 4.0)},
        {"claims": {}, "claim": None},
        {"claims": {f"u{i}": claim(f"u{i}", 20.0 + i) for i in range(20)}},  # beyond fixmap
    ]
    for update in steps:
        value = value.model_copy(update=update)
        assert codec.encode(value) == encode(value), update
    other = LedgerCodec(encode_nodes=1)  # a node forgotten between its writes: packed afresh
    for node in ("n1", "n2", "n1"):
        entry = NodeLedger(node=node, claims={"u1": a})
        assert other.encode(entry) == encode(entry)


def test_decode_reuses_unchanged_allocations_and_reads_changes() -> None:
    codec = LedgerCodec()
    first = ledger()
    one = codec.decode("n1", encode(first))
    assert one == decode(encode(first), NodeLedger)
    # Another writer changes one allocation and removes another.
    removed: list[Allocation] = []
    changed = release_mutate("u3", removed, bound_mutate("u4", 5.0, first.model_copy(
        update={"allocations": {**first.allocations,
                                "u4": allocation("u4", state=AllocationState.RESERVED)}}
    )))  # fmt: skip
    two = codec.decode("n1", encode(changed))
    assert two == decode(encode(changed), NodeLedger)
    assert list(two.allocations) == list(changed.allocations)
    assert two.allocations["u0"] is one.allocations["u0"]  # unchanged: not decoded again
    assert two.allocations["u4"] is not one.allocations["u4"]
    assert two.allocations["u4"].state == AllocationState.BOUND
    assert "u3" not in two.allocations


def test_decode_after_own_encode_reuses_the_written_objects() -> None:
    codec = LedgerCodec()
    value = ledger()
    payload = codec.encode(value)
    again = codec.decode("n1", payload)
    assert again == value
    assert all(again.allocations[u] is value.allocations[u] for u in value.allocations)


def test_a_changed_allocation_is_validated_even_when_the_previous_one_was_valid() -> None:
    codec = LedgerCodec()
    value = ledger()
    codec.decode("n1", encode(value))
    data = msgpack.unpackb(encode(value))
    data["data"]["allocations"]["u1"]["containers"][0][0]["memory_mib"] = -5
    bad = msgpack.packb(data, use_bin_type=True)
    with pytest.raises(CodecError) as ours:
        codec.decode("n1", bad)
    with pytest.raises(CodecError) as shared:
        decode(bad, NodeLedger)
    assert str(ours.value) == str(shared.value)
    # After the refusal nothing of the node is trusted: the good value decodes afresh.
    assert codec.decode("n1", encode(value)) == value


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        msgpack.packb({"schema": "NodeRegistration", "version": 1, "data": {}}),
        msgpack.packb({"schema": "NodeLedger", "version": 99, "data": {"node": "n1"}}),
        msgpack.packb(
            {"schema": "NodeLedger", "version": 1,
             "data": {"node": "n1", "allocations": {"u1": {"pod_uid": "u1"}}}}
        ),
        msgpack.packb({"schema": "NodeLedger", "version": 1, "data": ["not", "a", "map"]}),
        msgpack.packb(
            {"schema": "NodeLedger", "version": 1, "data": {"node": "n1", "allocations": {1: {}}}}
        ),
        encode(ledger()) + b"\x00",  # trailing bytes
    ],
)
def test_bad_payloads_are_refused_as_the_shared_codec_refuses_them(payload: bytes) -> None:
    codec = LedgerCodec()
    codec.decode("n1", encode(ledger()))  # a valid previous value must not mask anything
    with pytest.raises(CodecError) as ours:
        codec.decode("n1", payload)
    with pytest.raises(CodecError) as shared:
        decode(payload, NodeLedger)
    assert str(ours.value) == str(shared.value)


def test_decoded_allocations_share_their_fields_set() -> None:
    codec = LedgerCodec()
    value = codec.decode("n1", encode(ledger(3)))
    sets = {id(a.__pydantic_fields_set__) for a in value.allocations.values()}
    assert len(sets) == 1
    # Copy-on-write still works on them (the mutate functions' way of changing one).
    copy = value.allocations["u0"].model_copy(update={"state": AllocationState.RELEASED})
    assert copy.state == AllocationState.RELEASED
    assert value.allocations["u0"].state == AllocationState.ALLOCATED
