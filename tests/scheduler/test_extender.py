"""The extender end to end over its HTTP API, with the real NATS ledger and an in-memory cluster."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tessera import bus, hami
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode, encode
from tessera.models import (
    AllocationEvent,
    AllocationState,
    ExplainReply,
    ExplainRequest,
    NodeLedger,
    QuotaReply,
    QuotaRequest,
    SchedulingFailedEvent,
)

from .conftest import MakeService, agent_allocate, http_client, register, unique, wait_until
from .factories import GIB, container, device, node, pod


async def setup_node(buckets: Buckets, service: Any, registration: Any) -> str:
    await register(buckets, registration)
    await wait_until(lambda: service.index.node(registration.node) is not None)
    return registration.node


async def ledger(buckets: Buckets, name: str) -> NodeLedger:
    entry = await bus.read(buckets.ledger, name, NodeLedger)
    assert entry is not None
    return entry.value


async def filter_call(client: Any, spec: dict[str, Any], names: list[str]) -> dict[str, Any]:
    response = await client.post("/filter", json={"pod": spec, "nodenames": names})
    assert response.status_code == 200, response.text
    return response.json()


async def bind_call(client: Any, spec: dict[str, Any], name: str) -> str:
    meta = spec["metadata"]
    response = await client.post("/bind", json={
        "PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
        "Node": name,
    })  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["Error"]


async def test_worked_example_two_pods_share_one_card(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=80 * GIB))
    pod_a = cluster.add_pod(pod(container(mem=30 * GIB, cores=50)))
    pod_b = cluster.add_pod(pod(container(mem=20 * GIB, cores=30)))
    async with http_client(service) as client:
        assert (await filter_call(client, pod_a, [name]))["nodenames"] == [name]
        assert await bind_call(client, pod_a, name) == ""
        assert (await filter_call(client, pod_b, [name]))["nodenames"] == [name]
        # A is in flight (no Allocate yet); B, of other amounts on the same card, goes in
        # flight beside it: a crossed guess between them trades a card for itself.
        assert await asyncio.wait_for(bind_call(client, pod_b, name), 15) == ""
        await agent_allocate(buckets, name, pod_a["metadata"]["uid"])
    state = await ledger(buckets, name)
    grants = [g for a in state.allocations.values() for c in a.containers for g in c]
    assert {g.uuid for g in grants} == {f"GPU-{name}-0"}
    assert sum(g.memory_mib for g in grants) == 50 * GIB
    assert sum(g.cores for g in grants) == 80
    assert len(grants) == 2
    assert set(state.claims) == {pod_b["metadata"]["uid"]}
    bound = cluster.pods[("default", pod_b["metadata"]["name"])]
    annotations = bound["metadata"]["annotations"]
    assert bound["spec"]["nodeName"] == name
    assert hami.decode_pod_devices(annotations[hami.ANN_DEVICES_TO_ALLOCATE])[0][0].memory_mib == (
        20 * GIB
    )
    assert annotations[hami.ANN_VGPU_NODE] == name
    assert bound["metadata"]["labels"][hami.LABEL_VGPU_NODE] == name
    assert annotations[hami.ANN_BIND_PHASE] == "allocating"
    assert int(annotations[hami.ANN_BIND_TIME]) > 0 and int(annotations[hami.ANN_VGPU_TIME]) > 0
    allocation = state.allocations[pod_b["metadata"]["uid"]]
    # Bound in the cluster and in flight: the bind left the `bound` mark to the agent's
    # Allocate (one ledger write fewer), and the reservation holds the room until then.
    assert allocation.state == AllocationState.RESERVED and allocation.container_names == ["main"]
    assert allocation.expires_at is not None and allocation.expires_at > time.time() + 10
    assert service.scheduler.releaser.bound_unmarked[pod_b["metadata"]["uid"]][0] == name


async def test_bound_event_is_published_once(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    spec = cluster.add_pod(pod(container(mem=1000)))
    sub = await nc.subscribe(bus.alloc_event_subject(name, "bound"))
    await bus.flush(nc)  # in place before another connection publishes
    async with http_client(service) as client:
        await filter_call(client, spec, [name])
        assert await bind_call(client, spec, name) == ""
        assert await bind_call(client, spec, name) == ""  # a retried bind succeeds quietly
    event = decode((await sub.next_msg(timeout=20)).data, AllocationEvent)
    assert event.pod_uid == spec["metadata"]["uid"] and event.event_id.endswith(":bound")


async def test_pod_without_gpu_passes_untouched(
    make_service: MakeService, buckets: Buckets
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n")))
    plain = pod({"name": "web", "image": "nginx"})
    async with http_client(service) as client:
        result = await filter_call(client, plain, [name, "not-a-gpu-node"])
    assert result["nodenames"] == [name, "not-a-gpu-node"] and not result["failedNodes"]
    assert await bus.read(buckets.ledger, name, NodeLedger) is None


async def test_full_nodes_path_has_no_side_effects_and_bind_reserves(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    small = await setup_node(buckets, service, node(unique("small"), gpus=1, memory_mib=8 * GIB))
    big = await setup_node(buckets, service, node(unique("big"), gpus=1, memory_mib=80 * GIB))
    spec = cluster.add_pod(pod(container(mem=10 * GIB)))
    node_list = {"items": [{"metadata": {"name": small}}, {"metadata": {"name": big}}]}
    async with http_client(service) as client:
        response = await client.post("/filter", json={"pod": spec, "nodes": node_list})
        result = response.json()
        assert [n["metadata"]["name"] for n in result["nodes"]["items"]] == [big]
        assert result["failedNodes"] == {small: "1/1 CardInsufficientMemory"}
        assert await bus.read(buckets.ledger, big, NodeLedger) is None
        assert await bind_call(client, spec, big) == ""
    entry = await ledger(buckets, big)  # bound, in flight: the mark is left to the Allocate
    uid = spec["metadata"]["uid"]
    assert entry.allocations[uid].state == "reserved" and uid in entry.claims


async def last_event(nc: Any, subject: str, timeout: float = 20.0) -> bytes:
    """The newest event on `subject` in the event stream, waiting for it to land."""
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return (await js.get_last_msg(bus.EVENTS_STREAM, subject)).data
        except NotFoundError:
            assert asyncio.get_running_loop().time() < deadline, f"no event on {subject}"
            await asyncio.sleep(0.05)


async def test_refusal_reports_reasons_event_and_explain(
    make_service: MakeService, buckets: Buckets, nc: Any, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    full = await setup_node(buckets, service, node(unique("n"), gpus=2, memory_mib=8 * GIB))
    spec = cluster.add_pod(pod(container(mem=20 * GIB), namespace=unique("ns")))
    async with http_client(service) as client:
        result = await filter_call(client, spec, [full, "ghost"])
    assert result["nodenames"] == []
    assert result["failedNodes"][full] == "2/2 CardInsufficientMemory"
    assert result["failedNodes"]["ghost"].startswith("NodeUnregistered")
    # The event stream is the public API: the event must land there (published in the
    # background after the answer, retried until acked; on a starved loop that takes a while).
    event = decode(await last_event(nc, bus.sched_failed_subject(spec["metadata"]["namespace"])),
                   SchedulingFailedEvent)  # fmt: skip
    assert event.node_reasons[full] == "2/2 CardInsufficientMemory"
    ask = ExplainRequest(namespace=spec["metadata"]["namespace"], name=spec["metadata"]["name"])
    reply = decode((await nc.request(bus.SCHEDULER_EXPLAIN, encode(ask), timeout=10)).data,
                   ExplainReply)  # fmt: skip
    assert reply.pending and reply.node_reasons[full] == "2/2 CardInsufficientMemory"


async def test_unbound_reservation_expires_and_is_released(
    make_service: MakeService, buckets: Buckets, nc: Any, cluster: InMemoryCluster
) -> None:
    service = await make_service({"reservation_ttl_s": 0.3})
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    spec = cluster.add_pod(pod(container(mem=1000)))
    sub = await nc.subscribe(bus.alloc_event_subject(name, "released"))
    await bus.flush(nc)  # in place before another connection publishes
    async with http_client(service) as client:
        assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
    assert spec["metadata"]["uid"] in (await ledger(buckets, name)).allocations
    event = decode((await sub.next_msg(timeout=20)).data, AllocationEvent)
    assert event.pod_uid == spec["metadata"]["uid"]
    assert (await ledger(buckets, name)).allocations == {}


async def test_ended_and_deleted_pods_are_released(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    done = cluster.add_pod(pod(container(mem=1000)))
    gone = cluster.add_pod(pod(container(mem=1000)))
    async with http_client(service) as client:
        for spec in (done, gone):
            await filter_call(client, spec, [name])
            assert await bind_call(client, spec, name) == ""
            await agent_allocate(buckets, name, spec["metadata"]["uid"])
    finished = cluster.pods[("default", done["metadata"]["name"])]
    finished["status"]["phase"] = "Succeeded"
    cluster.update_pod(finished)
    cluster.delete_pod("default", gone["metadata"]["name"])
    await wait_until(lambda: not service.index.pod_nodes.get(done["metadata"]["uid"])
                     and not service.index.pod_nodes.get(gone["metadata"]["uid"]))  # fmt: skip
    assert (await ledger(buckets, name)).allocations == {}


async def test_init_containers_done_shrinks_usage(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=10 * GIB))
    spec = cluster.add_pod(
        pod(container("app", mem=3 * GIB), init=[container("init", mem=8 * GIB)])
    )
    async with http_client(service) as client:
        await filter_call(client, spec, [name])
        assert await bind_call(client, spec, name) == ""
    assert service.index.node(name).cards[0].used_mem == 8 * GIB
    running = cluster.pods[("default", spec["metadata"]["name"])]
    running["status"] = {
        "phase": "Running",
        "initContainerStatuses": [
            {"name": "init", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
        ],
    }
    cluster.update_pod(running)
    await wait_until(lambda: service.index.node(name).cards[0].used_mem == 3 * GIB)
    assert (await ledger(buckets, name)).allocations[spec["metadata"]["uid"]].init_done


async def test_init_containers_done_after_a_restart(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """A replica started after the bind holds the allocation as read at start-up (not built into
    a model): the pod's init containers finishing still marks it and shrinks the usage."""
    first = await make_service()
    name = await setup_node(buckets, first, node(unique("n"), gpus=1, memory_mib=10 * GIB))
    spec = cluster.add_pod(
        pod(container("app", mem=3 * GIB), init=[container("init", mem=8 * GIB)])
    )
    async with http_client(first) as client:
        await filter_call(client, spec, [name])
        assert await bind_call(client, spec, name) == ""
    uid = spec["metadata"]["uid"]
    await agent_allocate(buckets, name, uid)
    await first.stop()
    second = await make_service()
    await second.wait_ready()
    assert second.index.node(name).cards[0].used_mem == 8 * GIB
    assert type(second.index.entries[name].view).__name__ == "LedgerWire"  # as read
    running = cluster.pods[("default", spec["metadata"]["name"])]
    running["status"] = {
        "phase": "Running",
        "initContainerStatuses": [
            {"name": "init", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
        ],
    }
    cluster.update_pod(running)
    await wait_until(lambda: second.index.node(name).cards[0].used_mem == 3 * GIB)
    assert (await ledger(buckets, name)).allocations[uid].init_done


async def test_quota_refusal_and_timeout_are_clear(
    make_service: MakeService, buckets: Buckets, nc: Any, cluster: InMemoryCluster
) -> None:
    service = await make_service({"quota_enabled": True, "request_timeout_s": 0.3})
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    namespace = unique("ns")
    async with http_client(service) as client:
        # No quota service answers: a refusal after the timeout, never a hang.
        spec = cluster.add_pod(pod(container(mem=1000), namespace=namespace))
        result = await filter_call(client, spec, [name])
        assert "quota service did not answer" in result["failedNodes"][name]

        async def deny(msg: Any) -> None:
            request = decode(msg.data, QuotaRequest)
            if request.namespace == namespace:
                await msg.respond(encode(QuotaReply(ok=False, reason="limits.gpumem 500 exceeded")))

        sub = await nc.subscribe(bus.QUOTA_RESERVE, cb=deny)
        await bus.flush(nc)
        # An answer is due now: give it a busy host's time (the timeout is read per call).
        service.settings.request_timeout_s = 10.0
        try:
            spec = cluster.add_pod(pod(container(mem=1000), namespace=namespace))
            result = await filter_call(client, spec, [name])
        finally:
            await sub.unsubscribe()
    assert result["failedNodes"][name].startswith("ResourceQuotaNotFit: limits.gpumem 500")
    assert await bus.read(buckets.ledger, name, NodeLedger) is None


async def test_lapsed_claim_is_taken_over_and_bind_wait_is_bounded(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service(config={"claim_ttl_s": 0.6, "bind_timeout_s": 0.2})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    # Two layouts (one GPU container, then two): the second cannot fly beside the first.
    first = cluster.add_pod(pod(container(mem=1000)))
    second = cluster.add_pod(pod(container("x", mem=1000), container("y", mem=1000)))
    async with http_client(service) as client:
        for spec in (first, second):
            await filter_call(client, spec, [name])
        assert await bind_call(client, first, name) == ""
        # No Allocate comes for the first pod: the second waits at most bind_timeout_s ...
        error = await bind_call(client, second, name)
        assert "is busy" in error
        # ... and once the claim lapsed, a bind takes it over.
        await asyncio.sleep(0.5)
    service.config.bind_timeout_s = 2.0
    async with http_client(service) as client:
        await filter_call(client, second, [name])
        assert await bind_call(client, second, name) == ""
    state = await ledger(buckets, name)
    assert set(state.claims) == {second["metadata"]["uid"]}


async def test_readiness_and_metrics(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=1000))
    async with http_client(service) as client:
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        await filter_call(client, cluster.add_pod(pod(container(mem=5000))), [name])
        text = (await client.get("/metrics")).text
    assert "tessera_scheduler_filter_seconds_bucket" in text
    assert 'tessera_scheduler_refusals_total{reason="CardInsufficientMemory"} 1.0' in text
    assert "tessera_scheduler_inflight_claims" in text


async def test_device_cordon_setting_excludes_cards(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    name = unique("n")
    service = await make_service(config={"device_cordon": f"GPU-{name}-0"})
    await setup_node(buckets, service, node(name, gpus=2))
    async with http_client(service) as client:
        spec = cluster.add_pod(pod(container(gpus=2, mem=1000)))
        result = await filter_call(client, spec, [name])
    assert result["failedNodes"][name] == (
        "1/2 AllocatedCardsInsufficientRequest, 1/2 CardCordoned"
    )


async def test_node_policy_binpack_and_spread(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    busy = await setup_node(buckets, service, node(unique("busy"), gpus=1))
    idle = await setup_node(buckets, service, node(unique("idle"), gpus=1))
    first = cluster.add_pod(pod(container(mem=10 * GIB)))
    async with http_client(service) as client:
        # Put one pod on `busy` (only candidate) and let it be allocated, then ask again.
        await filter_call(client, first, [busy])
        assert await bind_call(client, first, busy) == ""
        await agent_allocate(buckets, busy, first["metadata"]["uid"])
        await wait_until(lambda: not service.index.busy[service.index.entries[busy].slot])
        packed = await filter_call(client, cluster.add_pod(pod(container(mem=1000))), [idle, busy])
        spread_pod = cluster.add_pod(pod(container(mem=1000),
                         annotations={"hami.io/node-scheduler-policy": "spread"}))  # fmt: skip
        spread = await filter_call(client, spread_pod, [busy, idle])
        scores = (await client.post("/prioritize", json={
            "pod": pod(container(mem=1000)), "nodenames": [idle, busy]})).json()  # fmt: skip
    assert packed["nodenames"] == [busy]
    assert spread["nodenames"] == [idle]
    assert scores[0]["host"] == idle and scores[1]["score"] >= scores[0]["score"]


async def test_nodes_with_a_bind_in_flight_go_last(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    fuller = await setup_node(buckets, service, node(unique("fuller"), gpus=1))
    other = await setup_node(buckets, service, node(unique("other"), gpus=1))

    def spec(mem: int) -> dict[str, Any]:
        return cluster.add_pod(pod(container(mem=mem)))

    async with http_client(service) as client:
        await filter_call(client, spec(10 * GIB), [fuller])  # reserved, unbound
        chosen = await filter_call(client, spec(1000), [fuller, other])
        service.config.avoid_busy_nodes = False
        packed = await filter_call(client, spec(1000), [other, fuller])
    assert chosen["nodenames"] == [other]  # binpack would pick `fuller`, but its bind is pending
    assert packed["nodenames"] == [fuller]


async def test_scaled_device_advertises_more_memory(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service({"device_memory_scaling": 2})
    scaled = unique("n")
    registration = node(scaled, gpus=1, memory_mib=160 * GIB)
    registration.devices[0].physical_memory_mib = 80 * GIB
    await setup_node(buckets, service, registration)
    assert device().memory_mib == 80 * GIB
    async with http_client(service) as client:
        result = await filter_call(client, cluster.add_pod(pod(container(mem=100 * GIB))), [scaled])
    assert result["nodenames"] == [scaled]


async def test_bind_of_a_pod_without_gpu_just_binds(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    plain = cluster.add_pod(pod({"name": "web", "image": "nginx"}))
    async with http_client(service) as client:
        assert await bind_call(client, plain, "cpu-only-node") == ""
    assert cluster.pods[("default", plain["metadata"]["name"])]["spec"]["nodeName"] == (
        "cpu-only-node"
    )
    assert await bus.read(buckets.ledger, "cpu-only-node", NodeLedger) is None


async def test_quota_is_held_with_the_reservation_and_released_with_the_pod(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any
) -> None:
    # A busy host's time for every quota answer: this test is not about the timeout.
    service = await make_service({"quota_enabled": True, "request_timeout_s": 10})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    namespace = unique("ns")
    seen: dict[str, list[QuotaRequest]] = {"reserve": [], "release": []}

    def responder(kind: str) -> Any:
        async def answer(msg: Any) -> None:
            request = decode(msg.data, QuotaRequest)
            if request.namespace == namespace:
                seen[kind].append(request)
                await msg.respond(encode(QuotaReply(ok=True)))

        return answer

    subs = [await nc.subscribe(bus.QUOTA_RESERVE, cb=responder("reserve")),
            await nc.subscribe(bus.QUOTA_RELEASE, cb=responder("release"))]  # fmt: skip
    await bus.flush(nc)
    spec = cluster.add_pod(pod(container(gpus=2, mem=3000, cores=20), namespace=namespace))
    try:
        async with http_client(service) as client:
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
            assert await bind_call(client, spec, name) == ""
        allocation = (await ledger(buckets, name)).allocations[spec["metadata"]["uid"]]
        assert allocation.quota_held
        charge = seen["reserve"][0]
        assert (charge.memory_mib, charge.cores, charge.gpus) == (6000, 40, 2)
        cluster.delete_pod(namespace, spec["metadata"]["name"])
        await wait_until(lambda: bool(seen["release"]), timeout=15)
        assert seen["release"][0].pod_uid == spec["metadata"]["uid"]
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def test_reservation_lapsing_during_a_claim_wait_is_renewed(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service(
        {"reservation_ttl_s": 0.3}, {"claim_ttl_s": 1.0, "bind_timeout_s": 3.0}
    )
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    first, second = (cluster.add_pod(pod(container(mem=1000))) for _ in range(2))
    async with http_client(service) as client:
        await filter_call(client, first, [name])
        assert await bind_call(client, first, name) == ""  # holds the claim; no Allocate comes
        await filter_call(client, second, [name])
        # The second pod's reservation lapses while it waits; the claim lapses later: the bind
        # renews the reservation and takes the claim over instead of failing.
        assert await bind_call(client, second, name) == ""
        await asyncio.sleep(0.4)
        # A filter retried after its reservation lapsed places the pod again, never answering
        # with the stale node alone.
        third = cluster.add_pod(pod(container(mem=1000)))
        await filter_call(client, third, [name])
        await asyncio.sleep(0.4)
        assert (await filter_call(client, third, [name]))["nodenames"] == [name]
    state = await ledger(buckets, name)
    assert state.allocations[second["metadata"]["uid"]].state == AllocationState.BOUND
    assert state.allocations[third["metadata"]["uid"]].expires_at > time.time()


async def test_binder_dying_mid_bind_is_adopted_by_the_sweeper(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service(config={"orphaned_bind_s": 0.3})
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    spec = cluster.add_pod(pod(container(mem=1000)))
    meta = spec["metadata"]
    async with http_client(service) as client:
        await filter_call(client, spec, [name])
    # A replica took the claim and bound the pod in the cluster, then died before marking it.
    await service.scheduler.ledger.claim(name, meta["uid"], "dead-replica", time.time(), 30)
    await cluster.bind_pod("default", meta["name"], meta["uid"], name)
    await wait_until(
        lambda: service.index.entries[name].ledger.allocations[meta["uid"]].state == "bound"
    )
    state = await ledger(buckets, name)
    assert set(state.claims) == {meta["uid"]}  # still the agent's cue


async def test_bind_survives_a_failed_bound_write(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """The cluster bind happened, so a NATS hiccup while recording it is retried, never
    reported to kube-scheduler as a failed bind (a bind that writes the mark itself)."""
    service = await make_service(config={"mark_bound_at_bind": True})
    name = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=80 * GIB))
    spec = cluster.add_pod(pod(container(mem=10 * GIB, cores=10)))
    real_mark_bound = service.scheduler.ledger.mark_bound
    failures = []

    async def flaky_mark_bound(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(1)
            raise TimeoutError("nats: timeout")
        return await real_mark_bound(*args, **kwargs)

    service.scheduler.ledger.mark_bound = flaky_mark_bound
    async with http_client(service) as client:
        assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        assert await bind_call(client, spec, name) == ""
    assert failures == [1]
    allocation = (await ledger(buckets, name)).allocations[spec["metadata"]["uid"]]
    assert allocation.state == AllocationState.BOUND
    assert cluster.pods[("default", spec["metadata"]["name"])]["spec"]["nodeName"] == name


async def test_explain_by_name_finds_a_placed_pod(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=80 * GIB))
    spec = cluster.add_pod(pod(container(mem=10 * GIB, cores=10), namespace=unique("ns")))
    async with http_client(service) as client:
        assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        assert await bind_call(client, spec, name) == ""
    ask = ExplainRequest(namespace=spec["metadata"]["namespace"], name=spec["metadata"]["name"])
    reply = decode((await nc.request(bus.SCHEDULER_EXPLAIN, encode(ask), timeout=10)).data,
                   ExplainReply)  # fmt: skip
    assert reply.ok and not reply.pending and reply.node == name
    # Another pod's name in the same namespace is not mistaken for it.
    other = ExplainRequest(namespace=spec["metadata"]["namespace"], name="someone-else")
    reply = decode((await nc.request(bus.SCHEDULER_EXPLAIN, encode(other), timeout=10)).data,
                   ExplainReply)  # fmt: skip
    assert reply.node != name
