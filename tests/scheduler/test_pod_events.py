"""Kubernetes Events on the pod, as HAMi records them (FilteringFailed with every node's reason,
FilteringSucceed, BindingFailed, BindingSucceed), rate-limited, through the cluster port."""

from __future__ import annotations

import asyncio
from typing import Any

from tessera.scheduler.background import BackgroundTasks
from tessera.scheduler.kube_events import PodEventRecorder

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode, encode
from tessera.models import ExplainReply, ExplainRequest, PodGoneEvent

from .conftest import MakeService, http_client, unique, wait_until
from .factories import GIB, container, node, pod
from .test_extender import bind_call, filter_call, setup_node


def events_of(cluster: InMemoryCluster, spec: dict[str, Any]) -> list[dict[str, Any]]:
    uid = spec["metadata"]["uid"]
    return [e for e in cluster.events if e["involved"]["uid"] == uid]


async def test_filter_and_bind_record_hami_events_on_the_pod(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    small = await setup_node(buckets, service, node(unique("small"), gpus=1, memory_mib=8 * GIB))
    big = await setup_node(buckets, service, node(unique("big"), gpus=1, memory_mib=80 * GIB))
    spec = cluster.add_pod(pod(container(mem=20 * GIB, cores=30)))
    async with http_client(service) as client:
        assert (await filter_call(client, spec, [small, big]))["nodenames"] == [big]
        assert await bind_call(client, spec, big) == ""
        too_big = cluster.add_pod(pod(container(mem=90 * GIB, cores=10)))
        await filter_call(client, too_big, [small, big])
        await filter_call(client, too_big, [small, big])  # a retry: not recorded twice
        assert await bind_call(client, too_big, big) != ""
    await wait_until(lambda: len(events_of(cluster, spec)) == 2
                     and len(events_of(cluster, too_big)) == 2)
    placed = {e["reason"]: e for e in events_of(cluster, spec)}
    assert placed["FilteringSucceed"]["type"] == "Normal" and big in placed[
        "FilteringSucceed"]["message"]
    assert placed["BindingSucceed"]["type"] == "Normal" and big in placed[
        "BindingSucceed"]["message"]
    refused = {e["reason"]: e for e in events_of(cluster, too_big)}
    failed = refused["FilteringFailed"]
    assert failed["type"] == "Warning"
    assert small in failed["message"] and big in failed["message"]
    assert "CardInsufficientMemory" in failed["message"]
    assert refused["BindingFailed"]["type"] == "Warning"
    assert failed["involved"]["name"] == too_big["metadata"]["name"]
    assert failed["involved"]["namespace"] == too_big["metadata"]["namespace"]


class SlowCluster(InMemoryCluster):
    """An API server that never answers event writes (they hang until cancelled)."""

    async def record_event(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.Event().wait()


async def test_recorder_rate_limits_and_never_blocks() -> None:
    cluster = InMemoryCluster()
    now = [1000.0]
    tasks = BackgroundTasks()
    recorder = PodEventRecorder(cluster, tasks, lambda: now[0], repeat_s=60, burst=4)
    spec = pod(container(mem=1000))
    for _ in range(5):
        recorder.filtered(spec, [], {"n1": "1/1 CardInsufficientMemory"})
    await tasks.drain()
    assert [e["reason"] for e in cluster.events] == ["FilteringFailed"]
    recorder.filtered(spec, [], {"n1": "1/1 CardInsufficientCore"})  # a new reason: recorded
    now[0] += 61
    recorder.filtered(spec, [], {"n1": "1/1 CardInsufficientMemory"})  # after the window
    await tasks.drain()
    assert len(cluster.events) == 3
    # A hung API server: at most `burst` writes in flight, the rest dropped, callers never wait.
    hung = PodEventRecorder(SlowCluster(), BackgroundTasks(), lambda: now[0], burst=4)
    for i in range(10):
        hung.bound("ns", f"p{i}", f"u{i}", "n1", "")
    assert hung.in_flight == 4 and hung.dropped == 6
    for task in list(hung.tasks._tasks):  # the hung writes: end them with the test
        task.cancel()


async def test_deleted_pending_pod_leaves_explain_and_is_announced(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any
) -> None:
    service = await make_service()
    full = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=8 * GIB))
    namespace = unique("ns")
    spec = cluster.add_pod(pod(container(mem=20 * GIB), namespace=namespace))
    sub = await nc.subscribe(bus.sched_gone_subject(namespace))
    await bus.flush(nc)  # in place before another connection publishes
    async with http_client(service) as client:
        await filter_call(client, spec, [full])
    ask = ExplainRequest(namespace=namespace, name=spec["metadata"]["name"])

    async def explain() -> ExplainReply:
        reply = await nc.request(bus.SCHEDULER_EXPLAIN, encode(ask), timeout=10)
        return decode(reply.data, ExplainReply)

    assert (await explain()).pending
    cluster.delete_pod(namespace, spec["metadata"]["name"])
    gone = decode((await sub.next_msg(timeout=20)).data, PodGoneEvent)
    assert (gone.namespace, gone.name, gone.pod_uid) == (
        namespace, spec["metadata"]["name"], spec["metadata"]["uid"])
    assert not (await explain()).pending
    assert service.scheduler.failures.get(f"{namespace}/{spec['metadata']['name']}") is None
