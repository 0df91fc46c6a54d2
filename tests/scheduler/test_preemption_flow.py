"""Preemption through the running scheduler, against a real NATS: two replicas racing for the
same victim, and the release gate on the node agent's usage reports."""

from __future__ import annotations

import asyncio
import time

from nats.js.api import DeliverPolicy
from tessera.scheduler.cards import build_cards, over_capacity

from tessera import bus
from tessera.cancelling import cancel_and_wait
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode, encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    ExplainRequest,
    HostDeviceUsage,
    NodeLedger,
    PreemptionEvent,
    UsageSample,
    ValueRejectedEvent,
)

from .conftest import MakeService, register, unique, until_async, wait_until
from .factories import container, node, pod

MIB = 1 << 20


def prioritised(name: str, mem: int, priority: int, node_name: str | None = None) -> dict:
    p = pod(container(mem=mem, cores=10), name=name)
    p["spec"]["priority"] = priority
    if node_name:
        p["spec"]["nodeName"] = node_name
        p["status"] = {"phase": "Running"}
    return p


async def seed(buckets, cluster: InMemoryCluster, node_name: str, victims: list[dict]):
    reg = node(node_name, gpus=1, memory_mib=24000, split=10)
    await register(buckets, reg)
    uuid = reg.devices[0].uuid
    allocations = {}
    for v in victims:
        cluster.add_pod(v)
        meta = v["metadata"]
        mem = v["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"]
        allocations[meta["uid"]] = Allocation(
            pod_uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], node=node_name,
            state=AllocationState.ALLOCATED,
            containers=[[DeviceGrant(uuid=uuid, type=reg.devices[0].type, memory_mib=mem,
                                     cores=10)]],
        )  # fmt: skip
    await buckets.ledger.put(node_name, encode(NodeLedger(node=node_name, allocations=allocations)))
    return reg


async def test_two_replicas_never_count_the_same_freed_capacity(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    one = await make_service(config={"preemption_margin_s": 30})
    two = await make_service(config={"preemption_margin_s": 30})
    name = unique("race")
    # v1 (priority 10) is the only pod either preemptor (priority 100) may evict; v2 is 500.
    v1, v2 = prioritised("v1", 12000, 10, name), prioritised("v2", 12000, 500, name)
    reg = await seed(one.buckets, cluster, name, [v1, v2])
    await wait_until(lambda: all(
        s.index.entries.get(name) is not None and s.index.entries[name].ledger is not None
        and s.index.entries[name].registration is not None for s in (one, two)))  # fmt: skip
    violations: list[str] = []

    async def check() -> None:
        async for key, value, _rev in bus.watch_models(one.buckets.ledger, NodeLedger):
            if key == name and value is not None:
                cards = build_cards(reg, value.allocations.values(), time.time())
                violations.extend(over_capacity(cards))

    checker = asyncio.create_task(check())
    a, b = prioritised("a", 12000, 100), prioritised("b", 12000, 100)
    cluster.add_pod(a)
    cluster.add_pod(b)
    results = await asyncio.gather(one.scheduler.filter(a, [name]), two.scheduler.filter(b, [name]))
    assert all(not r.nodenames for r in results)
    waiting = [r for r in results if any("waiting for preemption of" in m
                                         for m in r.failed.values())]  # fmt: skip
    assert len(waiting) == 1  # one nomination got v1; the other found nothing left to take
    current = await bus.read(one.buckets.ledger, name, NodeLedger)
    assert current is not None
    marked = [x for x in current.value.allocations.values() if x.preempted_by]
    assert [x.name for x in marked] == ["v1"]
    assert cluster.evictions == [(v1["metadata"]["namespace"], "v1")]
    assert v2["metadata"]["name"] in {p["metadata"]["name"] for p in cluster.pods.values()}
    await asyncio.sleep(0.3)
    assert not await cancel_and_wait(checker)  # (a cancel landing with a bus reply may be dropped)
    assert violations == []


async def test_a_victim_is_released_only_when_the_agent_reports_its_memory_free(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    service = await make_service(config={"preemption_margin_s": 30, "sweep_interval_s": 0.1})
    name = unique("gate")
    victim = prioritised("victim", 20000, 10, name)
    reg = await seed(service.buckets, cluster, name, [victim])
    uuid = reg.devices[0].uuid
    await wait_until(lambda: service.index.entries.get(name) is not None
                     and service.index.entries[name].ledger is not None)  # fmt: skip
    urgent = prioritised("urgent", 20000, 1000)
    cluster.add_pod(urgent)
    first = await service.scheduler.filter(urgent, [name])
    assert not first.nodenames and "waiting for preemption of" in first.failed[name]
    uid = victim["metadata"]["uid"]
    # The in-memory cluster evicted (deleted) the victim at once; the watch saw it go.
    await wait_until(lambda: uid in service.scheduler.preemption.gone)
    # Kubernetes' `Preempted` event on the victim, naming who took its place and where.
    await wait_until(lambda: any(e["reason"] == "Preempted" for e in cluster.events))
    [preempted] = [e for e in cluster.events if e["reason"] == "Preempted"]
    assert preempted["type"] == "Normal" and preempted["involved"]["uid"] == uid
    assert preempted["message"].startswith(
        f"Preempted by pod {urgent['metadata']['uid']} on node {name} (default/urgent")

    async def report(used_mib: int) -> None:
        sample = UsageSample(node=name, devices=[HostDeviceUsage(
            uuid=uuid, used_bytes=used_mib * MIB, total_bytes=24000 * MIB)])  # fmt: skip
        await service.nc.publish(bus.usage_subject(name), encode(sample))
        await bus.flush(service.nc)

    def victim_held() -> bool:
        ledger = service.index.entries[name].ledger
        return ledger is not None and uid in ledger.allocations

    for _ in range(5):  # NVML still shows the memory held: the victim stays, the pod waits
        await report(20000)
        await asyncio.sleep(0.2)
    assert victim_held()
    again = await service.scheduler.filter(urgent, [name])
    assert not again.nodenames and "waiting for preemption of" in again.failed[name]
    explained = service.explain(ExplainRequest(namespace="default", name="urgent"))
    assert explained.pending and "waiting for preemption of default/victim" in explained.summary
    # A forged sample on another node's subject is ignored.
    sample = UsageSample(node=name, devices=[HostDeviceUsage(uuid=uuid, used_bytes=0,
                                                             total_bytes=24000 * MIB)])
    await service.nc.publish(bus.usage_subject("elsewhere"), encode(sample))
    await asyncio.sleep(0.3)
    assert victim_held()
    await report(0)  # the memory is back
    await wait_until(lambda: not victim_held())
    placed = await service.scheduler.filter(urgent, [name])
    assert placed.nodenames == [name]


async def test_a_nomination_whose_victims_never_go_is_re_evaluated(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    service = await make_service(config={
        "preemption_margin_s": 0.5, "preemption_retry_s": 0.0, "sweep_interval_s": 0.1})
    name = unique("stuck")
    victim = prioritised("stuck", 20000, 10, name)
    victim["spec"]["terminationGracePeriodSeconds"] = 0
    await seed(service.buckets, cluster, name, [victim])
    await wait_until(lambda: service.index.entries.get(name) is not None
                     and service.index.entries[name].ledger is not None)  # fmt: skip
    await wait_until(lambda: victim["metadata"]["uid"] in service.scheduler.preemption.pods)

    async def accepted_but_stays(namespace: str, pod_name: str, uid: str, grace=None) -> None:
        cluster.evictions.append((namespace, pod_name))  # a victim stuck terminating

    cluster.evict_pod = accepted_but_stays  # type: ignore[method-assign]
    urgent = prioritised("urgent", 20000, 1000)
    cluster.add_pod(urgent)
    first = await service.scheduler.filter(urgent, [name])
    assert "waiting for preemption of" in first.failed[name]
    uid = urgent["metadata"]["uid"]

    def nominee_gone() -> bool:
        ledger = service.index.entries[name].ledger
        return ledger is not None and uid not in ledger.allocations

    await wait_until(nominee_gone)  # the deadline passed: the reservation lapsed
    await wait_until(lambda: uid not in service.scheduler.preemption.started)
    await service.scheduler.drain()
    done = await service.js.get_last_msg(
        bus.EVENTS_STREAM, bus.preemption_event_subject("default", "done"))
    event = decode(done.data, PreemptionEvent)
    assert event.pod_uid == uid and event.outcome == "re-evaluated"
    ledger = service.index.entries[name].ledger
    assert ledger is not None and ledger.allocations[victim["metadata"]["uid"]].active
    registration = service.index.entries[name].registration
    assert registration is not None
    cards = build_cards(registration, ledger.allocations.values(), time.time())
    assert over_capacity(cards) == [] and cards[0].used_mem == 20000  # the victim counts again
    assert ("ledger", name) not in service.rejections.seen  # every write of it was valid
    # Re-evaluated from scratch: it nominates again (and would evict again).
    again = await service.scheduler.filter(urgent, [name])
    assert not again.nodenames and "waiting for preemption of" in again.failed[name]
    assert len(cluster.evictions) == 2



async def test_a_deleted_nominee_leaves_nothing_reserved(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    service = await make_service(config={"preemption_margin_s": 30, "sweep_interval_s": 0.1})
    name = unique("deleted")
    victim = prioritised("victim", 20000, 10, name)
    await seed(service.buckets, cluster, name, [victim])
    await wait_until(lambda: service.index.entries.get(name) is not None
                     and service.index.entries[name].ledger is not None)  # fmt: skip
    urgent = prioritised("urgent", 20000, 1000)
    cluster.add_pod(urgent)
    first = await service.scheduler.filter(urgent, [name])
    assert "waiting for preemption of" in first.failed[name]
    victim_uid, uid = victim["metadata"]["uid"], urgent["metadata"]["uid"]
    await wait_until(lambda: victim_uid in service.scheduler.preemption.gone)
    cluster.delete_pod("default", "urgent")  # the nominee goes before its victims' memory

    def clean() -> bool:
        ledger = service.index.entries[name].ledger
        return ledger is not None and uid not in ledger.allocations \
            and victim_uid not in ledger.allocations
    await wait_until(clean)  # no reservation kept, the gone victim released
    await service.scheduler.drain()
    done = await service.js.get_last_msg(
        bus.EVENTS_STREAM, bus.preemption_event_subject("default", "done"))
    event = decode(done.data, PreemptionEvent)
    assert event.pod_uid == uid and event.outcome == "pod-deleted"
    assert ("ledger", name) not in service.rejections.seen


async def test_a_forged_preemption_mark_frees_nothing(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    """A node agent may rewrite its own node's entry: marking a running pod as a victim of a
    nominee that holds no reservation would free its memory for the scheduler. Rejected; the
    entry is repaired and the pod's memory keeps counting."""
    service = await make_service()
    name = unique("forged")
    victim = prioritised("victim", 20000, 10, name)
    await seed(service.buckets, cluster, name, [victim])
    await wait_until(lambda: service.index.entries.get(name) is not None
                     and service.index.entries[name].ledger is not None)  # fmt: skip
    uid = victim["metadata"]["uid"]
    current = await bus.read(service.buckets.ledger, name, NodeLedger)
    assert current is not None
    forged = current.value.model_copy(deep=True)
    forged.allocations[uid].preempted_by = "ghost"
    forged.allocations[uid].preempted_until = time.time() + 600
    sub = await service.nc.subscribe(bus.rejected_event_subject("ledger"))
    await service.buckets.ledger.update(name, encode(forged), last=current.revision)
    event = decode((await sub.next_msg(timeout=20)).data, ValueRejectedEvent)
    assert event.key == name and event.problem == "preemption_mark_unbacked"

    async def repaired() -> bool:
        now = await bus.read(service.buckets.ledger, name, NodeLedger)
        return now is not None and now.revision > current.revision + 1 \
            and not now.value.allocations[uid].preempted_by

    async def repaired_and_trusted() -> bool:
        return await repaired() and service.guard.refusal(name) is None

    await until_async(repaired_and_trusted, "the forged preemption mark repaired")
    other = prioritised("other", 20000, 10)  # no lower priority to evict: no preemption
    cluster.add_pod(other)
    result = await service.scheduler.filter(other, [name])
    assert not result.nodenames
    assert "CardInsufficientMemory" in result.failed[name]  # the victim's 20000 MiB count


async def done_events(service, uid: str) -> list[PreemptionEvent]:
    """Every `preemption.done` the stream holds for the pod."""
    await service.scheduler.drain()
    subject = bus.preemption_event_subject("default", "done")
    info = await service.js.stream_info(bus.EVENTS_STREAM, subjects_filter=subject)
    stored = (info.state.subjects or {}).get(subject, 0)
    sub = await service.js.subscribe(subject, ordered_consumer=True,
                                     deliver_policy=DeliverPolicy.ALL)  # fmt: skip
    out = []
    try:
        for _ in range(stored):
            event = decode((await sub.next_msg(timeout=20)).data, PreemptionEvent)
            if event.pod_uid == uid:
                out.append(event)
    finally:
        await sub.unsubscribe()
    return out


async def _preempt_on_one_finish_on_two(make_service, cluster, *, kill_first: bool):
    config = {"preemption_margin_s": 30, "sweep_interval_s": 0.1}
    one, two = await make_service(config=config), await make_service(config=config)
    name = unique("done")
    victim = prioritised("victim", 20000, 10, name)
    reg = await seed(one.buckets, cluster, name, [victim])
    await wait_until(lambda: all(s.index.entries.get(name) is not None
                                 and s.index.entries[name].ledger is not None
                                 for s in (one, two)))  # fmt: skip
    urgent = prioritised("urgent", 20000, 1000)
    cluster.add_pod(urgent)
    uid = urgent["metadata"]["uid"]
    first = await one.scheduler.filter(urgent, [name])
    assert "waiting for preemption of" in first.failed[name]
    if kill_first:
        one.kill()  # the replica that started it is gone before the victim's memory is back
    sample = UsageSample(node=name, devices=[HostDeviceUsage(
        uuid=reg.devices[0].uuid, used_bytes=0, total_bytes=24000 * MIB)])  # fmt: skip

    def victim_released() -> bool:
        ledger = two.index.entries[name].ledger
        return ledger is not None and victim["metadata"]["uid"] not in ledger.allocations

    async def released_after_report() -> bool:  # reports until the victim's memory is free
        await two.nc.publish(bus.usage_subject(name), encode(sample))
        return victim_released()

    await until_async(released_after_report, "the victim released on the usage reports")

    async def done_published() -> bool:
        return bool(await done_events(two, uid))

    await until_async(done_published, "preemption.done published")
    for replica in (two,) if kill_first else (one, two):
        await wait_until(lambda r=replica: uid not in r.scheduler.preemption.started)
    return two, uid


async def test_preemption_done_is_published_once_by_two_replicas(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    two, uid = await _preempt_on_one_finish_on_two(make_service, cluster, kill_first=False)
    events = await done_events(two, uid)
    assert [e.outcome for e in events] == ["placed"]


async def test_preemption_done_survives_the_replica_that_started_it(
    make_service: MakeService, cluster: InMemoryCluster
) -> None:
    two, uid = await _preempt_on_one_finish_on_two(make_service, cluster, kill_first=True)
    events = await done_events(two, uid)
    assert [(e.outcome, e.source) for e in events] == [("placed", two.instance)]
    assert events[0].victims == ["default/victim"]
