"""The device plugin reads its node's ledger from a KV watch (watched_ledger.py) instead of a KV
read per kubelet call: what it reads is what KV holds once the watch delivered it, its own
writes are known at once, and a watch that lags behind KV (as one does on a busy machine) costs
an exact read, never a wrong answer: a pod booked after the watch stalled is still admitted with
its own limits, and a CAS made on a stale entry lands on the fresh one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from node_agent_rig import grants, make_pod, running_rig
from tessera.node_agent.watched_ledger import WatchedLedger

from tessera import bus
from tessera.models import InFlightClaim, NodeLedger, now
from tessera.region import SEALED_LIMITS_DIR, read_limits

LOG = logging.getLogger("test")


class LaggingWatch:
    """The real KV watch, whose changes after the current value wait until `flowing` is set."""

    def __init__(self) -> None:
        self.flowing = asyncio.Event()

    async def __call__(self, kv, key):
        async with contextlib.aclosing(bus.watch_entries(kv, key)) as entries:
            started = False
            async for entry in entries:
                if started:
                    await self.flowing.wait()
                started = started or entry is None
                yield entry


def marked(ledger: NodeLedger, name: str) -> NodeLedger:
    """The entry with one in-flight claim named `name` (to tell entries apart)."""
    claim = InFlightClaim(pod_uid=name, namespace="team", name=name, expires_at=now() + 60)
    return ledger.model_copy(update={"claims": {name: claim}})


def mark(ledger: NodeLedger | None) -> str:
    return next(iter(ledger.claims)) if ledger and ledger.claims else ""


async def write(kv, node: str, name: str) -> None:
    """Another writer (the scheduler) changes the entry."""
    await bus.cas_update(kv, node, NodeLedger,
                         lambda ledger: marked(ledger or NodeLedger(node=node), name))


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def stalled_watch(rig, buckets):
    """The plugin reads the node's ledger from a watch that delivers nothing after the current
    value (LaggingWatch never flowing); yields that watched entry."""
    stalled = WatchedLedger(buckets.ledger, rig.node, LOG, entries=LaggingWatch())
    stop = asyncio.Event()
    task = asyncio.create_task(stalled.run(stop))
    try:
        await until(lambda: stalled.live)
        rig.agent.plugin.ctx._watched = stalled  # the plugin reads this one from now on
        yield stalled
    finally:
        stop.set()
        await task


async def test_reads_follow_the_watch_and_own_writes_are_known_at_once(nc, buckets):
    node = f"node-{uuid.uuid4().hex[:8]}"
    await write(buckets.ledger, node, "first")
    watched = WatchedLedger(buckets.ledger, node, LOG)
    stop = asyncio.Event()
    task = asyncio.create_task(watched.run(stop))
    try:
        await until(lambda: watched.live)
        assert mark(await watched.read()) == "first"
        await write(buckets.ledger, node, "second")
        await until(lambda: mark(watched.known().value) == "second")

        def own(ledger: NodeLedger | None) -> NodeLedger:
            return marked(ledger, "own")

        result = await watched.cas(own)
        assert mark(await watched.read()) == "own"  # before its echo, and it is KV's
        assert (await bus.read(buckets.ledger, node, NodeLedger)).revision == result.revision
        assert watched.exact_reads == 0  # nothing above read KV
    finally:
        stop.set()
        await task
    assert not watched.live
    assert mark(await watched.read()) == "own"  # not watched: an exact read
    assert watched.exact_reads == 1


async def test_a_cas_on_a_lagging_entry_lands_on_the_fresh_one(nc, buckets):
    node = f"node-{uuid.uuid4().hex[:8]}"
    await write(buckets.ledger, node, "first")
    lagging = LaggingWatch()
    watched = WatchedLedger(buckets.ledger, node, LOG, entries=lagging)
    stop = asyncio.Event()
    task = asyncio.create_task(watched.run(stop))
    try:
        await until(lambda: watched.live)
        await write(buckets.ledger, node, "scheduler")  # the watch does not deliver it yet
        await asyncio.sleep(0.1)
        assert mark(await watched.read()) == "first"
        seen: list[str] = []

        def after_scheduler(ledger: NodeLedger | None) -> NodeLedger:
            seen.append(mark(ledger))
            if mark(ledger) != "scheduler":
                raise bus.NoChange  # nothing to do on the stale entry: judged again
            return marked(ledger, "agent")

        await watched.cas(after_scheduler)
        assert seen == ["first", "scheduler"]
        assert mark((await bus.read(buckets.ledger, node, NodeLedger)).value) == "agent"

        def overwrite(ledger: NodeLedger | None) -> NodeLedger:
            seen.append(mark(ledger))
            return marked(ledger, f"{mark(ledger)}+1")

        await write(buckets.ledger, node, "again")  # known entry stale: the update conflicts
        await watched.cas(overwrite)
        assert seen[-2:] == ["agent", "again"]  # tried on the known entry, then the fresh one
        assert mark((await bus.read(buckets.ledger, node, NodeLedger)).value) == "again+1"
        lagging.flowing.set()
        await until(lambda: mark(watched.known().value) == "again+1")
    finally:
        stop.set()
        await task


async def test_a_pod_booked_after_the_watch_stalled_is_admitted_with_its_own_grant(
    short_dir, nc, buckets
):
    """The watched entry lacks the pod kubelet admits (booked after the watch stalled) but holds
    an older pod of the same size: kubelet is still steered to the new pod's own GPU, which
    keeps its grant (nothing crossed, nothing traded)."""
    async with running_rig(short_dir, nc, buckets) as rig:
        g0, g1 = rig.gpus
        early = make_pod("early", [("main", 1)])
        early_grant = [grants((g0, 3000, 30))]
        await rig.bind(early, early_grant)
        async with stalled_watch(rig, buckets) as stalled:
            late = make_pod("late", [("main", 1)])
            late_grant = [grants((g1, 5000, 50))]
            await rig.bind(late, late_grant)  # not delivered to the watch
            await asyncio.sleep(0.1)
            assert [a.name for a in stalled.known().value.allocations.values()] == ["early"]
            for pod, (uuid_, mib) in ((late, (g1, 5000)), (early, (g0, 3000))):
                admission = await rig.kubelet.admit_pod(pod)
                assert admission.ok, admission.error
                mount = admission.containers[0].mount(SEALED_LIMITS_DIR)
                limits = read_limits(mount.host_path)
                assert [(d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices] == [
                    (uuid_, mib)]
            ledger = await rig.ledger()
            by_name = {a.name: a for a in ledger.allocations.values()}
            assert by_name["late"].containers == late_grant  # its own GPU: nothing moved
            assert by_name["early"].containers == early_grant
            assert {a.state for a in by_name.values()} == {"allocated"}


async def test_an_allocate_with_no_preferred_allocation_before_it_reads_exactly(
    short_dir, nc, buckets
):
    """kubelet calls Allocate with no GetPreferredAllocation first when its topology manager
    aligned exactly the devices asked (or it reuses an init container's): the pod may have been
    bound after the agent's last exact read (here a moment ago, by the admission before it)
    and not have reached a lagging watch. It is still admitted, never refused as not in flight
    (before, any exact read in the last second let the watched entry answer: under load such a
    pod was refused, FAILED_PRECONDITION 'no pod is in flight')."""
    async with running_rig(short_dir, nc, buckets) as rig:
        g0, g1 = rig.gpus
        early = make_pod("early", [("main", 1)])
        await rig.bind(early, [grants((g1, 3000, 30))])
        async with stalled_watch(rig, buckets):
            admission = await rig.kubelet.admit_pod(early)  # its calls read KV exactly
            assert admission.ok, admission.error
            late = make_pod("late", [("main", 1)])
            await rig.bind(late, [grants((g0, 5000, 50))])  # not delivered to the watch
            # kubelet takes the devices it aligned itself, without asking the plugin: the
            # first free one, a replica of the late pod's GPU
            plugin = rig.kubelet.plugins["nvidia.com/gpu"]
            plugin.preferred_allocation = False
            assert plugin.healthy()[0].startswith(g0)
            admission = await rig.kubelet.admit_pod(late)
            assert admission.ok, admission.error
            limits = read_limits(admission.containers[0].mount(SEALED_LIMITS_DIR).host_path)
            assert [(d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices] == [(g0, 5000)]


async def test_a_pod_answered_but_not_yet_recorded_is_not_taken_for_a_retry(
    short_dir, nc, buckets
):
    """Allocate answers before its pod's finish is written. Until it is, the ledger shows the
    pod bound with every container prepared, which is also what a retried admission looks
    like: the next pod's Allocate (kubelet's List not telling which pod it admits) must go to
    the next pod, and the first pod's directory must survive."""
    async with running_rig(short_dir, nc, buckets, lists_admitting=False) as rig:
        g0 = rig.gpus[0]
        first, second = make_pod("first", [("main", 1)]), make_pod("second", [("main", 1)])
        for pod in (first, second):
            await rig.bind(pod, [grants((g0, 2000, 20))])
            await asyncio.sleep(0.01)  # claims in a known order: first is the older
        watched = rig.agent.plugin.ctx.watched
        real_cas, gate = watched.cas, asyncio.Event()

        async def held_cas(mutate):  # the finish's write, held back
            await gate.wait()
            return await real_cas(mutate)

        watched.cas = held_cas
        try:
            a = await rig.kubelet.allocate_pod(first)
            b = await rig.kubelet.allocate_pod(second)  # first's finish not written yet
            assert a.ok and b.ok, (a.error, b.error)
            assert (await rig.ledger()).allocations[a.uid].state == "bound"  # held back
        finally:
            gate.set()
            watched.cas = real_cas
        admissions = [await rig.kubelet.start_pod(x) for x in (a, b)]
        for admission in admissions:
            assert admission.ok, admission.error
            limits = read_limits(admission.containers[0].mount(SEALED_LIMITS_DIR).host_path)
            assert [(d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices] == [(g0, 2000)]
        ledger = await rig.ledger()
        assert {a.name: a.state for a in ledger.allocations.values()} == {
            "first": "allocated", "second": "allocated"}
        assert ledger.in_flight() == {}
        served = {c.prepared.pod for c in rig.agent.store.all()}
        assert served == {"first", "second"}  # neither directory was prepared anew


async def test_a_store_made_anew_is_followed_from_its_start(nc):
    """NATS lost its store and the bucket was made anew (revisions start again at 1): the watch
    alone would resume after the last sequence it took, which the new store has not reached.
    The first exact read older than what was known replaces it and restarts the watch."""
    from nats.js.api import KeyValueConfig

    js = nc.jetstream()
    bucket = f"wipe-{uuid.uuid4().hex[:8]}"
    node = "node-a"
    kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=5))
    for i in range(6):
        await write(kv, node, f"old-{i}")
    watched = WatchedLedger(kv, node, LOG)
    stop = asyncio.Event()
    task = asyncio.create_task(watched.run(stop))
    try:
        await until(lambda: watched.live)
        assert mark(await watched.read()) == "old-5"
        await js.delete_key_value(bucket)  # the store is lost ...
        kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=5))
        await write(kv, node, "rebuilt")  # ... and the ledger rebuilt: revision 1
        assert mark(await watched.exact()) == "rebuilt"
        assert watched.restarts == 1
        await until(lambda: watched.live)
        assert mark(await watched.read()) == "rebuilt"
        await write(kv, node, "after")
        await until(lambda: mark(watched.known().value) == "after")  # followed again
    finally:
        stop.set()
        await task
        await js.delete_key_value(bucket)
