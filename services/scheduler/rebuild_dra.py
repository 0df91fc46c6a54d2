"""The DRA part of the ledger's rebuild: running DRA pods read back from their ResourceClaims.

A pod kube-scheduler's structured allocator placed carries no HAMi annotations; its slice is
its claims' allocation (`tessera.dra_restore` reads them, with the driver's own reading of a
claim). The rebuild (rebuild.py) lists the claims once, with the pods, and restores those pods
into the ledger with the others, checked as every restored grant is (`tessera.restore`): no card
over its capacity, a disagreement reported, never resolved by overcommitting.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from tessera.cluster.port import ClusterError, NotFoundError
from tessera.dra_restore import DevicesOf, allocations_from_claims
from tessera.models import Allocation, InFlightClaim
from tessera.restore import RestoreReport

log = logging.getLogger("tessera.scheduler")

Found = dict[str, list[tuple[Allocation, InFlightClaim | None]]]


async def list_claims(cluster: Any) -> list[Any]:
    """Every ResourceClaim of the cluster; [] where the API serves no `resource.k8s.io/v1`
    (a cluster without DRA: nothing to restore). Any other failure is raised: the rebuild is
    tried again and nothing is placed meanwhile."""
    lister = getattr(cluster, "list_resource_claims", None)
    if lister is None:
        return []
    try:
        claims: list[Any] = await lister()
    except NotFoundError:
        return []
    except ClusterError as exc:
        if exc.status == 403:
            raise ClusterError(
                "the scheduler may not list ResourceClaims (resource.k8s.io): a DRA pod's card "
                "cannot be restored; grant it `list` on resourceclaims (its chart's ClusterRole "
                "does)", 403) from exc  # fmt: skip
        raise
    return claims


def merge_dra(
    by_node: Found, claims: Iterable[Any], pods: Iterable[Any], devices_of: DevicesOf, *,
    quota_held: bool, now: float, report: RestoreReport,
) -> None:
    """Add to `by_node` the DRA pods among `pods` (the listing less what the ledger places) that
    hold this driver's claims. A pod already restored from HAMi's annotations keeps that (a pod
    is placed by one allocator only) and the disagreement is reported."""
    by_uid = {}
    for pod in pods:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        spec = pod.get("spec") if isinstance(pod, dict) else None
        if isinstance(meta, dict) and isinstance(spec, dict) and spec.get("resourceClaims"):
            by_uid[str(meta.get("uid"))] = pod
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
