"""Releasing the allocations of pods the cluster no longer has (the I/O of `stale.py`).

Runs once before a (re)started scheduler reports ready, on the listing the rebuild from pods just
took (`LedgerRebuilder.listed`), and periodically while it serves (`SchedulerService`'s
reconcile, on a full listing). Each release goes the usual way (`Scheduler.release`): the
ledger entry is removed with a CAS, the quota charge freed, and `alloc.<node>.released` is
published with the reason, so the dashboard, the quota service and the node agent see why.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable

from .index import ClusterIndex
from .stale import DEFAULT_SKEW_S, Listing, StaleRelease, stale_allocations

log = logging.getLogger("tessera.scheduler")

Release = Callable[..., Awaitable[bool]]  # Scheduler.release(node, uid, *, why=...)


async def release_stale(
    index: ClusterIndex, listing: Listing, release: Release, *, skew_s: float = DEFAULT_SKEW_S,
    parallel: int = 16,
) -> list[StaleRelease]:
    """Release every allocation `stale_allocations` finds in the index; returns those released.
    Nodes are released `parallel` at a time (one node's releases in turn: each is a CAS of its
    entry). A release that fails is logged and left to the next pass."""
    ledgers = {name: entry.view for name, entry in index.entries.items() if entry.view is not None}
    by_node: dict[str, list[StaleRelease]] = defaultdict(list)
    for stale in stale_allocations(index.pod_nodes, ledgers, listing, skew_s):
        by_node[stale.node].append(stale)
    released: list[StaleRelease] = []
    gate = asyncio.Semaphore(parallel)

    async def one_node(found: list[StaleRelease]) -> None:
        async with gate:
            for stale in found:
                try:
                    if await release(stale.node, stale.pod_uid, why=stale.why):
                        released.append(stale)
                except Exception as exc:
                    log.warning("stale allocation not released; the next pass retries", extra={
                        "pod_uid": stale.pod_uid, "node": stale.node, "err": str(exc),
                    })  # fmt: skip

    await asyncio.gather(*(one_node(found) for found in by_node.values()))
    if released:
        log.warning("released allocations of pods the cluster no longer has", extra={
            "released": len(released),
            "pods": [f"{s.namespace}/{s.name} on {s.node}" for s in released[:10]],
        })  # fmt: skip
    return released
