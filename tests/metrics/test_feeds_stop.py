"""The metrics service's feeds stop within a bound while a stream waits on the bus and the cancel
that ends it is lost (Python 3.11's wait_for drops one landing with a bus reply, inside
nats-py's request; tests/lost_cancel.py): before, the stop waited for ever."""

from __future__ import annotations

import asyncio
import time

from lost_cancel import dropping_the_first_cancel
from tessera.metrics.feeds import Feeds
from tessera.metrics.view import ClusterView

STOP_BOUND_S = 5.0


async def test_feeds_stop_while_the_event_stream_loses_its_cancel(nc, buckets, monkeypatch):
    following = asyncio.Event()

    async def follow_events(self: Feeds) -> None:  # the event stream, waiting on the bus
        following.set()
        await dropping_the_first_cancel()

    monkeypatch.setattr(Feeds, "_follow_events", follow_events)
    feeds = Feeds(nc, nc.jetstream(), buckets, ClusterView(), time.time)
    await feeds.start()
    await asyncio.wait_for(following.wait(), 10)
    stopping = asyncio.ensure_future(feeds.stop())
    done, _ = await asyncio.wait({stopping}, timeout=STOP_BOUND_S)
    assert done, f"the feeds did not stop within {STOP_BOUND_S:g} s"
    stopping.result()
