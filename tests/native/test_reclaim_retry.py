"""Issue 33, a reclaim on a real GPU: the kernel closes a dying process's files in fd order, so
an evicted borrower's lease socket may close (and the lease service grant its memory to the
neighbour) a moment before the driver has freed that process's device memory. The neighbour's
allocation then gets the driver's out-of-memory although it was owed the memory. libvgpu retries
an allocation the container is owed (within its guarantee, or under a granted lease) with a short
backoff, up to TESSERA_RECLAIM_RETRY_MS (1 s by default), then fails as before.

The fake driver models the late free: FAKE_EXIT_FREE_DELAY_MS=<n> gives a gone process's memory
back only n ms after a check first found it gone (tests/native/fakes/fake_state.c)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera import region

from .conftest import Cluster, NativeBuild
from .elastic_rig import ElasticNode, GiB

BORROWER = "a1111111-1111-4111-8111-111111111111"
NEIGHBOUR = "b2222222-2222-4222-8222-222222222222"
LATE_FREE_MS = 300  # well inside the default bound (1000 ms)


@pytest.fixture
def node(native: NativeBuild) -> Iterator[ElasticNode]:
    base = Path(tempfile.mkdtemp(prefix="rcl-"))  # lease socket paths stay under 108 bytes
    n = ElasticNode(native, base)
    try:
        yield n
    finally:
        n.stop()
        shutil.rmtree(base, ignore_errors=True)


def evict_for_the_neighbour(node: ElasticNode, **neighbour_env: str) -> tuple[dict, float, str]:
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
    t0 = time.monotonic()
    r = n(f"alloc plain {8 * GiB}", timeout=40)
    waited = time.monotonic() - t0
    assert [x.action for _, x in node.notices] == ["evicted"], node.diagnosis(n, b)
    assert b.p.wait(timeout=30) == -9  # the borrower's process is gone (killed)
    return r, waited, node.diagnosis(n, b)


def test_an_evicted_borrowers_memory_freed_late_still_goes_to_the_neighbour(
    node: ElasticNode,
) -> None:
    r, waited, why = evict_for_the_neighbour(node)
    assert r["ok"], (r, round(waited, 2), why)
    n = node.pods[NEIGHBOUR].procs[0]
    assert "allocated after" in n.stderr(), why  # the driver's OOM came first, then the retry
    assert n("phys")["phys"] == 8 * GiB  # the card: the neighbour's 8 GiB, the borrower's gone


def test_without_the_retry_the_late_free_is_the_drivers_oom(node: ElasticNode) -> None:
    """The same reclaim with the retry off (0 ms): the fake's late free bites — what the test
    above would see without libvgpu's retry."""
    r, _, why = evict_for_the_neighbour(node, TESSERA_RECLAIM_RETRY_MS="0")
    assert not r["ok"] and r["rc"] == 2, (r, why)  # CUDA_ERROR_OUT_OF_MEMORY
    n = node.pods[NEIGHBOUR].procs[0]
    assert "retrying" not in n.stderr()


def hog_and_limited(cluster: Cluster, guarantee: int, oversubscribe: bool = False, **env: str):
    """A process outside libvgpu holds 12 GiB of device 0 (16 GiB) for good; a container
    guaranteed `guarantee` bytes there (a hard slice, no lease service) starts beside it.
    Returns the container and its process."""
    hog = cluster.container("hog").cuctl(preload=False)
    assert hog("init")["ok"] and hog(f"alloc plain {12 * GiB}")["ok"], hog.stderr()
    k = cluster.container("k")
    k.seal(region.DeviceLimit("", guarantee, 0), oversubscribe=oversubscribe)
    c = k.cuctl(LIBCUDA_LOG_LEVEL="3", **env)
    assert c("init")["ok"], c.stderr()
    return k, c


def test_an_owed_allocation_the_driver_keeps_refusing_fails_after_the_bound(
    cluster: Cluster,
) -> None:
    bound_ms = 400
    k, c = hog_and_limited(cluster, 8 * GiB, TESSERA_RECLAIM_RETRY_MS=str(bound_ms))
    t0 = time.monotonic()
    r = c(f"alloc plain {8 * GiB}", timeout=30)  # within its guarantee: owed, retried
    waited = time.monotonic() - t0
    assert not r["ok"] and r["rc"] == 2, (r, c.stderr())
    assert bound_ms / 1000 <= waited < 10, (waited, c.stderr())  # bounded: fails, no hang
    assert "still out of memory" in c.stderr()
    assert k.used() == 0  # the charge rolled back
    assert c(f"alloc plain {GiB}")["ok"]  # what the card has: at once


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
