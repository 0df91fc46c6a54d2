"""The DRA part of the ledger's rebuild: running DRA pods read back from their ResourceClaims.

A pod kube-scheduler's structured allocator placed carries no HAMi annotations; its slice is
its claims' allocation (`tessera.dra_restore` reads them, with the driver's own reading of a
claim). The rebuild (rebuild.py) lists the claims once, with the pods, and restores those pods
into the ledger with the others, checked as every restored grant is (`tessera.restore`): no card
over its capacity, a disagreement reported, never resolved by overcommitting.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tessera.dra_restore import DevicesOf, allocations_from_claims, pods_with_claims
from tessera.models import Allocation, InFlightClaim
from tessera.restore import RestoreReport

Found = dict[str, list[tuple[Allocation, InFlightClaim | None]]]


def merge_dra(
    by_node: Found, claims: Iterable[Any], pods: Iterable[Any], devices_of: DevicesOf, *,
    quota_held: bool, now: float, report: RestoreReport,
) -> None:
    """Add to `by_node` the DRA pods among `pods` (the listing less what the ledger places) that
    hold this driver's claims. A pod already restored from HAMi's annotations keeps that (a pod
    is placed by one allocator only) and the disagreement is reported."""
    by_uid = pods_with_claims(pods)
    if not by_uid:
        return
    annotated = {a.pod_uid for found in by_node.values() for a, _claim in found}
    restored = allocations_from_claims(claims, by_uid, devices_of, quota_held=quota_held,
                                       now=now, report=report)  # fmt: skip
    for node, found in restored.items():
        for allocation, claim in found:
            if allocation.pod_uid in annotated:
                report.refused.append(
                    f"{allocation.namespace}/{allocation.name} on {node}: holds both HAMi's "
                    "annotations and ResourceClaims of gpu.tessera.io; restored from the "
                    "annotations only")  # fmt: skip
                continue
            by_node.setdefault(node, []).append((allocation, claim))
