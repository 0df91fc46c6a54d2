"""A registration that differs from the node's last valid one only in its heartbeat is taken
without a decode; any other change is decoded and validated as before."""

from __future__ import annotations

import pytest
from tessera.scheduler.registration_codec import RegistrationCodec

from tessera.codec import CodecError, encode

from .factories import node


def test_a_heartbeat_reuses_the_validated_registration() -> None:
    codec = RegistrationCodec()
    first = node("n1", gpus=2).model_copy(update={"heartbeat_at": 100.0})
    payload = encode(first)
    assert codec.heartbeat_only("n1", payload) is None  # nothing known yet
    decoded = codec.decode(payload)
    assert decoded == first
    codec.accepted("n1", payload, decoded)
    beat = codec.heartbeat_only("n1", encode(first.model_copy(update={"heartbeat_at": 105.0})))
    assert beat is not None and beat.heartbeat_at == 105.0
    assert beat.devices is decoded.devices  # the index sees nothing to rebuild
    assert codec.heartbeat_only("n2", payload) is None  # another key: no


def test_any_other_change_is_decoded_again() -> None:
    codec = RegistrationCodec()
    first = node("n1", gpus=2)
    codec.accepted("n1", encode(first), codec.decode(encode(first)))
    unhealthy = first.model_copy(deep=True)
    unhealthy.devices[1].healthy = False
    assert codec.heartbeat_only("n1", encode(unhealthy)) is None
    assert codec.heartbeat_only("n1", b"\xc1junk") is None
    with pytest.raises(CodecError):
        codec.decode(b"\xc1junk")
    codec.forget("n1")
    assert codec.heartbeat_only("n1", encode(first)) is None
