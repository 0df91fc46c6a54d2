"""Charges of pods the cluster no longer has, freed before a (re)started quota service serves.

A pod deleted while no scheduler (or no NATS) was up never got its `released` event, so its
charge stays until the reconcile pass finds no ledger entry behind it — and while the ledger
still holds the stale allocation (the scheduler has not released it yet), not even then. The
quota service lists the cluster's pods at start anyway (`charges_from_pods`); a charge whose pod
uid that listing lacks, or lists as finished, is freed on the spot.

The grace: a charge made after the listing began (less `skew_s`, for the scheduler's clock
against ours) is kept, whatever the listing says: the scheduler charges a pod while placing it,
and a pod that new may be missing from a listing taken a moment before. A pod must exist before
the scheduler reserves for it, so an older charge whose pod is not listed belongs to a pod that
is gone.

`stale_charges` decides (pure); `release_stale_charges` reads the charges and writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tessera.quota import arithmetic as qa
from tessera.quota.recovery import snapshot
from tessera.quota.store import QuotaStore

from tessera.models import Allocation, QuotaCharge, QuotaState

SKEW_S = 5.0
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def live_uids(pods: Iterable[Any]) -> frozenset[str]:
    """The uids of the listed pods that have not finished."""
    live: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        uid = meta.get("uid") if isinstance(meta, dict) else None
        status = pod.get("status") if isinstance(pod, dict) else None
        phase = status.get("phase") if isinstance(status, dict) else None
        if type(uid) is str and phase not in FINISHED_PHASES:
            live.add(uid)
    return frozenset(live)


def stale_charges(charges: Mapping[str, QuotaCharge], live: frozenset[str], listed_at: float,
                  skew_s: float = SKEW_S) -> list[str]:  # fmt: skip
    """The pod uids whose charge is to be freed: not live in the listing, charged before it."""
    return sorted(uid for uid, charge in charges.items()
                  if uid not in live and charge.at < listed_at - skew_s)  # fmt: skip


def gone_allocation(live: frozenset[str], listed_at: float, skew_s: float = SKEW_S
                    ) -> Callable[[Allocation], bool]:  # fmt: skip
    """Whether a ledger allocation belongs to a pod the listing lacks (by the same grace):
    its charge is not given back by the reconcile while the scheduler has yet to release it."""
    return lambda a: a.pod_uid not in live and a.created_at < listed_at - skew_s


async def release_stale_charges(
    store: QuotaStore, pods: list[Any], listed_at: float, log: logging.Logger,
    skew_s: float = SKEW_S,
) -> int:  # fmt: skip
    """Free every stale charge in every namespace; returns how many were freed."""
    live = live_uids(pods)
    freed = 0
    namespaces = await snapshot(store.counters, QuotaState, log)
    for namespace in sorted(namespaces):
        view = await store.full_state(namespace)
        if view is None:
            continue
        gone = stale_charges(view.charges, live, listed_at, skew_s)
        for uid in gone:
            _result, wrote = await store.update(namespace, uid, lambda s, own, u=uid: qa.release(
                s, u, charged_before=listed_at - skew_s, own_settled=own))  # fmt: skip
            freed += wrote
        if gone:
            log.warning("freed the quota charges of pods the cluster no longer has", extra={
                "namespace": namespace, "pods": [view.charges[u].name or u for u in gone[:10]],
                "reason": "pod no longer exists (deleted while no scheduler watched it)",
            })  # fmt: skip
    return freed
