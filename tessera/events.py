"""A small client for the public event stream (billing, autoscalers, audit, `tessera events`).

    async for received in subscribe(nc, "tessera.events.alloc.>", durable="billing"):
        handle(received.event)
        await received.ack()

Ephemeral subscriptions are ordered consumers (no acks needed); durable ones remember their
position on the server across restarts of the consumer and need `ack()`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from tessera.bus import EVENTS_ALL, EVENTS_STREAM
from tessera.codec import CodecError, decode, peek_schema
from tessera.models import EVENT_TYPES, Event

_BY_NAME: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}


@dataclass
class ReceivedEvent:
    """One event from the stream with its position (stream sequence) and subject."""

    event: Event
    subject: str
    sequence: int
    _msg: Msg

    async def ack(self) -> None:
        """Acknowledge (durable subscriptions only; a no-op for ephemeral ones)."""
        with contextlib.suppress(Exception):
            await self._msg.ack()


def decode_event(payload: bytes) -> Event:
    """Any event payload as its model; CodecError for garbage or unknown schemas/versions."""
    schema, _ = peek_schema(payload)
    model = _BY_NAME.get(schema)
    if model is None:
        raise CodecError(f"unknown event schema {schema!r}")
    return decode(payload, model)


async def subscribe(
    nc: NatsClient,
    subject: str = EVENTS_ALL,
    *,
    durable: str | None = None,
    start_sequence: int | None = None,
    start_time: dt.datetime | None = None,
    new_only: bool = False,
    skip_invalid: bool = True,
) -> AsyncIterator[ReceivedEvent]:
    """Events on `subject` (a filter under tessera.events.>), from the start of the stream
    unless a sequence, a time or `new_only` says otherwise. A durable subscription resumes where
    its last acknowledged event left off, whatever start it is given later."""
    if start_sequence is not None:
        policy = js_api.DeliverPolicy.BY_START_SEQUENCE
    elif start_time is not None:
        policy = js_api.DeliverPolicy.BY_START_TIME
    elif new_only:
        policy = js_api.DeliverPolicy.NEW
    else:
        policy = js_api.DeliverPolicy.ALL
    if start_time is not None and start_time.tzinfo is None:
        start_time = start_time.replace(tzinfo=dt.UTC)
    config = js_api.ConsumerConfig(
        deliver_policy=policy, opt_start_seq=start_sequence, opt_start_time=start_time
    )
    js = nc.jetstream()
    if durable:
        async for received in _pull_durable(js, subject, durable, config, skip_invalid):
            yield received
        return
    sub = await js.subscribe(
        subject, stream=EVENTS_STREAM, config=config, ordered_consumer=True, idle_heartbeat=5.0
    )
    try:
        async for msg in sub.messages:
            try:
                event = decode_event(msg.data)
            except CodecError:
                if not skip_invalid:
                    raise
                continue
            yield ReceivedEvent(event, msg.subject, msg.metadata.sequence.stream, msg)
    finally:
        with contextlib.suppress(Exception):  # the connection may already be closed
            await sub.unsubscribe()


async def _pull_durable(
    js: JetStreamContext,
    subject: str,
    durable: str,
    config: js_api.ConsumerConfig,
    skip_invalid: bool,
) -> AsyncIterator[ReceivedEvent]:
    """A durable pull consumer, fetched one event at a time: nothing is held unacknowledged
    beyond the event in hand, so a consumer that stops resumes exactly after its last ack."""
    sub = await js.pull_subscribe(subject, durable=durable, stream=EVENTS_STREAM, config=config)
    try:
        while True:
            try:
                msgs = await sub.fetch(batch=1, timeout=5.0)
            except TimeoutError:
                continue
            for msg in msgs:
                try:
                    event = decode_event(msg.data)
                except CodecError:
                    if not skip_invalid:
                        raise
                    await msg.ack()
                    continue
                yield ReceivedEvent(event, msg.subject, msg.metadata.sequence.stream, msg)
    finally:
        with contextlib.suppress(Exception):  # the connection may already be closed
            await sub.unsubscribe()
