"""A restart serves once the ledger is rebuilt, before the pod watch has replayed its first
listing (runtime._watch_pods): what reads the watch's state copes until it has listed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from tessera.scheduler.preemption_ledger import abandon

from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import WatchEvent

from .conftest import MakeService, register, unique, wait_until
from .factories import container, node, pod
from .test_preemption_flow import done_events, prioritised, seed


class HeldWatch:
    """The cluster's marked pod watch, its listing held back until `release` is set."""

    def __init__(self, cluster: InMemoryCluster) -> None:
        self.inner = cluster.watch_pods_marked
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> AsyncIterator[WatchEvent | None]:
        self.started += 1
        await self.release.wait()
        async for event in self.inner(namespace, node_name):
            yield event


def hold_pod_watch(cluster: InMemoryCluster) -> HeldWatch:
    held = HeldWatch(cluster)
    cluster.watch_pods_marked = held  # type: ignore[method-assign]
    return held


async def test_the_pod_watch_starts_once_ready_and_says_when_it_has_listed(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    held = hold_pod_watch(cluster)
    service = await make_service()
    await wait_until(lambda: held.started == 1)
    assert service.ready() and not service.pods_listed.is_set()
    assert not service.scheduler.preemption.listed
    running = pod(container(mem=1000), name=unique("p"))
    cluster.add_pod(running)
    held.release.set()
    await wait_until(service.pods_listed.is_set)
    assert service.scheduler.preemption.listed
    assert running["metadata"]["uid"] in service.gate.known


async def test_filters_before_the_pod_watch_has_listed_ask_the_cluster(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    held = hold_pod_watch(cluster)
    service = await make_service()
    name = unique("early")
    await register(service.buckets, node(name, gpus=1, memory_mib=24000, split=10))
    await wait_until(lambda: name in service.index.entries
                     and service.index.entries[name].registration is not None)  # fmt: skip
    real = pod(container(mem=1000), name=unique("real"))
    cluster.add_pod(real)
    made_up = pod(container(mem=1000), name=unique("made-up"))
    assert not service.pods_listed.is_set() and not service.gate.known
    placed = await service.scheduler.filter(real, [name])
    assert placed.nodenames == [name]  # looked up (get_pod): it exists with that uid
    refused = await service.scheduler.filter(made_up, [name])
    assert not refused.nodenames and "does not exist in the cluster" in refused.unresolvable[name]
    assert made_up["metadata"]["uid"] not in service.index.pod_nodes
    assert held.started == 1 and not service.pods_listed.is_set()


async def test_a_nominee_is_not_taken_for_deleted_before_the_pod_watch_has_listed(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    """A replica restarted while a nomination it follows ends: its nominee's pod, not yet seen
    by its watch, is not reported "pod-deleted" (the first `done` is the one kept)."""
    config = {"preemption_margin_s": 30, "sweep_interval_s": 0.1}
    one = await make_service(config=config)
    name = unique("adopt")
    victim = prioritised("victim", 20000, 10, name)
    await seed(one.buckets, cluster, name, [victim])
    await wait_until(lambda: one.index.entries.get(name) is not None
                     and one.index.entries[name].ledger is not None)  # fmt: skip
    urgent = prioritised("urgent", 20000, 1000)
    cluster.add_pod(urgent)
    uid = urgent["metadata"]["uid"]
    first = await one.scheduler.filter(urgent, [name])
    assert "waiting for preemption of" in first.failed[name]
    one.kill()  # it started the nomination; a restarted replica now follows it

    held = hold_pod_watch(cluster)
    two = await make_service(config=config)
    await wait_until(lambda: uid in two.scheduler.preemption.started)  # adopted from the ledger
    assert not two.pods_listed.is_set() and uid not in two.scheduler.preemption.pods
    # The nomination is given up in the ledger (as another replica does on a PDB refusal):
    # its nominee's pod still exists.
    await abandon(two.buckets.ledger, name, uid, time.time())
    await wait_until(lambda: not any(
        a.preempted_by for a in two.index.entries[name].ledger.allocations.values()))  # fmt: skip
    await asyncio.sleep(0.6)  # ticks (every 0.1 s) that see it ended, the watch not listed
    assert uid in two.scheduler.preemption.started
    assert await done_events(two, uid) == []
    held.release.set()
    await wait_until(two.pods_listed.is_set)
    await wait_until(lambda: uid not in two.scheduler.preemption.started)
    events = await done_events(two, uid)
    assert [e.outcome for e in events] == ["re-evaluated"]
    assert events[0].priority == 1000  # adopted without its pod's facts; told once listed


async def test_no_preemption_starts_before_the_pod_watch_has_listed(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    held = hold_pod_watch(cluster)
    service = await make_service(config={"preemption_margin_s": 30})
    name = unique("early-preempt")
    victim = prioritised("victim", 20000, 10, name)
    await seed(service.buckets, cluster, name, [victim])
    await wait_until(lambda: service.index.entries.get(name) is not None
                     and service.index.entries[name].ledger is not None)  # fmt: skip
    # What a partial replay would hold: the victim seen, other pods (maybe lower) not yet.
    service.scheduler.preemption.observe_pod(WatchEvent(type="ADDED", object=victim))
    urgent = prioritised("urgent", 20000, 1000)
    cluster.add_pod(urgent)
    refused = await service.scheduler.filter(urgent, [name])
    assert not refused.nodenames and "waiting for preemption" not in str(refused.failed)
    assert not cluster.evictions and not service.scheduler.preemption.started
    held.release.set()
    await wait_until(service.pods_listed.is_set)
    service.scheduler.preemption.attempts.clear()
    again = await service.scheduler.filter(urgent, [name])
    assert "waiting for preemption of" in again.failed[name]


async def test_the_listing_is_replayed_in_slices_while_the_scheduler_serves(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    held = hold_pod_watch(cluster)
    service = await make_service()
    prefix = unique("p")  # one random part: 1,200 random names of 8 hex digits could collide
    uids = {cluster.add_pod(pod(container(mem=1000), name=f"{prefix}-{i}"))["metadata"]["uid"]
            for i in range(1200)}
    held.release.set()
    partial = 0  # loop turns in which the replay had begun and not ended
    while not service.pods_listed.is_set():
        partial += bool(service.gate.known)
        await asyncio.sleep(0)
    assert partial >= 2  # other tasks ran between its slices (of 500)
    assert uids <= service.gate.known.keys()
