"""Issue 33, a reclaim on a real GPU: the kernel closes a dying process's files in fd order, so
an evicted borrower's lease socket may close (and the lease service grant its memory to the
neighbour) a moment before the driver has freed that process's device memory. The neighbour's
allocation then gets the driver's out-of-memory although it was owed the memory. libvgpu retries
an allocation the container is owed (within its guarantee, or under a granted lease) with a short
backoff, up to TESSERA_RECLAIM_RETRY_MS (1 s by default), then fails as before — on every path
that allocates it (cuMemAlloc, cuMemAllocPitch, cuMemAllocAsync, cuMemAllocFromPoolAsync,
cuMemCreate, cuArrayCreate). The
whole bound is waited only while memory is known to be coming back (a lease the service held for
a reclaim, a dead process of the container, free memory rising on the card); a card full of
memory nobody gives back fails within TV_OWED_QUIET_MS (50 ms), not the bound.

The fake driver models the late free: FAKE_EXIT_FREE_DELAY_MS=<n> gives a gone process's memory
back only n ms after a check first found it gone (tests/native/fakes/fake_state.c)."""

from __future__ import annotations

import time

import pytest

from tessera import region

from .conftest import Cluster
from .elastic_rig import ElasticNode, GiB

BORROWER = "a1111111-1111-4111-8111-111111111111"
NEIGHBOUR = "b2222222-2222-4222-8222-222222222222"
LATE_FREE_MS = 300  # well inside the default bound (1000 ms)
PITCH_WIDTH = 300 * 1024  # cuctl's `alloc pitch`: rows of 300 KiB (a multiple of 512)


def allocated(kind: str, size: int) -> int:
    """The bytes cuctl's `alloc KIND size` takes (a pitched one: whole rows)."""
    return size // PITCH_WIDTH * PITCH_WIDTH if kind == "pitch" else size


def evict_for_the_neighbour(
    node: ElasticNode, kind: str = "plain", **neighbour_env: str
) -> tuple[dict, float, str]:
    """An evictable borrower holds 12 GiB of the 16 GiB card; a neighbour guaranteed 8 GiB
    allocates them (the lease service evicts the borrower, kubelet kills it). Returns the
    neighbour's answer, how long it took, and the diagnosis for a failed expectation."""
    pod = node.pod(BORROWER, "burst", guarantee_mib=4096, limit_mib=12288, reclaim="evict")
    b = pod.cuctl()
    for _ in range(12):
        assert b(f"alloc plain {GiB}")["ok"], b.stderr()
    neighbour = node.pod(NEIGHBOUR, "guaranteed", guarantee_mib=8192)
    n = neighbour.cuctl(FAKE_EXIT_FREE_DELAY_MS=str(LATE_FREE_MS), LIBCUDA_LOG_LEVEL="3",
                        **neighbour_env)  # fmt: skip
    if kind == "pool":
        assert n("init")["ok"] and n("pool_create")["ok"], n.stderr()
    t0 = time.monotonic()
    r = n(f"alloc {kind} {8 * GiB}", timeout=40)
    waited = time.monotonic() - t0
    assert [x.action for _, x in node.notices] == ["evicted"], node.diagnosis(n, b)
    assert b.p.wait(timeout=30) == -9  # the borrower's process is gone (killed)
    return r, waited, node.diagnosis(n, b)


@pytest.mark.parametrize("kind", ["plain", "pitch", "async", "pool", "vmm", "array"])
def test_an_evicted_borrowers_memory_freed_late_still_goes_to_the_neighbour(
    node: ElasticNode, kind: str
) -> None:
    r, waited, why = evict_for_the_neighbour(node, kind)
    assert r["ok"], (r, round(waited, 2), why)
    n = node.pods[NEIGHBOUR].procs[0]
    assert "allocated after" in n.stderr(), why  # the driver's OOM came first, then the retry
    assert "being given back for it" in n.stderr(), why  # the lease was held for the reclaim
    # the card: the neighbour's 8 GiB, the borrower's gone
    assert n("phys")["phys"] == allocated(kind, 8 * GiB)


def test_without_the_retry_the_late_free_is_the_drivers_oom(node: ElasticNode) -> None:
    """The same reclaim with the retry off (0 ms): the fake's late free bites — what the test
    above would see without libvgpu's retry."""
    r, _, why = evict_for_the_neighbour(node, TESSERA_RECLAIM_RETRY_MS="0")
    assert not r["ok"] and r["rc"] == 2, (r, why)  # CUDA_ERROR_OUT_OF_MEMORY
    n = node.pods[NEIGHBOUR].procs[0]
    assert "retrying" not in n.stderr()


def hog_and_limited(cluster: Cluster, guarantee: int, oversubscribe: bool = False,
                    hog: int = 12 * GiB, **env: str):  # fmt: skip
    """A process outside libvgpu holds `hog` bytes of device 0 (16 GiB) for good; a container
    guaranteed `guarantee` bytes there (a hard slice, no lease service) starts beside it.
    Returns the container and its process."""
    h = cluster.container("hog").cuctl(preload=False)
    assert h("init")["ok"] and h(f"alloc plain {hog}")["ok"], h.stderr()
    k = cluster.container("k")
    k.seal(region.DeviceLimit("", guarantee, 0), oversubscribe=oversubscribe)
    c = k.cuctl(LIBCUDA_LOG_LEVEL="3", **env)
    assert c("init")["ok"], c.stderr()
    return k, c


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_a_card_full_of_memory_nobody_gives_back_fails_without_waiting_the_bound(
    cluster: Cluster, kind: str
) -> None:
    """The card is full with a process outside Tessera that frees nothing: the allocation within
    the guarantee is owed, but no reclaim is under way, no process of the container died and
    the card's free memory does not rise — libvgpu fails it after its short look (50 ms), not
    after the 5 s bound."""
    bound_ms = 5000
    k, c = hog_and_limited(cluster, 8 * GiB, TESSERA_RECLAIM_RETRY_MS=str(bound_ms))
    t0 = time.monotonic()
    r = c(f"alloc {kind} {8 * GiB}", timeout=30)
    waited = time.monotonic() - t0
    assert not r["ok"] and r["rc"] == 2, (r, c.stderr())
    assert waited < 2.5, (waited, c.stderr())  # half the bound at most, even on a busy CPU
    assert "nothing is given back" in c.stderr(), c.stderr()
    assert k.used() == 0  # the charge rolled back
    assert c(f"alloc {kind} {GiB}")["ok"]  # what the card has: at once


def test_a_dead_process_memory_freed_late_is_waited_for(cluster: Cluster) -> None:
    """A process of the container dies holding its whole 8 GiB guarantee; the driver frees its
    memory 300 ms late (the card's other 8 GiB are a process outside Tessera). The next process
    reclaims the dead one's charge, gets the driver's OOM, and is given its memory by the retry:
    the dead process is the reason to wait."""
    k, a = hog_and_limited(cluster, 8 * GiB, hog=8 * GiB)
    assert a(f"alloc plain {8 * GiB}")["ok"], a.stderr()
    a.p.kill()
    a.p.wait(timeout=10)
    b = k.cuctl(LIBCUDA_LOG_LEVEL="3", FAKE_EXIT_FREE_DELAY_MS=str(LATE_FREE_MS))
    assert b("init")["ok"], b.stderr()
    r = b(f"alloc plain {8 * GiB}", timeout=30)
    assert r["ok"], (r, b.stderr())
    assert "allocated after" in b.stderr() and "being given back" in b.stderr(), b.stderr()
    assert k.used() == 8 * GiB
    a.close(check=False)


def test_an_owed_allocation_the_driver_keeps_refusing_fails_after_the_bound(
    cluster: Cluster,
) -> None:
    """A reason to wait that does not deliver: a dead process of the container held 2 GiB, but
    the card's memory is a live process's outside Tessera. The retry waits its whole bound
    (the default, 1 s: the dead process counts as a reason for a bound after its charge was
    reclaimed, which may be at this process's start), then fails: bounded, no hang."""
    bound_ms = 1000
    k, a = hog_and_limited(cluster, 8 * GiB)
    assert a(f"alloc plain {2 * GiB}")["ok"], a.stderr()
    a.p.kill()
    a.p.wait(timeout=10)
    c = k.cuctl(LIBCUDA_LOG_LEVEL="3", TESSERA_RECLAIM_RETRY_MS=str(bound_ms))
    assert c("init")["ok"], c.stderr()
    t0 = time.monotonic()
    r = c(f"alloc plain {8 * GiB}", timeout=30)  # within its guarantee: owed, retried
    waited = time.monotonic() - t0
    assert not r["ok"] and r["rc"] == 2, (r, c.stderr())
    assert bound_ms / 1000 <= waited < 10, (waited, c.stderr())
    assert "still out of memory" in c.stderr()
    assert k.used() == 0  # the charge rolled back
    assert c(f"alloc plain {GiB}")["ok"]  # what the card has: at once
    a.close(check=False)


@pytest.mark.parametrize(
    ("guarantee", "oversubscribe"), [(0, False), (8 * GiB, True)], ids=["unlimited", "scaled"]
)
def test_an_allocation_nobody_promised_fails_at_once(
    cluster: Cluster, guarantee: int, oversubscribe: bool
) -> None:
    """No memory limit, or a limit of an oversubscribed card (memory scaling above 1): nothing
    is owed, the driver's OOM is final at once (as before)."""
    _, c = hog_and_limited(cluster, guarantee, oversubscribe, TESSERA_RECLAIM_RETRY_MS="5000")
    t0 = time.monotonic()
    r = c(f"alloc plain {8 * GiB}", timeout=30)
    assert not r["ok"] and r["rc"] == 2, (r, c.stderr())
    assert time.monotonic() - t0 < 3
    assert "retrying" not in c.stderr()
