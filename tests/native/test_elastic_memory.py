"""Issue 33, memory beyond the guarantee, end to end on one node: libvgpu in driver-API programs
on the fake GPU (16 GiB, shared physical memory), the node agent's container layout and its real
lease service (tests/native/elastic_rig.py).

A pod guaranteed 4 GiB with a 12 GiB limit holds 12 GiB on an otherwise idle card; a guaranteed
neighbour (8 GiB, a hard slice) arrives and needs it: the borrower's next allocation beyond its
guarantee fails, the neighbour's allocation waits, and gets its memory when the borrower frees
(policy `fail`) or when the borrower, which opted in, is evicted (policy `evict`). The card's
physical memory never goes past 16 GiB; nothing is taken from a guarantee."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from .conftest import NativeBuild, wait_for
from .elastic_rig import ElasticNode, GiB, running_node

BORROWER = "a1111111-1111-4111-8111-111111111111"
NEIGHBOUR = "b2222222-2222-4222-8222-222222222222"


def alloc_gib(c, n: int) -> list[int]:
    ids = []
    for _ in range(n):
        r = c(f"alloc plain {GiB}")
        assert r["ok"], (r, c.stderr())
        ids.append(r["id"])
    return ids


def test_a_burst_pod_holds_its_limit_and_gives_it_back(node: ElasticNode) -> None:
    pod = node.pod(BORROWER, "burst", guarantee_mib=4096, limit_mib=12288)
    b = pod.cuctl()
    info = b("info")
    ids = alloc_gib(b, 12)  # an idle card: 12 GiB, 8 of them borrowed
    assert not b(f"alloc plain {GiB}")["ok"]  # never past its limit
    assert b("phys")["phys"] == 12 * GiB
    assert node.held(pod) == (12 * GiB, 8 * GiB)
    assert info["total"] == 12 * GiB  # what it reads back: its burst limit

    neighbour = node.pod(NEIGHBOUR, "guaranteed", guarantee_mib=8192)
    n = neighbour.cuctl()
    alloc_gib(n, 4)  # what the card has free
    n.send(f"alloc plain {GiB}")  # its guarantee is due: it waits for the reclaim
    time.sleep(0.5)
    assert not n._sel.select(0)  # still waiting
    r = b(f"alloc plain {GiB // 2}")
    assert not r["ok"] and r["rc"] == 2  # the borrower: beyond its guarantee, refused (OOM)
    assert [x.action for _, x in node.notices] == ["reclaimed"]
    for i in ids[:4]:  # the borrower frees (as a caching allocator trims)
        assert b(f"free {i}")["ok"]
    assert n.recv(30)["ok"], n.stderr()  # the neighbour gets its memory
    alloc_gib(n, 3)
    assert n("phys")["phys"] == 16 * GiB
    assert node.held(neighbour) == (8 * GiB, 0)
    # the borrower keeps its guarantee and what it still holds
    assert alloc_gib(b, 0) == [] and node.held(pod)[0] >= 8 * GiB - 1


def test_an_evictable_borrower_is_evicted_for_the_guarantee(node: ElasticNode) -> None:
    pod = node.pod(BORROWER, "burst", guarantee_mib=4096, limit_mib=12288, reclaim="evict")
    b = pod.cuctl()
    alloc_gib(b, 12)
    neighbour = node.pod(NEIGHBOUR, "guaranteed", guarantee_mib=8192)
    n = neighbour.cuctl()
    t0 = time.monotonic()
    r = n(f"alloc plain {8 * GiB}", timeout=30)  # waits for the eviction, then fits
    assert r["ok"], (r, node.diagnosis(n, b))
    assert time.monotonic() - t0 < 20
    assert [x.action for _, x in node.notices] == ["evicted"]
    assert node.notices[0][1].borrower.pod_uid == BORROWER
    assert b.p.wait(timeout=30) == -9  # the borrower's process is gone (killed)
    assert n("phys")["phys"] == 8 * GiB


def test_a_hard_slice_is_as_before(node: ElasticNode) -> None:
    pod = node.pod(BORROWER, "hard", guarantee_mib=4096)
    c = pod.cuctl()
    alloc_gib(c, 4)
    t0 = time.monotonic()
    r = c(f"alloc plain {GiB}")
    assert not r["ok"] and time.monotonic() - t0 < 2  # OOM at once, no waiting
    assert node.held(pod)[1] == 0 and node.notices == []


def test_waiting_instead_of_oom(node: ElasticNode) -> None:
    pod = node.pod(BORROWER, "patient", guarantee_mib=2048, wait_s=30)
    a, b = pod.cuctl(), pod.cuctl()
    ids = alloc_gib(a, 2)
    b.send(f"alloc plain {GiB}")  # does not fit: waits instead of failing
    time.sleep(1.5)
    assert not b._sel.select(0)
    assert a(f"free {ids[0]}")["ok"]
    r = b.recv(30)
    assert r["ok"], b.stderr()


@pytest.fixture
def strict_node(native: NativeBuild) -> Iterator[ElasticNode]:
    """The node's default enforcement (evict) with a short grace bound."""
    with running_node(native, reclaim_grace_s=1.0) as n:
        yield n


def test_a_borrower_that_never_frees_is_evicted_by_the_node(strict_node: ElasticNode) -> None:
    """Policy `fail` (the pod did not opt in): it keeps its 12 GiB; past the node's grace bound
    the node evicts it and the neighbour's guarantee is met — not left to the driver's OOM."""
    node = strict_node
    pod = node.pod(BORROWER, "burst", guarantee_mib=4096, limit_mib=12288)
    b = pod.cuctl()
    alloc_gib(b, 12)
    neighbour = node.pod(NEIGHBOUR, "guaranteed", guarantee_mib=8192)
    n = neighbour.cuctl()
    t0 = time.monotonic()
    r = n(f"alloc plain {8 * GiB}", timeout=40)
    waited = time.monotonic() - t0
    assert r["ok"], (r, round(waited, 2), node.diagnosis(n, b))
    assert 0.9 <= waited < 30, node.diagnosis(n, b)
    assert [(x.action, x.by_node) for _, x in node.notices] == [("reclaimed", False),
                                                                ("evicted", True)]  # fmt: skip
    assert b.p.wait(timeout=30) == -9  # the borrower's process is gone (killed)
    assert n("phys")["phys"] == 8 * GiB


def test_a_guarantee_on_the_ledger_stops_borrowing_before_its_container_starts(
    node: ElasticNode,
) -> None:
    pod = node.pod(BORROWER, "burst", guarantee_mib=4096, limit_mib=12288)
    b = pod.cuctl()
    node.book({NEIGHBOUR: 8192})  # bound to the node; its container not started yet
    alloc_gib(b, 8)  # what nobody is guaranteed: 16 - 8
    r = b(f"alloc plain {GiB}")
    assert not r["ok"] and r["rc"] == 2  # not the neighbour's room
    neighbour = node.pod(NEIGHBOUR, "guaranteed", guarantee_mib=8192)
    n = neighbour.cuctl()
    t0 = time.monotonic()
    alloc_gib(n, 8)  # its guarantee was kept free: no reclaim, no wait
    assert time.monotonic() - t0 < 10 and node.notices == []
    assert n("phys")["phys"] == 16 * GiB


def test_the_fake_card_frees_a_killed_process_memory_when_another_takes_its_place(cluster):
    """The fake driver's physical memory (every elastic test's truth): a killed process's memory
    comes back even when a new process takes its slot in the driver's process table first (it
    was lost for good, and the card stayed short of it)."""
    c = cluster.container()
    a = c.cuctl(preload=False)
    assert a("init")["ok"] and a(f"alloc plain {12 * GiB}")["ok"]
    a.p.kill()
    assert a.p.wait(timeout=30) == -9
    b = c.cuctl(preload=False)
    assert b("init")["ok"]  # its context takes the gone process's slot
    assert b(f"alloc plain {8 * GiB}")["ok"]
    assert b("phys")["phys"] == 8 * GiB


def test_the_fake_card_frees_a_killed_process_memory_reaped_while_it_is_checked(cluster):
    """The fake driver's check "is this holder gone?" (CI's failure of the eviction test above:
    the neighbour's allocation found the evicted borrower still there, the borrower was reaped
    before its /proc state was read, and the fake took it for alive: its 12 GiB stayed held and
    the neighbour got the driver's OOM though its lease was granted). The hook pauses the check
    between the two reads, and the killed process is reaped right there."""
    c = cluster.container()
    a = c.cuctl(preload=False)
    assert a("init")["ok"] and a(f"alloc plain {12 * GiB}")["ok"]
    gate = cluster.tmp / "reaped"
    b = c.cuctl(preload=False, FAKE_PIDCHECK_GATE=str(gate))
    assert b("init")["ok"]
    a.p.kill()
    b.send(f"alloc plain {8 * GiB}")  # does not fit beside a's 12 GiB: is a gone?
    checked, _ = wait_for(lambda: f"pid {a.pid} checked" in b.stderr(), timeout=30)
    assert checked, b.stderr()
    assert a.p.wait(timeout=30) == -9  # reaped between the check's two reads
    gate.touch()
    r = b.recv(30)
    assert r["ok"], (r, b.stderr())
    assert b("phys")["phys"] == 8 * GiB
