"""`bus.flush`: once it returns, a subscription made just before it is in place on the server,
so a request another connection makes at once is answered (nats-py's own `flush` lets its PING
overtake the SUB still queued, and the request got "no responders" on a busy host)."""

from __future__ import annotations

import uuid

from slow_nats_link import SlowLink

from tessera import bus
from tessera.settings import NatsSettings


async def test_a_subscription_flushed_is_in_place_for_another_connection(nats_url: str) -> None:
    link = SlowLink(nats_url)
    slow_url = await link.start()
    subscriber = requester = None
    try:
        subscriber = await bus.connect(NatsSettings(NATS_URL=slow_url), "slow-subscriber")
        requester = await bus.connect(NatsSettings(NATS_URL=nats_url), "requester")
        subject = f"test.flush.{uuid.uuid4().hex[:8]}"

        async def answer(msg) -> None:
            await msg.respond(b"here")

        await subscriber.subscribe(subject, cb=answer)
        await bus.flush(subscriber)
        reply = await requester.request(subject, b"", timeout=10)
        assert reply.data == b"here"
    finally:
        for nc in (subscriber, requester):
            if nc is not None:
                await nc.close()
        await link.stop()
