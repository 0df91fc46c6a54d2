"""A node that stops heartbeating is announced once as node.<name>.lost, whatever the replicas."""

from __future__ import annotations

import asyncio
import time

from tessera import bus
from tessera.events import subscribe
from tessera.models import NodeEvent

from .conftest import MakeService, register, unique, wait_until
from .factories import node


async def test_silent_node_is_announced_lost_once(make_service: MakeService, buckets, nc) -> None:
    name = unique("silent")
    # Two replicas with a 0.5 s node TTL: a heartbeat older than 1 s means the node is gone.
    first = await make_service(settings={"node_ttl_s": 0.5})
    second = await make_service(settings={"node_ttl_s": 0.5})
    registration = node(name, gpus=2)
    await register(buckets, registration)
    await wait_until(lambda: name in first.index.entries and name in second.index.entries)
    lost = subscribe(nc, bus.node_event_subject(name, "lost"))
    received = await asyncio.wait_for(anext(lost), 10)
    event = received.event
    assert isinstance(event, NodeEvent) and event.node == name
    assert "no heartbeat" in event.reason
    assert sorted(event.device_uuids) == sorted(d.uuid for d in registration.devices)
    # Both replicas noticed; the stream holds the announcement once.
    for replica in (first, second):
        await wait_until(
            lambda r=replica: (e := r.index.node(name)) is None or e.registration is None
        )
    try:
        await asyncio.wait_for(anext(lost), 1.0)
        raise AssertionError("node lost was published twice")
    except TimeoutError:
        pass
    finally:
        await lost.aclose()
    assert time.time() - registration.heartbeat_at > 1.0
