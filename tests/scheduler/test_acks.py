"""acks.py against a real nats-server: a KV update at the right revision lands and returns the new
one, at a stale revision it is refused as nats-py refuses it (nothing written); an event is
acked once and deduplicated by its id on a retry; a subject no stream takes is an error, never
a silent success."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats.js.errors
import pytest
from tessera.scheduler.acks import JetStreamAcks

from tessera import bus
from tessera.bus import Buckets


async def test_kv_update_at_the_right_and_at_a_stale_revision(nc: Any, buckets: Buckets) -> None:
    acks = JetStreamAcks(nc)
    key = f"acks-{uuid.uuid4().hex[:8]}"
    first = await buckets.ledger.put(key, b"one")
    subject = f"$KV.{bus.LEDGER_BUCKET}.{key}"
    second = await acks.update(subject, b"two", first)
    assert second > first
    assert (await buckets.ledger.get(key)).value == b"two"
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await acks.update(subject, b"three", first)  # stale: someone wrote since
    entry = await buckets.ledger.get(key)
    assert (entry.value, entry.revision) == (b"two", second)


async def test_event_acked_once_and_a_retry_deduplicated(nc: Any, buckets: Buckets) -> None:
    acks = JetStreamAcks(nc)
    subject = bus.alloc_event_subject(f"n-{uuid.uuid4().hex[:8]}", "bound")
    headers = {"Nats-Msg-Id": f"{uuid.uuid4().hex}:bound"}
    first = await acks.publish(subject, b"payload", headers)
    again = await acks.publish(subject, b"payload", headers)
    assert first["seq"] == again["seq"] and again.get("duplicate") is True
    assert not first.get("duplicate")


async def test_a_subject_no_stream_takes_is_an_error(nc: Any) -> None:
    acks = JetStreamAcks(nc)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await acks.publish(f"nowhere.{uuid.uuid4().hex}", b"x", {}, timeout=5)


async def test_concurrent_publishes_each_get_their_own_ack(nc: Any, buckets: Buckets) -> None:
    """Acks are settled as nats-py's reader hands them over (no queue): 64 publishes in flight
    together each return the sequence the stream gave that very message."""
    acks = JetStreamAcks(nc)
    node = f"n-{uuid.uuid4().hex[:8]}"
    subject = bus.alloc_event_subject(node, "reserved")
    ids = [f"{uuid.uuid4().hex}:reserved" for _ in range(64)]
    answers = await asyncio.gather(*(acks.publish(subject, key.encode(), {"Nats-Msg-Id": key})
                                     for key in ids))  # fmt: skip
    seqs = [int(a["seq"]) for a in answers]
    assert len(set(seqs)) == 64
    js = nc.jetstream()
    for key, seq in zip(ids, seqs, strict=True):
        stored = await js.get_msg(bus.EVENTS_STREAM, seq)
        assert stored.data == key.encode()
