"""Several pods in flight on one node (bind -> the agent's Allocate), and init-container reuse.

Against the real NATS ledger and an in-memory cluster: pods that a crossed guess cannot hurt
(one shape, or one GPU layout) bind together without waiting for any Allocate; a pod of another
shape on other cards waits for the pods in flight, and its wait decides on the index, never
re-reading the node's entry from the KV on every change. Placement follows kubelet's device
reuse for init containers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tessera.scheduler.cards import build_cards
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, parse_pod_options

from tessera.hami import PodRequest, parse_pod_request
from tessera.models import AllocationState, DeviceGrant
from tessera.settings import TesseraSettings

from .conftest import MakeService, agent_allocate, http_client, wait_until
from .factories import GIB, container, node, pod
from .test_extender import bind_call, filter_call, ledger, setup_node, unique
from .test_hami_migration import hami_pod


async def place_and_bind(client: Any, spec: dict[str, Any], name: str) -> str:
    assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
    return await bind_call(client, spec, name)


async def test_pods_of_one_shape_bind_together_without_any_allocate(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """Twelve identical pods on one 4-GPU node (spread over the cards): no Allocate comes, yet
    every bind returns at once and all twelve are in flight together."""
    service = await make_service(config={"bind_timeout_s": 3.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=4))
    specs = [cluster.add_pod(pod(container(mem=2 * GIB, cores=10))) for _ in range(12)]
    async with http_client(service) as client:
        for spec in specs:
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        errors = await asyncio.gather(*(bind_call(client, s, name) for s in specs))
    assert errors == [""] * 12
    state = await ledger(buckets, name)
    assert len(state.claims) == 12
    assert {len({g.uuid for a in state.allocations.values() for g in a.containers[0]})} == {4}
    # Nobody waited for another's Allocate (counted, not timed: a loaded host slows every bind
    # alike; none comes, so a wait would also end in the bind timeout's error above).
    assert service.metrics.claim_waits._value.get() == 0


async def test_another_shape_whose_cards_could_not_be_exchanged_waits(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """4 GiB on card 0 (beside 5 GiB already running there) and 9 GiB on card 1 of 10 GiB
    cards: a cross between them would need 14 GiB on card 0, so the second waits."""
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=2, memory_mib=10 * GIB))
    on = {n: {"nvidia.com/use-gpuuuid": f"GPU-{name}-{n}"} for n in (0, 1)}
    filler = cluster.add_pod(pod(container(mem=5 * GIB), annotations=on[0]))
    first = cluster.add_pod(pod(container(mem=4 * GIB), annotations=on[0]))
    other = cluster.add_pod(pod(container(mem=9 * GIB), annotations=on[1]))
    async with http_client(service) as client:
        assert await place_and_bind(client, filler, name) == ""
        await agent_allocate(buckets, name, filler["metadata"]["uid"])
        assert await place_and_bind(client, first, name) == ""
        assert (await filter_call(client, other, [name]))["nodenames"] == [name]
        waiting = asyncio.create_task(bind_call(client, other, name))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # a cross between them could not be repaired in place
        await agent_allocate(buckets, name, first["metadata"]["uid"])
        assert await asyncio.wait_for(waiting, 30) == ""
    state = await ledger(buckets, name)
    cards = {a.name: a.containers[0][0].uuid for a in state.allocations.values()}
    assert cards[first["metadata"]["name"]] != cards[other["metadata"]["name"]]
    assert set(state.claims) == {other["metadata"]["uid"]}


async def test_other_amounts_of_one_layout_whose_cards_could_be_exchanged_go_together(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """1-GPU pods of 1, 3 and 5 GiB on roomy cards: a cross between any two is repaired by
    trading cards (each keeps its amounts), which fits, so none waits for another's Allocate."""
    service = await make_service(config={"bind_timeout_s": 3.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    specs = [cluster.add_pod(pod(container(mem=m * GIB, cores=c)))
             for m, c in ((1, 5), (3, 10), (5, 20), (3, 10))]  # fmt: skip
    async with http_client(service) as client:
        for spec in specs:
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        errors = await asyncio.gather(*(bind_call(client, s, name) for s in specs))
    assert errors == [""] * 4
    assert set((await ledger(buckets, name)).claims) == {s["metadata"]["uid"] for s in specs}
    assert service.metrics.claim_waits._value.get() == 0


async def test_a_trade_onto_a_card_a_hami_pod_holds_waits(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """A cluster migrating from HAMi: a HAMi pod holds 6 GiB of card 1 (10 GiB cards). A (5 GiB,
    card 0) is in flight; B (3 GiB) goes on card 1. On Tessera's ledger alone the trade that
    repairs a cross fits (A's 5 GiB onto card 1); with the HAMi pod it would put 11 GiB on
    card 1, so B waits for A's Allocate instead of flying beside it."""
    service = await make_service(config={"bind_timeout_s": 5.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2, memory_mib=10 * GIB))
    cluster.add_pod(hami_pod("trainer", name, f"GPU-{name}-1,NVIDIA-A10,{6 * GIB},10:;",
                             mem=6 * GIB, cores=10))  # fmt: skip
    await wait_until(lambda: bool(service.index.foreign_allocations(name)))
    on = {n: {"nvidia.com/use-gpuuuid": f"GPU-{name}-{n}"} for n in (0, 1)}
    first = cluster.add_pod(pod(container(mem=5 * GIB, cores=10), annotations=on[0]))
    other = cluster.add_pod(pod(container(mem=3 * GIB, cores=10), annotations=on[1]))
    async with http_client(service) as client:
        assert await place_and_bind(client, first, name) == ""
        assert (await filter_call(client, other, [name]))["nodenames"] == [name]
        waiting = asyncio.create_task(bind_call(client, other, name))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the trade would overfill the HAMi pod's card
        assert set((await ledger(buckets, name)).claims) == {first["metadata"]["uid"]}
        await agent_allocate(buckets, name, first["metadata"]["uid"])
        assert await asyncio.wait_for(waiting, 30) == ""
    assert set((await ledger(buckets, name)).claims) == {other["metadata"]["uid"]}
    assert service.metrics.claim_waits._value.get() == 1


async def test_shapes_kubelet_tells_apart_are_in_flight_together(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """Pods whose admissions start with different device counts (1, 2, 3 GPUs, each its own
    amounts) and a second 1-GPU pod of the first one's shape: kubelet's request names the count,
    so no cross between them is possible, and none waits for another's Allocate."""
    service = await make_service(config={"bind_timeout_s": 3.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=4))
    specs = [cluster.add_pod(pod(container(gpus=n, mem=m * GIB, cores=c)))
             for n, m, c in ((1, 2, 10), (2, 5, 20), (3, 7, 15), (1, 2, 10))]  # fmt: skip
    async with http_client(service) as client:
        for spec in specs:
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        errors = await asyncio.gather(*(bind_call(client, s, name) for s in specs))
    assert errors == [""] * 4
    state = await ledger(buckets, name)
    assert set(state.claims) == {s["metadata"]["uid"] for s in specs}
    assert service.metrics.claim_waits._value.get() == 0


async def test_a_waiting_shape_is_not_starved_by_a_stream_of_another(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """A1 in flight; B (another shape) waits for it; A2 (A1's shape) comes after B has waited a
    while: it could join A1 at once, but queues behind B, so a stream of A pods cannot starve
    B."""
    service = await make_service(config={"bind_timeout_s": 10.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    on = {n: {"nvidia.com/use-gpuuuid": f"GPU-{name}-{n}"} for n in (0, 1)}
    a1, a2 = (cluster.add_pod(pod(container(mem=GIB), annotations=on[0])) for _ in range(2))
    # Two GPU containers: another layout than A's, so a cross could not be repaired.
    b = cluster.add_pod(pod(container("x", mem=GIB), container("y", mem=GIB),
                            annotations=on[1]))  # fmt: skip
    async with http_client(service) as client:
        assert await place_and_bind(client, a1, name) == ""
        for spec in (b, a2):
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        bind_b = asyncio.create_task(bind_call(client, b, name))
        await asyncio.sleep(3.2)  # B has waited longer than FAIR_AFTER_S
        bind_a2 = asyncio.create_task(bind_call(client, a2, name))
        await asyncio.sleep(0.3)
        assert not bind_b.done() and not bind_a2.done()  # A2 queues behind B
        await agent_allocate(buckets, name, a1["metadata"]["uid"])
        assert await asyncio.wait_for(bind_b, 30) == ""
        await asyncio.sleep(0.3)
        assert not bind_a2.done()  # B is in flight now: A2, another shape, waits for it
        await agent_allocate(buckets, name, b["metadata"]["uid"])
        assert await asyncio.wait_for(bind_a2, 30) == ""


async def test_waiting_binds_do_not_reread_the_ledger_on_every_change(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    """Eight binds of another shape wait while twenty pods of one shape come and go on the
    node: the waiters decide on the index the watch keeps, so KV reads stay few."""
    service = await make_service(config={"bind_timeout_s": 20.0})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2, split=40))
    kv = service.scheduler.ledger.kv
    reads = [0]
    real_get = kv.get

    async def counting_get(key: str, *args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        return await real_get(key, *args, **kwargs)

    kv.get = counting_get  # type: ignore[method-assign]
    on = {n: {"nvidia.com/use-gpuuuid": f"GPU-{name}-{n}"} for n in (0, 1)}
    small = [cluster.add_pod(pod(container(mem=1 * GIB, cores=1), annotations=on[0]))
             for _ in range(20)]  # fmt: skip
    big = [cluster.add_pod(pod(container("x", mem=GIB, cores=1), container("y", mem=GIB, cores=1),
                               annotations=on[1]))
           for _ in range(8)]  # another layout: they wait  # fmt: skip
    async with http_client(service) as client:
        assert await place_and_bind(client, small[0], name) == ""
        for spec in big:
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        waiters = [asyncio.create_task(bind_call(client, s, name)) for s in big]
        await asyncio.sleep(0.2)
        reads[0] = 0
        for spec in small[1:]:  # 19 more changes to the node's entry while they wait
            assert (await filter_call(client, spec, [name]))["nodenames"] == [name]
        changes_reads = reads[0]
        await agent_allocate(buckets, name, small[0]["metadata"]["uid"])
        assert await asyncio.wait_for(asyncio.gather(*waiters), 30) == [""] * 8
    # 19 reservations each wake the 8 waiters: re-reading would be 150+ reads. Allow for the
    # few CAS retries a conflict with the watch can cause.
    assert changes_reads <= 20, changes_reads


async def test_cap_of_one_restores_the_one_claim_per_node_behaviour(
    make_service: MakeService, buckets: Any, cluster: Any
) -> None:
    service = await make_service(config={"max_in_flight_per_node": 1})
    name = await setup_node(buckets, service, node(unique("n"), gpus=2))
    a, b = (cluster.add_pod(pod(container(mem=GIB))) for _ in range(2))
    async with http_client(service) as client:
        assert await place_and_bind(client, a, name) == ""
        assert (await filter_call(client, b, [name]))["nodenames"] == [name]
        waiting = asyncio.create_task(bind_call(client, b, name))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await agent_allocate(buckets, name, a["metadata"]["uid"])
        assert await asyncio.wait_for(waiting, 30) == ""
    state = await ledger(buckets, name)
    assert state.allocations[a["metadata"]["uid"]].state == AllocationState.ALLOCATED


# --- init containers: kubelet hands their devices to later containers first -------------------


def fit(spec: dict[str, Any], gpus: int = 4, policy: str = "spread") -> list[list[DeviceGrant]]:
    settings = TesseraSettings(gpu_scheduler_policy=policy)
    request: PodRequest = parse_pod_request(spec, settings)
    cards = build_cards(node("n", gpus=gpus), [], 0.0)
    outcome = fit_pod(cards, request, FitContext(parse_pod_options(spec, settings)))
    assert outcome.ok, outcome.reason_text()
    return outcome.containers


def cards_of(grants: list[DeviceGrant]) -> list[str]:
    return [g.uuid for g in grants]


def test_app_container_goes_on_its_init_containers_card() -> None:
    spec = pod(container("app", mem=2 * GIB), init=[container("init", mem=5 * GIB)])
    init, app = fit(spec)
    assert cards_of(app) == cards_of(init)  # kubelet gives the app the init's device first
    assert app[0].memory_mib == 2 * GIB and init[0].memory_mib == 5 * GIB


def test_init_needing_more_than_its_app_and_more_cards_than_one() -> None:
    """Init: 2 cards × 30 GiB; app: 3 cards × 10 GiB. kubelet gives the app both init devices,
    then one new one: the app's grants name both init cards and one more."""
    spec = pod(container("app", gpus=3, mem=10 * GIB),
               init=[container("init", gpus=2, mem=30 * GIB)])  # fmt: skip
    init, app = fit(spec)
    assert set(cards_of(init)) < set(cards_of(app)) and len(set(cards_of(app))) == 3


def test_second_app_container_gets_new_cards_once_the_pool_is_used() -> None:
    spec = pod(container("a", mem=GIB), container("b", mem=GIB),
               init=[container("init", mem=GIB)])  # fmt: skip
    init, a, b = fit(spec)
    assert cards_of(a) == cards_of(init) and cards_of(b) != cards_of(init)


def test_an_init_card_too_small_for_the_app_refuses_the_node() -> None:
    """kubelet will hand the app the init's card whatever else is free: if the app cannot fit
    there, the node does not fit (never a grant kubelet would not give)."""
    settings = TesseraSettings()
    spec = pod(container("app", mem=70 * GIB), init=[container("init", mem=5 * GIB)],
               annotations={"nvidia.com/use-gpuuuid": "GPU-n-0"})  # fmt: skip
    registration = node("n", gpus=2)
    # Card 0 already holds 20 GiB of another pod: the init fits there, the app does not.
    from tessera.models import Allocation

    other = Allocation(pod_uid="o", namespace="ns", name="o", node="n",
                       state=AllocationState.ALLOCATED,
                       containers=[[DeviceGrant(uuid="GPU-n-0", type="T", memory_mib=20 * GIB,
                                                cores=0)]])  # fmt: skip
    cards = build_cards(registration, [other], 0.0)
    outcome = fit_pod(cards, parse_pod_request(spec, settings),
                      FitContext(parse_pod_options(spec, settings)))  # fmt: skip
    assert not outcome.ok and "CardInsufficientMemory" in outcome.reason_text()
