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

One exception: a charge whose pod a node's ledger still books as a DRA claim's (`dra_booked`)
stays. The scheduler keeps a deleted pod's DRA booking exactly while the claim is shared with a
pod still running on that node (scheduler/dra_shared.py), until that node's DRA driver hands it
on with its charge (`QuotaRequest.handed_from`); freeing the charge here would leave the shared
slice outside the quota until the hand-on. Any other such booking the scheduler releases (at
its start, for pods deleted while it was down), and the release event frees the charge: held a
little longer, never lost.

`stale_charges` decides (pure); `release_stale_charges` reads the charges and writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tessera.quota import arithmetic as qa
from tessera.quota.recovery import snapshot
from tessera.quota.store import QuotaStore

from tessera.dra_names import DRA_REASON
from tessera.models import Allocation, NodeLedger, QuotaCharge, QuotaState

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
                  skew_s: float = SKEW_S, booked: frozenset[str] = frozenset()
                  ) -> list[str]:  # fmt: skip
    """The pod uids whose charge is to be freed: not live in the listing, charged before it,
    not booked as a DRA claim's in a node's ledger (`booked`: `dra_booked`)."""
    return sorted(uid for uid, charge in charges.items()
                  if uid not in live and uid not in booked
                  and charge.at < listed_at - skew_s)  # fmt: skip


def dra_booked(ledgers: Iterable[NodeLedger]) -> frozenset[str]:
    """The pod uids the nodes' ledgers book as a DRA claim's (active, charged to the quota)."""
    return frozenset(uid for ledger in ledgers for uid, a in ledger.allocations.items()
                     if a.reason == DRA_REASON and a.active and a.quota_held)  # fmt: skip


def gone_allocation(live: frozenset[str], listed_at: float, skew_s: float = SKEW_S
                    ) -> Callable[[Allocation], bool]:  # fmt: skip
    """Whether a ledger allocation belongs to a pod the listing lacks (by the same grace):
    its charge is not given back by the reconcile while the scheduler has yet to release it.
    A DRA booking never is (see above: the scheduler keeps it only for a shared claim)."""
    return lambda a: (a.pod_uid not in live and a.created_at < listed_at - skew_s
                      and a.reason != DRA_REASON)  # fmt: skip


async def release_stale_charges(
    store: QuotaStore, pods: list[Any], listed_at: float, log: logging.Logger,
    skew_s: float = SKEW_S, booked: frozenset[str] = frozenset(),
) -> int:  # fmt: skip
    """Free every stale charge in every namespace; returns how many were freed. `booked`: the
    pods the ledgers book as a DRA claim's (kept: `dra_booked`)."""
    live = live_uids(pods)
    freed = 0
    namespaces = await snapshot(store.counters, QuotaState, log)
    for namespace in sorted(namespaces):
        view = await store.full_state(namespace)
        if view is None:
            continue
        gone = stale_charges(view.charges, live, listed_at, skew_s, booked)
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
