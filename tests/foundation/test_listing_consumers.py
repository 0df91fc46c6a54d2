"""A KV listing (`bus.list_entries`) leaves no consumer behind for long. nats-server 2.15 allows
1,000 consumers per stream by default, and clients may not delete consumers (bus_permissions):
with the watches' 300 s inactivity, more than 1,000 listings of one bucket in five minutes (the
quota service lists a namespace's charges at each status and reconcile) were refused with
"maximum consumers limit reached" (seen: tests/quota then a DRA test on one server; 589 of
2,500 listings in a row refused even at 2 s). A listing now waits for room instead."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from tessera import bus
from tessera.bus import connect
from tessera.settings import NatsSettings


async def test_a_listings_consumer_is_gone_seconds_after_it(nats_url: str) -> None:
    nc = await connect(NatsSettings(NATS_URL=nats_url), name="listing-consumers")
    js = nc.jetstream()
    name = f"listing-{uuid.uuid4().hex[:12]}"
    kv = await js.create_key_value(bucket=name, history=1)
    try:
        await kv.put("ns.a", b"1")
        # A watch that is still open keeps its consumer: its inactivity counts only once it
        # stops (a long watch rides out a reconnect). Opened first, with a listing's short
        # inactivity: had its time counted while open, it would go before the listings' do.
        async with contextlib.aclosing(bus.watch_entries(
                kv, "ns.*", inactive_s=bus.LISTING_INACTIVE_S)) as watch:  # fmt: skip
            assert (await anext(watch)).key == "ns.a"
            for _ in range(3):
                assert [e.key for e in await bus.list_entries(kv, "ns.*")] == ["ns.a"]
            listed_at = time.monotonic()
            deadline = listed_at + 30  # the server sweeps inactive consumers every few s
            while (await js.stream_info(f"KV_{name}")).state.consumer_count > 1:
                assert time.monotonic() < deadline, "a listing's consumer outlived it by 30 s"
                await asyncio.sleep(0.2)
            # the watch has outlived a listing's inactivity by half again, whenever the sweep ran
            await asyncio.sleep(listed_at + 1.5 * bus.LISTING_INACTIVE_S - time.monotonic())
            assert (await js.stream_info(f"KV_{name}")).state.consumer_count == 1  # the watch's
            await kv.put("ns.a", b"2")  # and it still delivers
            update = await asyncio.wait_for(anext(watch), 10)
            while update is None:  # the marker after the current values
                update = await asyncio.wait_for(anext(watch), 10)
            assert (update.key, update.value) == ("ns.a", b"2")
    finally:
        await js.delete_key_value(name)
        await nc.close()


async def test_a_burst_past_the_streams_consumer_limit_waits_and_loses_no_listing(
        nats_url: str) -> None:  # fmt: skip
    """The quota service lists one namespace's charges per namespace and pass: at thousands of
    namespaces a pass makes more listings of one bucket than the stream may hold consumers."""
    nc = await connect(NatsSettings(NATS_URL=nats_url), name="listing-burst")
    js = nc.jetstream()
    name = f"burst-{uuid.uuid4().hex[:12]}"
    kv = await js.create_key_value(bucket=name, history=1)
    try:
        await kv.put("ns-7.a", b"1")
        found = [len(await bus.list_entries(kv, f"ns-{i}.*")) for i in range(1_050)]
        assert sum(found) == 1 and found[7] == 1
    finally:
        await js.delete_key_value(name)
        await nc.close()
