"""`port.watch_pods_listed`: the pod watch with the end of its first listing marked (None)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import WatchEvent, watch_pods_listed


def _pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": "c"}]}}  # fmt: skip


async def _names(events: AsyncIterator[WatchEvent | None], count: int) -> list[str | None]:
    out: list[str | None] = []
    for _ in range(count):
        event = await asyncio.wait_for(anext(events), 5)
        out.append(None if event is None else f"{event.type} {event.object['metadata']['name']}")
    return out


async def test_the_in_memory_cluster_marks_the_end_of_its_listing() -> None:
    cluster = InMemoryCluster()
    cluster.add_pod(_pod("a"))
    cluster.add_pod(_pod("b"))
    events = watch_pods_listed(cluster)
    assert await _names(events, 3) == ["ADDED a", "ADDED b", None]
    cluster.add_pod(_pod("c"))
    assert await _names(events, 1) == ["ADDED c"]
    await events.aclose()
    assert not cluster._pod_watchers  # the watch's queue went with it


async def test_the_plain_watch_is_unchanged() -> None:
    cluster = InMemoryCluster()
    cluster.add_pod(_pod("a"))
    events = cluster.watch_pods()
    first = await asyncio.wait_for(anext(events), 5)
    cluster.add_pod(_pod("b"))
    second = await asyncio.wait_for(anext(events), 5)
    assert [first.type, second.type] == ["ADDED", "ADDED"]
    assert second.object["metadata"]["name"] == "b"
    await events.aclose()


async def test_a_stand_in_without_the_mark_is_taken_as_listed_at_once() -> None:
    class StandIn:
        async def watch_pods(self, namespace: str | None = None, node_name: str | None = None):
            yield WatchEvent(type="ADDED", object=_pod("a"))
            await asyncio.Event().wait()

    events = watch_pods_listed(StandIn())  # type: ignore[arg-type]
    assert await _names(events, 2) == [None, "ADDED a"]
    await events.aclose()
