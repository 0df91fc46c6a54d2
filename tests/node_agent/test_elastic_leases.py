"""Elastic memory in the lease service (issue 33): a container leases beyond its guarantee up to
its burst limit while the card has memory nobody is guaranteed; a guaranteed neighbour's memory
comes back (recall, refusal beyond the guarantee, opt-in eviction); opt-in waiting instead of an
immediate OOM. The pure rule (memory_lending.offer) and the real service over its unix sockets."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tessera.node_agent.containers import ContainerStore, PreparedContainer
from tessera.node_agent.elastic_memory import LeaseCollector
from tessera.node_agent.leases import LeaseService, ReclaimNotice
from tessera.node_agent.memory_lending import Holder, Refusal, offer, reclaim_victims

from tessera.region import LEASE_SOCKET_NAME, ContainerLimits, device_limit, seal_limits

MiB = 1 << 20
GiB = 1 << 30
GPU = "GPU-e1a5"
CARD = 16 * GiB


# ---- the rule --------------------------------------------------------------------------------


def test_a_burst_slice_borrows_what_nobody_is_guaranteed() -> None:
    me = Holder("a/0", guarantee=4 * GiB, limit=12 * GiB, leased=0)
    assert offer(me, [], CARD, 12 * GiB, 12 * GiB).grant == 12 * GiB
    # a neighbour guaranteed 8 GiB (using none of it): only 4 GiB are nobody's
    hard = Holder("b/0", guarantee=8 * GiB, limit=8 * GiB, leased=0)
    assert offer(me, [hard], CARD, 12 * GiB, 12 * GiB).refusal is Refusal.BORROW
    assert offer(me, [hard], CARD, 1, 12 * GiB).grant == 8 * GiB
    # never past its own limit, whatever the card has
    full = Holder("a/0", guarantee=4 * GiB, limit=12 * GiB, leased=12 * GiB)
    assert offer(full, [], CARD, 1, 1).refusal is Refusal.LIMIT


def test_a_guarantee_due_while_borrowers_hold_the_card_is_a_reclaim() -> None:
    borrower = Holder("a/0", guarantee=4 * GiB, limit=12 * GiB, leased=12 * GiB)
    me = Holder("b/0", guarantee=8 * GiB, limit=8 * GiB, leased=0)
    assert offer(me, [borrower], CARD, 4 * GiB, 4 * GiB).grant == 4 * GiB  # what is free
    o = offer(me, [borrower], CARD, 6 * GiB, 6 * GiB)
    assert o.refusal is Refusal.RECLAIM and o.short == 2 * GiB
    # the borrower, meanwhile, gets nothing beyond its guarantee
    assert offer(borrower, [me], CARD, 1, 1).refusal is Refusal.LIMIT
    b2 = Holder("a/0", guarantee=4 * GiB, limit=12 * GiB, leased=8 * GiB)
    assert offer(b2, [me], CARD, 1, 1).refusal is Refusal.BORROW


def test_hard_slices_and_unknown_cards_are_as_before() -> None:
    hard = Holder("a/0", guarantee=1 * GiB, limit=1 * GiB, leased=0)
    # overcommitted neighbours (memory scaling > 1) do not matter to a hard slice: as before
    big = Holder("b/0", guarantee=20 * GiB, limit=20 * GiB, leased=20 * GiB)
    assert offer(hard, [big], CARD, 1, 2 * GiB).grant == 1 * GiB
    burst = Holder("a/0", guarantee=1 * GiB, limit=4 * GiB, leased=0)
    assert offer(burst, [], 0, 1, 4 * GiB).grant == 1 * GiB  # unknown card: nothing lent
    assert offer(burst, [], 0, 2 * GiB, 4 * GiB).refusal is Refusal.BORROW


def test_eviction_picks_the_biggest_borrowers_that_opted_in() -> None:
    a = Holder("a/0", GiB, 8 * GiB, 5 * GiB, "evict")
    b = Holder("b/0", GiB, 8 * GiB, 3 * GiB, "evict")
    c = Holder("c/0", GiB, 8 * GiB, 7 * GiB, "fail")
    assert [h.key for h in reclaim_victims([a, b, c], 2 * GiB)] == ["a/0"]
    assert [h.key for h in reclaim_victims([a, b, c], 6 * GiB)] == ["a/0", "b/0"]


# ---- the service -----------------------------------------------------------------------------


class Client:
    """libvgpu's side of the protocol, by hand: answers recalls with everything unused, and
    counts the keep-alive lines of a waiting request."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w
        self.unused = 0
        self.recalls = 0
        self.keepalives = 0

    @classmethod
    async def connect(cls, path: Path) -> Client:
        return cls(*await asyncio.open_unix_connection(str(path)))

    async def ask(self, need: int, want: int | None = None, timeout: float = 30) -> int:
        self.w.write(f"A {GPU} {need} {want or need}\n".encode())
        await self.w.drain()
        while True:
            line = await asyncio.wait_for(self.r.readline(), timeout)
            if line.startswith(b"G "):
                return int(line[2:])
            if line == b"N\n":
                return 0
            if line == b"W\n":
                self.keepalives += 1
                continue
            assert line == b"C\n", line
            await self.answer_recall()

    async def answer_recall(self) -> None:
        self.recalls += 1
        if self.unused:
            self.w.write(f"R {GPU} {self.unused}\n".encode())
            self.unused = 0
        self.w.write(b"D\n")
        await self.w.drain()

    async def pump(self) -> None:
        """Answer recalls while idle (libvgpu's poll thread)."""
        while True:
            line = await self.r.readline()
            if not line:
                return
            if line == b"C\n":
                await self.answer_recall()

    async def give(self, n: int) -> None:
        self.w.write(f"R {GPU} {n}\n".encode())
        await self.w.drain()

    async def close(self) -> None:
        self.w.close()


async def until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


class Node:
    """A node's container store, the lease service with a 16 GiB card, and what it reported."""

    def __init__(self, tmp_path: Path, **kw) -> None:
        # a short root: the client connects by the socket's path (at most 108 bytes)
        self.root = Path(tempfile.mkdtemp(prefix="el-"))
        self.store = ContainerStore(self.root / "r")
        self.notices: list[ReclaimNotice] = []
        self.evicted: list[str] = []
        self.service = LeaseService(self.store.all, card_memory=lambda u: CARD if u == GPU else 0,
                                    on_reclaim=self._on_reclaim, **kw)  # fmt: skip
        self.clients: dict[str, list[Client]] = {}

    async def _on_reclaim(self, notice: ReclaimNotice) -> None:
        self.notices.append(notice)
        if notice.action == "evicted":  # what kubelet does after the eviction: the pod ends
            self.evicted.append(notice.borrower.pod_uid)
            for c in self.clients.get(notice.borrower.pod_uid, []):
                await c.close()

    def pod(self, uid: str, guarantee: int, limit: int, **elastic) -> Path:
        cdir = self.store.prepare(PreparedContainer(
            pod_uid=uid, namespace="ns", pod=f"pod-{uid[:4]}", container="main", index=0,
            device_ids=[f"{GPU}::0"], grants=[], **elastic,
        ))  # fmt: skip
        dev = device_limit(GPU, mem_guarantee_bytes=guarantee, mem_burst_bytes=limit)
        seal_limits(cdir.limits_dir, ContainerLimits(devices=(dev,), lease=True))
        return cdir.limits_dir / LEASE_SOCKET_NAME

    async def client(self, uid: str, sock: Path) -> Client:
        c = await Client.connect(sock)
        self.clients.setdefault(uid, []).append(c)
        return c


BORROWER = "11111111-1111-4111-8111-111111111111"
NEIGHBOUR = "22222222-2222-4222-8222-222222222222"


async def test_a_borrower_holds_its_limit_and_gives_back_for_a_guarantee(tmp_path: Path) -> None:
    node = Node(tmp_path, reclaim_wait_s=20)
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB)
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(12 * GiB) == 12 * GiB  # an idle card: the whole burst limit
    b.unused = 64 * MiB  # leased in a chunk, not charged yet
    # a guaranteed neighbour arrives (8 GiB, a hard slice): 4 GiB are free on the card
    sock_n = node.pod(NEIGHBOUR, 8 * GiB, 8 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    assert await n.ask(4 * GiB) == 4 * GiB
    pump = asyncio.create_task(b.pump())
    want = asyncio.create_task(n.ask(4 * GiB))
    await until(lambda: b.recalls >= 1)  # its unused lease is recalled at once
    await until(lambda: node.notices)
    assert node.notices[0].action == "reclaimed" and node.notices[0].borrower.pod_uid == BORROWER
    assert not want.done()  # 64 MiB came back; the rest is the borrower's to free
    pump.cancel()
    assert await b.ask(1) == 0  # beyond its guarantee: refused while the card is short
    await b.give(6 * GiB)  # the borrower frees (its allocator trims)
    assert await asyncio.wait_for(want, 20) == 4 * GiB  # the neighbour gets its memory
    await node.service.close()


async def test_a_borrower_that_opted_in_is_evicted(tmp_path: Path) -> None:
    node = Node(tmp_path, reclaim_wait_s=20)
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB, memory_reclaim="evict")
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(12 * GiB) == 12 * GiB
    sock_n = node.pod(NEIGHBOUR, 8 * GiB, 8 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    pump = asyncio.create_task(b.pump())
    assert await n.ask(8 * GiB) == 8 * GiB  # waited for the eviction, then granted
    assert node.evicted == [BORROWER]
    pump.cancel()
    assert [x.action for x in node.notices] == ["evicted"]
    # the node agent's metrics: what each container holds, guaranteed and borrowed
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LeaseCollector(node.service))
    text = generate_latest(registry).decode()
    assert 'tessera_node_agent_lease_evictions_total 1.0' in text
    held = {(x.labels["pod"], x.labels["kind"]): x.value
            for f in text_string_to_metric_families(text) for x in f.samples
            if x.name == "tessera_node_agent_lease_bytes"}  # fmt: skip
    assert held[("pod-2222", "guaranteed")] == held[("pod-2222", "leased")] == 8 * GiB
    assert held[("pod-2222", "borrowed")] == 0
    await node.service.close()


async def test_waiting_instead_of_oom(tmp_path: Path) -> None:
    node = Node(tmp_path)
    sock = node.pod(BORROWER, 2 * GiB, 2 * GiB, memory_wait_s=10)
    await node.service.sync()
    a, b = await node.client(BORROWER, sock), await node.client(BORROWER, sock)
    assert await a.ask(2 * GiB) == 2 * GiB
    t0 = time.monotonic()
    waiting = asyncio.create_task(b.ask(GiB))
    await asyncio.sleep(1.5)
    assert not waiting.done()  # at the limit: it waits instead of failing
    await a.give(GiB)  # memory is freed in the container
    assert await asyncio.wait_for(waiting, 20) == GiB
    assert b.keepalives >= 1 and time.monotonic() - t0 >= 1.5
    # without the opt-in the same request fails at once
    sock2 = node.pod(NEIGHBOUR, GiB, GiB)
    await node.service.sync()
    c = await node.client(NEIGHBOUR, sock2)
    assert await c.ask(GiB) == GiB
    t0 = time.monotonic()
    assert await c.ask(1) == 0 and time.monotonic() - t0 < 5
    await node.service.close()


async def test_waiting_is_bounded(tmp_path: Path) -> None:
    node = Node(tmp_path)
    sock = node.pod(BORROWER, GiB, GiB, memory_wait_s=1.5)
    await node.service.sync()
    a = await node.client(BORROWER, sock)
    assert await a.ask(GiB) == GiB
    t0 = time.monotonic()
    assert await a.ask(1) == 0  # nothing freed: it fails as before, after the bound
    assert 1.4 <= time.monotonic() - t0 < 10
    await node.service.close()


def test_the_watchdog_holds_a_borrower_to_its_burst_limit() -> None:
    """A borrower using 12 GiB of a 4/12 GiB slice under leases is within what it may hold (the
    watchdog must not call it a breach, nor kill it); without leases the guarantee is the cap."""
    from tessera.node_agent.watchdog_rules import container_share

    dev = device_limit(GPU, mem_guarantee_bytes=4 * GiB, mem_burst_bytes=12 * GiB)
    leased = ContainerLimits(devices=(dev,), lease=True)
    share = container_share(leased, GPU, init=False)
    assert share is not None and share.mem_limit_bytes == 12 * GiB
    alone = container_share(ContainerLimits(devices=(dev,)), GPU, init=False)
    assert alone is not None and alone.mem_limit_bytes == 4 * GiB


async def test_past_the_reclaim_bound_the_guarantee_is_granted_as_a_hard_slice(
    tmp_path: Path,
) -> None:
    """A borrower that never frees (policy fail) on a node that leaves eviction to the pods
    (TESSERA_MEMORY_RECLAIM_ENFORCEMENT=borrower): after TESSERA_MEMORY_RECLAIM_WAIT_S the account
    grants the neighbour's guarantee as it would a hard slice's (the driver then decides), and
    never more than the guarantee."""
    node = Node(tmp_path, reclaim_wait_s=1.0, enforcement="borrower")
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB)
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(12 * GiB) == 12 * GiB
    sock_n = node.pod(NEIGHBOUR, 8 * GiB, 8 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    pump = asyncio.create_task(b.pump())
    t0 = time.monotonic()
    assert await n.ask(6 * GiB, 8 * GiB) == 8 * GiB  # want clipped to the guarantee
    assert 0.9 <= time.monotonic() - t0 < 10
    assert [x.action for x in node.notices] == ["reclaimed"]
    pump.cancel()
    await node.service.close()
