"""The quota service's stop ends within a bound while an event is still being published in the
background and the cancel that abandons it is lost (Python 3.11's wait_for drops one landing
with a bus reply, inside nats-py's request; tests/lost_cancel.py): before, the stop waited for
that task for ever."""

from __future__ import annotations

import asyncio

from lost_cancel import dropping_the_first_cancel
from quota_testkit import call, unique_namespace

from tessera import bus
from tessera.models import QuotaAmount, QuotaReply, QuotaSetRequest

STOP_BOUND_S = 5.0  # the service gives events under way 1 s, then abandons them


async def test_stop_ends_while_an_event_is_published(start_quota, nc, monkeypatch) -> None:
    publishing = asyncio.Event()

    async def publish_waiting(js, event, attempts: int = 5) -> None:
        publishing.set()
        await dropping_the_first_cancel()  # a publish waiting for its ack

    monkeypatch.setattr(bus, "publish_event", publish_waiting)
    service = await start_quota()
    body = QuotaSetRequest(namespace=unique_namespace(), limits=QuotaAmount(gpus=1))
    assert isinstance(await call(nc, bus.QUOTA_SET, body), QuotaReply)  # publishes "changed"
    await asyncio.wait_for(publishing.wait(), 10)
    stopping = asyncio.ensure_future(service.stop())
    done, _ = await asyncio.wait({stopping}, timeout=STOP_BOUND_S)
    assert done, f"the quota service did not stop within {STOP_BOUND_S:g} s"
    stopping.result()
