"""Issue 33's guarantee, from the node's side: a borrower that keeps a neighbour's guaranteed
memory past the grace bound is evicted by the node (TESSERA_MEMORY_RECLAIM_ENFORCEMENT=evict, the
default) whatever its own policy; and a pod's guarantee counts from the moment it is on the
node's ledger, before its container is started — borrowing stops then. The real lease service over
its unix sockets; the ledger on a real NATS server (KV tessera-ledger)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import pytest
from node_agent_rig import grants, make_pod, running_rig
from tessera.node_agent.ledger_guarantees import LedgerGuarantees, booked_guarantees
from tessera.node_agent.node_config_rules import (
    NodeConfigError,
    effective_entry,
    layer,
    parse_config_map,
    parse_entry,
    resolve,
)
from test_elastic_leases import GPU, Node, until

from tessera import bus
from tessera.bus import Buckets
from tessera.models import (
    NODE_CONFIG_KEY,
    Allocation,
    AllocationState,
    DeviceGrant,
    NodeConfigSetRequest,
    NodeLedger,
)
from tessera.settings import TesseraSettings

MiB = 1 << 20
GiB = 1 << 30

BORROWER = "11111111-1111-4111-8111-111111111111"
OTHER = "33333333-3333-4333-8333-333333333333"
NEIGHBOUR = "22222222-2222-4222-8222-222222222222"


# ---- the node evicts a borrower that keeps the memory ----------------------------------------


async def test_a_borrower_that_keeps_the_memory_is_evicted_after_the_grace_bound(
    tmp_path: Path,
) -> None:
    """Policy `fail` (the pod's default), the node's default enforcement: the borrower's unused
    leases are recalled and it is told at once; it frees nothing; after the grace bound the node
    evicts it, and the neighbour's guarantee is granted once its memory is back."""
    node = Node(tmp_path, reclaim_wait_s=30, reclaim_grace_s=1.0)
    assert node.service.enforcement == "evict"  # the default: a guarantee is a guarantee
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB)
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(12 * GiB) == 12 * GiB
    sock_n = node.pod(NEIGHBOUR, 8 * GiB, 8 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    pump = asyncio.create_task(b.pump())  # answers recalls, but has nothing unused to give
    t0 = time.monotonic()
    assert await n.ask(8 * GiB) == 8 * GiB
    waited = time.monotonic() - t0
    pump.cancel()
    assert 0.9 <= waited < 25  # not before the grace bound; granted once the borrower ended
    assert node.evicted == [BORROWER]
    assert [(x.action, x.by_node) for x in node.notices] == [("reclaimed", False),
                                                             ("evicted", True)]  # fmt: skip
    evicted = node.notices[1]
    assert evicted.borrowed_bytes == 8 * GiB and evicted.after_s >= 0.9
    assert evicted.for_pod_uid == NEIGHBOUR
    await node.service.close()


async def test_only_enough_borrowers_are_evicted_most_borrowed_first(tmp_path: Path) -> None:
    node = Node(tmp_path, reclaim_wait_s=30, reclaim_grace_s=0.5)
    sock_a = node.pod(BORROWER, 1 * GiB, 10 * GiB)
    sock_o = node.pod(OTHER, 1 * GiB, 10 * GiB)
    await node.service.sync()
    a, o = await node.client(BORROWER, sock_a), await node.client(OTHER, sock_o)
    assert await a.ask(9 * GiB) == 9 * GiB  # 8 GiB borrowed
    assert await o.ask(5 * GiB) == 5 * GiB  # 4 GiB borrowed; the card is 2 GiB from full
    sock_n = node.pod(NEIGHBOUR, 4 * GiB, 4 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    pumps = [asyncio.create_task(c.pump()) for c in (a, o)]
    assert await n.ask(4 * GiB) == 4 * GiB  # 2 GiB short: the biggest borrower covers it
    for p in pumps:
        p.cancel()
    assert node.evicted == [BORROWER]
    assert node.service.for_key(f"{OTHER}/0").holder(GPU).leased == 5 * GiB  # kept its loan
    await node.service.close()


async def test_a_node_that_leaves_it_to_the_pods_evicts_nobody(tmp_path: Path) -> None:
    """TESSERA_MEMORY_RECLAIM_ENFORCEMENT=borrower: a `fail` borrower keeps its memory (past the
    reclaim wait the neighbour's guarantee is granted as a hard slice's: the driver decides)."""
    node = Node(tmp_path, reclaim_wait_s=1.5, reclaim_grace_s=0.2, enforcement="borrower")
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB)
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(12 * GiB) == 12 * GiB
    sock_n = node.pod(NEIGHBOUR, 8 * GiB, 8 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    pump = asyncio.create_task(b.pump())
    assert await n.ask(8 * GiB) == 8 * GiB  # after the wait, as a hard slice: the driver decides
    pump.cancel()
    assert node.evicted == [] and [x.action for x in node.notices] == ["reclaimed"]
    await node.service.close()


# ---- guarantees from the ledger --------------------------------------------------------------


def allocation(uid: str, guarantee_mib: int, state: AllocationState) -> Allocation:
    grant = DeviceGrant(uuid=GPU, type="FAKE", memory_mib=guarantee_mib, cores=30)
    return Allocation(pod_uid=uid, namespace="ns", name=f"pod-{uid[:4]}", node="n",
                      containers=[[grant]], container_names=["main"], state=state)  # fmt: skip


def test_booked_guarantees_count_active_allocations() -> None:
    ledger = NodeLedger(node="n", allocations={
        NEIGHBOUR: allocation(NEIGHBOUR, 8192, AllocationState.BOUND),
        OTHER: allocation(OTHER, 2048, AllocationState.RELEASED),
    })  # fmt: skip
    assert booked_guarantees(ledger) == {GPU: {NEIGHBOUR: 8 * GiB}}
    assert booked_guarantees(None) == {}


async def test_a_booked_guarantee_stops_borrowing_before_its_container_starts(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, reclaim_wait_s=30)
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB)
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(6 * GiB) == 6 * GiB
    # the scheduler binds an 8 GiB pod to the node; its container has not started
    node.service.set_booked({GPU: {NEIGHBOUR: 8 * GiB}})
    # room = 16 - 8 (booked) - 6 (held): 2 GiB more, not the 6 its limit allows
    assert await b.ask(3 * GiB) == 0
    assert await b.ask(2 * GiB) == 2 * GiB
    b.unused = 1 * GiB  # leased in chunks, not charged yet
    pump = asyncio.create_task(b.pump())
    # a second pod is bound (2 GiB): the card is over-lent, unused leases come back at once
    node.service.set_booked({GPU: {NEIGHBOUR: 8 * GiB, OTHER: 2 * GiB}})
    await until(lambda: b.recalls >= 1)
    await until(lambda: node.service.for_key(f"{BORROWER}/0").holder(GPU).leased == 7 * GiB)
    pump.cancel()
    assert await b.ask(1) == 0  # nothing more beyond its guarantee
    # its container starts and is sealed: counted once, not twice
    sock_n = node.pod(NEIGHBOUR, 8 * GiB, 8 * GiB)
    await node.service.sync()
    n = await node.client(NEIGHBOUR, sock_n)
    assert await n.ask(8 * GiB) == 8 * GiB  # the room was kept for it: no reclaim needed
    assert node.notices == []
    await node.service.close()


async def test_the_agent_reads_guarantees_off_the_ledger(
    tmp_path: Path, buckets: Buckets,
) -> None:
    """The agent's feed (LedgerGuarantees) on the real KV bucket: a bound allocation stops the
    borrower's lending within moments; its release gives the room back."""
    node_name = f"el-{uuid.uuid4().hex[:8]}"
    node = Node(tmp_path, reclaim_wait_s=30)
    feed = LedgerGuarantees(buckets.ledger, node_name, node.service, logging.getLogger("t"))
    stop = asyncio.Event()
    task = asyncio.create_task(feed.run(stop))
    sock_b = node.pod(BORROWER, 4 * GiB, 12 * GiB)
    await node.service.sync()
    b = await node.client(BORROWER, sock_b)
    assert await b.ask(4 * GiB) == 4 * GiB

    async def book(state: AllocationState) -> None:
        def mutate(old: NodeLedger | None) -> NodeLedger:
            ledger = old.model_copy(deep=True) if old else NodeLedger(node=node_name)
            ledger.allocations[NEIGHBOUR] = allocation(NEIGHBOUR, 10240, state)
            return ledger

        await bus.cas_update(buckets.ledger, node_name, NodeLedger, mutate)

    await book(AllocationState.BOUND)
    await until(lambda: node.service._booked.get(GPU, {}).get(NEIGHBOUR) == 10 * GiB)
    assert await b.ask(3 * GiB) == 0  # 16 - 10 booked - 4 held: 2 GiB to lend, not 3
    assert await b.ask(2 * GiB) == 2 * GiB
    await book(AllocationState.RELEASED)  # the pod went away before starting
    await until(lambda: not node.service._booked)
    assert await b.ask(6 * GiB) == 6 * GiB  # the whole burst limit again
    stop.set()
    await asyncio.wait_for(task, 10)
    await node.service.close()


# ---- the node's enforcement, per node ---------------------------------------------------------


def test_the_enforcement_is_a_per_node_setting_too() -> None:
    """`memoryreclaim` in tessera-node-config: a node's entry (or `tessera node-config set`)
    overrides the chart's TESSERA_MEMORY_RECLAIM_ENFORCEMENT; a bad value names the field."""
    settings = TesseraSettings()
    text = json.dumps({"defaults": {}, "nodeconfig": [{"name": "gpu-a",
                                                       "memoryreclaim": "borrower"}]})
    config = parse_config_map({"data": {NODE_CONFIG_KEY: text}})
    a = resolve(layer(settings, config, "gpu-a", None).merged, settings)
    b = resolve(layer(settings, config, "gpu-b", None).merged, settings)
    assert (a.memory_reclaim, b.memory_reclaim) == ("borrower", "evict")
    assert effective_entry(a)["memoryreclaim"] == "borrower"
    local = parse_entry({"memoryreclaim": "evict"})
    assert resolve(layer(settings, config, "gpu-a", local).merged, settings).memory_reclaim == \
        "evict"
    with pytest.raises(NodeConfigError, match="memoryreclaim"):
        parse_entry({"memoryreclaim": "never"})
    lenient = TesseraSettings(memory_reclaim_enforcement="borrower")
    assert resolve(layer(lenient, None, "gpu-b", None).merged, lenient).memory_reclaim == \
        "borrower"


async def test_the_agent_books_bound_pods_and_follows_its_node_config(short_dir, nc,
                                                                      buckets) -> None:
    """The running agent: a pod bound to the node is booked in its lease service before any
    container starts; `tessera node-config set --memory-reclaim`'s entry changes the node's
    enforcement without a restart."""
    async with running_rig(short_dir, nc, buckets) as rig:
        agent = rig.agent
        assert agent is not None and agent.leases.enforcement == "evict"
        gpu = rig.gpus[0]
        pod = make_pod("promised", [("main", 1)])
        await rig.bind(pod, [grants((gpu, 3000, 30))])
        uid = pod["metadata"]["uid"]
        await until(lambda: agent.leases._booked.get(gpu, {}).get(uid) == 3000 * MiB)
        assert agent.configurator is not None
        status = await agent.configurator.set_local(
            NodeConfigSetRequest(config={"memoryreclaim": "borrower"}))
        assert status.ok, status.reason
        assert agent.leases.enforcement == "borrower"
