"""A DRA claim shared by two pods of a node, handed on when its first pod ends, over real
unix-socket gRPC (the test plays kubelet), a real nats-server and a real quota service.

The first pod holds two claims: one shared with a second pod, one its own. When it is deleted,
the driver's pod watch hands the shared claim on at once (the periodic reconcile is set an hour
away: only the watch can do it), in ONE quota write that frees exactly the shared claim's part
of the first pod's charge and holds the second pod's, in a namespace at its limit. Every state
the quota service writes is read (a KV watch on the namespace's state): the slice is counted
once at every moment. Then the same hand-on cut short by a node agent stopped in its middle, by
a quota service that is away, and by NATS restarting between its quota and ledger writes: each
is finished later (at the agent's start, or by the reconcile), nothing lost, nothing counted
twice."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tessera.node_agent.dra.quota import QuotaRefused
from tessera.quota import QuotaService
from test_dra_driver import Harness, pod_and_claim, wait_for

from tessera import bus
from tessera.bus import connect, ensure_bus
from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import ClusterError
from tessera.codec import decode, encode
from tessera.models import (
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaState,
    QuotaStatusRequest,
)
from tessera.settings import NatsSettings, TesseraSettings

SHARED_MIB, OWN_MIB = 4096, 1024
LIMIT = QuotaAmount(memory_mib=SHARED_MIB + OWN_MIB, gpus=2)  # exactly what the pods hold


@pytest.fixture
def node() -> str:
    return f"hand-{uuid.uuid4().hex[:8]}"


@dataclass
class Sharing:
    """The first pod (its claim `shared`, used by its main container, and `own`, by its side
    container) and the second pod, which `shared` is reserved for too."""

    ns: str
    first: dict
    second: dict
    shared: dict
    own: dict
    uids: dict[str, str] = field(default_factory=dict)

    def end_first(self, cluster: InMemoryCluster) -> None:
        """The first pod is deleted; the claim controller takes it out of reservedFor."""
        cluster.delete_pod(self.ns, self.first["metadata"]["name"])
        for claim in (self.shared, self.own):
            claim["status"]["reservedFor"] = [
                r for r in claim["status"]["reservedFor"] if r["uid"] != self.uids["first"]]
            cluster.put_resource_claim(claim)


def sharing(node: str, ns: str) -> Sharing:
    first, shared = pod_and_claim(node, "gpu-1", "4Gi", "30", namespace=ns)
    _other, own = pod_and_claim(node, "gpu-0", "1Gi", "10", namespace=ns)
    name, uid = first["metadata"]["name"], first["metadata"]["uid"]
    own["metadata"]["name"] = f"{name}-own-fghij"
    own["status"]["reservedFor"] = [{"resource": "pods", "name": name, "uid": uid}]
    first["spec"]["resourceClaims"].append({"name": "own", "resourceClaimTemplateName": "own"})
    first["spec"]["containers"][1]["resources"] = {"claims": [{"name": "own"}]}
    first["status"]["resourceClaimStatuses"].append(
        {"name": "own", "resourceClaimName": own["metadata"]["name"]})
    second = copy.deepcopy(first)
    second["metadata"].update(name=f"second-{uid[:6]}", uid=str(uuid.uuid4()))
    second["spec"]["resourceClaims"] = second["spec"]["resourceClaims"][:1]
    second["spec"]["containers"][1]["resources"] = {}
    second["status"]["resourceClaimStatuses"] = second["status"]["resourceClaimStatuses"][:1]
    shared["status"]["reservedFor"].append(
        {"resource": "pods", "name": second["metadata"]["name"], "uid": second["metadata"]["uid"]})
    return Sharing(ns, first, second, shared, own,
                   {"first": uid, "second": second["metadata"]["uid"]})  # fmt: skip


@dataclass
class Rig:
    nc: object
    buckets: bus.Buckets
    cluster: InMemoryCluster
    ns: str
    s: Sharing

    async def quota(self) -> tuple[dict[str, int], tuple[int, int]]:
        """The namespace's charges by pod (MiB) and its use (MiB, GPUs), as status shows them."""
        msg = await self.nc.request(bus.QUOTA_STATUS, encode(QuotaStatusRequest(  # type: ignore[attr-defined]
            namespace=self.ns)), timeout=5)  # fmt: skip
        [state] = decode(msg.data, QuotaReply).states
        used = state.used()
        by_name = {v: k for k, v in self.s.uids.items()}
        return ({by_name[u]: c.memory_mib for u, c in state.charges.items()},
                (used.memory_mib or 0, used.gpus or 0))  # fmt: skip

    async def booked(self) -> dict[str, list[tuple[int, int, int]]]:
        """Each pod's booked slices in the node's ledger: (GPU index, MiB, cores)."""
        entry = await bus.read(self.buckets.ledger, self.s.first["spec"]["nodeName"], NodeLedger)
        assert entry is not None
        by_name = {v: k for k, v in self.s.uids.items()}
        return {by_name[u]: sorted((int(g.uuid[4:8]), g.memory_mib, g.cores)
                                   for row in a.containers for g in row)
                for u, a in entry.value.allocations.items() if u in by_name}  # fmt: skip

    async def prepare_all(self, h: Harness) -> None:
        for pod in (self.s.first, self.s.second):
            self.cluster.add_pod(pod)
        for claim in (self.s.shared, self.s.own):
            self.cluster.put_resource_claim(claim)
            answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
            assert answer.error == "", answer.error


BEFORE = {"first": [(0, OWN_MIB, 10), (1, SHARED_MIB, 30)]}
HANDED = {"first": [(0, OWN_MIB, 10)], "second": [(1, SHARED_MIB, 30)]}
HELD = (SHARED_MIB + OWN_MIB, 2)  # what the namespace uses throughout


@pytest.fixture
async def start_quota_on():
    """Quota services started on a given server (each its own connection), stopped after."""
    started: list[tuple[QuotaService, object]] = []
    consumer = f"quota-test-{uuid.uuid4().hex[:8]}"

    async def start(url: str, cluster: InMemoryCluster | None = None) -> QuotaService:
        client = await connect(NatsSettings(NATS_URL=url), name="quota-under-test")
        buckets = await ensure_bus(client.jetstream(), TesseraSettings())
        service = QuotaService(client, buckets, TesseraSettings(), consumer=consumer,
                               cluster=cluster)  # fmt: skip
        await service.start()
        started.append((service, client))
        return service

    yield start
    for service, client in started:
        await asyncio.wait_for(service.stop(), 20)
        if not client.is_closed:  # type: ignore[attr-defined]
            await client.close()  # type: ignore[attr-defined]


async def new_rig(nc, buckets, node: str) -> Rig:
    ns = f"q-{uuid.uuid4().hex[:8]}"
    reply = await nc.request(bus.QUOTA_SET, encode(QuotaSetRequest(namespace=ns, limits=LIMIT)),
                             timeout=5)  # fmt: skip
    assert decode(reply.data, QuotaReply).ok
    return Rig(nc, buckets, InMemoryCluster(), ns, sharing(node, ns))


def harness(base: Path, rig: Rig, node: str, interval_s: float) -> Harness:
    h = Harness(base, rig.nc, rig.buckets, node, rig.cluster, quota=True)
    h.dra = h.dra.model_copy(update={"publish_interval_s": interval_s})
    h.driver.dra = h.dra
    return h


def after_the_first_quota_write(h: Harness, then: Callable[[], Awaitable[None]]) -> None:
    """The driver's quota writes go through; right after the first one, `then()` runs inside the
    hand-on (a fault at that exact point: the agent stopped, the reply lost, NATS away)."""
    assert h.driver.quota is not None
    real_hold = h.driver.quota.hold
    first = [True]

    async def hold(*args, **kwargs):
        await real_hold(*args, **kwargs)
        if first[0]:
            first[0] = False
            await then()

    h.driver.quota.hold = hold  # type: ignore[method-assign]


async def test_a_shared_claim_is_handed_on_when_its_pod_ends_in_one_quota_write(
        short_dir, nc, nats_url, buckets, node, start_quota_on):  # fmt: skip
    quota = await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    async with harness(short_dir, rig, node, interval_s=3600) as h:
        await rig.prepare_all(h)
        assert await rig.quota() == ({"first": SHARED_MIB + OWN_MIB}, HELD)
        assert await rig.booked() == BEFORE
        watcher = await quota.store.counters.watch(rig.ns)
        assert await watcher.updates(5) is not None  # the state as it stands
        assert await watcher.updates(5) is None  # the end of the watch's history

        rig.s.end_first(rig.cluster)
        # the pod watch hands it on (the reconcile is an hour away)
        await wait_for_booked(rig, HANDED)
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)
        written = [await watcher.updates(5)]
        while decode(written[-1].value, QuotaState).charges.get(rig.s.uids["second"]) is None:
            written.append(await watcher.updates(5))  # (a background fold: no total changes)
        await watcher.stop()
        states = [decode(e.value, QuotaState) for e in written]
        used = [(s.used().memory_mib, s.used().gpus) for s in states]
        assert used == [HELD] * len(states), used  # never counted twice, never dropped
        # the hand-on is the first write after the deletion: no step in between
        assert {u: c.memory_mib for u, c in states[0].charges.items()} in (
            {rig.s.uids["first"]: OWN_MIB, rig.s.uids["second"]: SHARED_MIB}, {})

        # kubelet unprepares the first pod's own claim; the shared one stays the second's
        await h.kubelet_unprepare(rig.s.own)
        assert (await rig.quota())[0]["second"] == SHARED_MIB
        assert (await rig.booked())["second"] == HANDED["second"]


async def wait_for_booked(rig: Rig, wanted: dict, timeout: float = 15.0) -> None:
    """Until the ledger books `wanted` (a read that fails, NATS coming back, is tried again)."""
    deadline = asyncio.get_running_loop().time() + timeout
    seen: object = None
    while True:
        try:
            seen = await rig.booked()
        except Exception as exc:  # JetStream not serving yet
            seen = exc
        if seen == wanted:
            return
        assert asyncio.get_running_loop().time() < deadline, f"booked {seen!r}, not {wanted}"
        await asyncio.sleep(0.05)


async def test_a_node_agent_stopped_in_the_middle_of_a_hand_on_finishes_it_at_its_start(
        short_dir, nc, nats_url, buckets, node, start_quota_on):  # fmt: skip
    """Stopped after the quota write and before the ledger's: the restarted agent's first
    reconcile repeats the hand-on (the quota write finds it done) and moves the ledger."""
    await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    written = asyncio.Event()
    async with harness(short_dir, rig, node, interval_s=3600) as h:
        await rig.prepare_all(h)

        async def hang() -> None:
            written.set()
            await asyncio.Event().wait()  # the agent is stopped here

        after_the_first_quota_write(h, hang)
        rig.s.end_first(rig.cluster)
        await asyncio.wait_for(written.wait(), 15)
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)
        assert await rig.booked() == BEFORE  # the ledger not written yet
    # stopped (the hand-on cancelled in its middle); the ledger still books it under the first
    assert await rig.booked() == BEFORE
    async with harness(short_dir, rig, node, interval_s=3600):
        await wait_for_booked(rig, HANDED)  # at its start
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)


async def test_a_claim_relabelled_by_a_stopped_hand_on_is_scrubbed_at_unprepare(
        short_dir, nc, nats_url, buckets, node, start_quota_on):  # fmt: skip
    """Stopped after the hand-on relabelled the claim's directory for the second pod and before
    its record said so; the second pod ends too, and kubelet unprepares both claims before
    anything finishes the hand-on: no directory of either claim is left behind (its sealed
    limits, region and lease socket), though the record still names the first pod."""
    await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    relabelled = asyncio.Event()
    async with harness(short_dir, rig, node, interval_s=3600) as h:
        await rig.prepare_all(h)

        async def hang(*_args, **_kwargs) -> None:  # the hand-on's ledger write, after step 2
            relabelled.set()
            await asyncio.Event().wait()  # the agent is stopped here

        h.driver._write_ledger = hang  # type: ignore[method-assign]
        rig.s.end_first(rig.cluster)
        await asyncio.wait_for(relabelled.wait(), 15)
        second = rig.s.uids["second"]
        assert [c.prepared.pod_uid for c in h.store.all()].count(second) == 1  # relabelled
    # the second pod ends as well; the restarted agent finds no pod to hand the claim on to
    rig.cluster.delete_pod(rig.ns, rig.s.second["metadata"]["name"])
    rig.s.shared["status"]["reservedFor"] = []
    rig.cluster.put_resource_claim(rig.s.shared)
    async with harness(short_dir, rig, node, interval_s=3600) as h:
        for claim in (rig.s.shared, rig.s.own):
            answer = (await h.kubelet_unprepare(claim)).claims[claim["metadata"]["uid"]]
            assert answer.error == "", answer.error
        assert h.store.all() == []


async def test_a_quota_service_away_during_a_hand_on_leaves_it_to_the_reconcile(
        short_dir, nc, nats_url, buckets, node, start_quota_on):  # fmt: skip
    quota = await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    async with harness(short_dir, rig, node, interval_s=0.3) as h:
        await rig.prepare_all(h)
        await quota.stop()
        rig.s.end_first(rig.cluster)
        # the watch's hand-on and the reconciles find no quota service: nothing moves (the
        # charge stays the first pod's whole, counted once), and the ledger keeps the booking
        seen = h.endpoint.reconciles
        await wait_for(lambda: h.endpoint.reconciles >= seen + 2)
        assert await rig.booked() == BEFORE
        state = await bus.read(buckets.quota, rig.ns, QuotaState)
        assert state is not None
        assert (state.value.used().memory_mib, state.value.used().gpus) == HELD
        await start_quota_on(nats_url)  # back: the next reconcile hands it on
        await wait_for_booked(rig, HANDED)
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)


async def test_a_quota_service_older_than_the_hand_on_refuses_it_and_the_slice_waits(
        short_dir, nc, nats_url, buckets, node, start_quota_on, monkeypatch):  # fmt: skip
    """A mixed-version rollout: the node agent is new, the quota service one that reads only
    version 1 of QuotaRequest (built before `handed_from_keeps`: it would have freed the first
    pod's whole charge, its own claim's part included). The hand-on is written as version 2, so
    that service refuses it: nothing moves, the slice stays counted once under the first pod;
    once the quota service is upgraded the reconcile hands it on."""
    monkeypatch.setattr(QuotaRequest, "SCHEMA_VERSION", 1)  # what the older build reads
    older = await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    async with harness(short_dir, rig, node, interval_s=0.3) as h:
        await rig.prepare_all(h)  # (prepares reserve as version 1: the older service holds them)
        assert await rig.quota() == ({"first": SHARED_MIB + OWN_MIB}, HELD)
        refused = asyncio.Event()
        real_hold = h.driver.quota.hold  # type: ignore[union-attr]

        async def hold(*args, **kwargs):
            try:
                return await real_hold(*args, **kwargs)
            except QuotaRefused as exc:
                if "schema version 2 is not supported" in str(exc):
                    refused.set()
                raise

        h.driver.quota.hold = hold  # type: ignore[union-attr,method-assign]
        rig.s.end_first(rig.cluster)
        await asyncio.wait_for(refused.wait(), 15)
        seen = h.endpoint.reconciles
        await wait_for(lambda: h.endpoint.reconciles >= seen + 2)  # refused again, each round
        assert await rig.booked() == BEFORE
        assert await rig.quota() == ({"first": SHARED_MIB + OWN_MIB}, HELD)
        await older.stop()
        monkeypatch.undo()  # the upgraded quota service reads version 2
        await start_quota_on(nats_url)
        await wait_for_booked(rig, HANDED)
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)


async def test_a_quota_service_restarting_after_the_hand_on_write_before_its_reply(
        short_dir, nc, nats_url, buckets, node, start_quota_on):  # fmt: skip
    """The quota write is made, the reply is lost (the service stops): the charge has moved
    while the ledger still books the first pod. The service starts again (its stale-charge pass
    over the cluster's pods keeps the deleted pod's charge: the ledger books it as a DRA claim's);
    the reconcile repeats the hand-on, which finds the quota done, and moves the ledger."""
    quota = await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    async with harness(short_dir, rig, node, interval_s=0.3) as h:
        await rig.prepare_all(h)
        lost = asyncio.Event()

        async def lose_the_reply() -> None:
            lost.set()
            await quota.stop()
            raise QuotaRefused("the quota service did not answer (test: reply lost)")

        after_the_first_quota_write(h, lose_the_reply)
        rig.s.end_first(rig.cluster)
        await asyncio.wait_for(lost.wait(), 15)
        seen = h.endpoint.reconciles
        await wait_for(lambda: h.endpoint.reconciles >= seen + 2)  # tried again: no service
        assert await rig.booked() == BEFORE
        state = await bus.read(buckets.quota, rig.ns, QuotaState)
        assert state is not None
        assert {u: c.memory_mib for u, c in state.value.charges.items()} == {
            rig.s.uids["first"]: OWN_MIB, rig.s.uids["second"]: SHARED_MIB}
        assert (state.value.used().memory_mib, state.value.used().gpus) == HELD
        await start_quota_on(nats_url, cluster=rig.cluster)
        await wait_for_booked(rig, HANDED)
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)


async def test_nats_restarting_between_the_quota_and_ledger_writes_loses_nothing(
        short_dir, fresh_nats, node, start_quota_on):  # fmt: skip
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="hand-on-restart")
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        await start_quota_on(fresh_nats.url)
        rig = await new_rig(nc, buckets, node)
        async with harness(short_dir, rig, node, interval_s=0.3) as h:
            await rig.prepare_all(h)
            stopped = asyncio.Event()

            async def stop_nats() -> None:  # the first hand-on's quota write is done: NATS goes
                await asyncio.to_thread(fresh_nats.stop)
                stopped.set()

            after_the_first_quota_write(h, stop_nats)
            rig.s.end_first(rig.cluster)
            await asyncio.wait_for(stopped.wait(), 15)
            await asyncio.to_thread(fresh_nats.start)  # same port, same data: a broker restart
            # the ledger write failed with NATS away; a reconcile after it is back hands on
            await wait_for_booked(rig, HANDED, timeout=30)
            assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)
    finally:
        await nc.drain()


class ApiServerAwayAtFirst(InMemoryCluster):
    """The in-memory cluster whose first pod watches fail as an API server that is away."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def watch_pods(self, namespace=None, node_name=None):
        if self.failures > 0:
            self.failures -= 1
            return self._away()
        return super().watch_pods(namespace, node_name)

    async def _away(self):
        raise ClusterError("connection refused (test: API server away)")
        yield  # an async generator, as a watch is


async def test_a_pod_watch_that_fails_is_opened_again(
        short_dir, nc, nats_url, buckets, node, start_quota_on):  # fmt: skip
    """The API server is away when the driver starts (its first two watches fail): the watch
    is opened again (after 1 s, then 2 s), and the hand-on still comes from it."""
    await start_quota_on(nats_url)
    rig = await new_rig(nc, buckets, node)
    cluster = rig.cluster = ApiServerAwayAtFirst(failures=2)
    async with harness(short_dir, rig, node, interval_s=3600) as h:
        await rig.prepare_all(h)
        # the third watch is open (it registers before it lists): a deletion now reaches it
        await wait_for(lambda: cluster.failures == 0 and bool(cluster._pod_watchers))
        rig.s.end_first(cluster)
        await wait_for_booked(rig, HANDED)  # no reconcile ran: the reopened watch did it
        assert await rig.quota() == ({"first": OWN_MIB, "second": SHARED_MIB}, HELD)
