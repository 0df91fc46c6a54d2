"""What bound pods say they hold: allocations read back from HAMi's pod annotations.

The cluster is the durable record (DESIGN §4): every GPU pod the scheduler binds carries its grants
in `hami.io/vgpu-devices-to-allocate` (and `hami.io/vgpu-node`, `hami.io/bind-phase`). When NATS
lost its store, the scheduler rebuilds the ledger and quota rebuilds its charges from these.
Pure code, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tessera import hami
from tessera.models import Allocation, AllocationState, InFlightClaim

FINISHED_PHASES = ("Succeeded", "Failed")


def init_containers_succeeded(pod: dict[str, Any]) -> bool:
    """Every init container has terminated with exit code 0."""
    spec = pod.get("spec") or {}
    wanted = len(spec.get("initContainers") or [])
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    if wanted == 0 or len(statuses) < wanted:
        return False
    for status in statuses:
        terminated = ((status or {}).get("state") or {}).get("terminated") or {}
        if terminated.get("exitCode") != 0:
            return False
    return True


@dataclass
class RestoreReport:
    """What one pass over the pods found and did (logged; counted in metrics)."""

    pods_seen: int = 0
    gpu_pods: int = 0
    restored: int = 0
    nodes_written: int = 0
    unreadable: list[str] = field(default_factory=list)  # "ns/name: why"
    unknown_devices: list[str] = field(default_factory=list)  # "ns/name on node: uuid"


def allocation_from_pod(
    pod: dict[str, Any], *, quota_held: bool, now: float, claim_ttl_s: float
) -> tuple[Allocation, InFlightClaim | None] | None:
    """The allocation a bound, unfinished pod runs on, from its annotations (None: not a bound
    GPU pod). Raises ValueError when the annotations are present but malformed."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    node = spec.get("nodeName")
    annotations = meta.get("annotations") or {}
    if not node or status.get("phase") in FINISHED_PHASES or not isinstance(annotations, dict):
        return None
    text = annotations.get(hami.ANN_DEVICES_ALLOCATED) or annotations.get(
        hami.ANN_DEVICES_TO_ALLOCATE
    )
    if not text:
        return None
    granted_on = annotations.get(hami.ANN_VGPU_NODE)
    if granted_on and granted_on != node:
        raise ValueError(f"granted on {granted_on} but bound to {node}")
    containers = hami.decode_pod_devices(str(text))
    if not any(containers):
        return None
    init = spec.get("initContainers") or []
    app = spec.get("containers") or []
    names = [str((c or {}).get("name", "")) for c in [*init, *app]]
    if len(containers) > len(names):
        raise ValueError(f"{len(containers)} grant lists for {len(names)} containers")
    allocating = annotations.get(hami.ANN_BIND_PHASE) == hami.BIND_PHASE_ALLOCATING
    uid, namespace, name = meta.get("uid") or "", meta.get("namespace") or "default", meta["name"]
    allocation = Allocation(
        pod_uid=uid, namespace=namespace, name=name, node=node, containers=containers,
        init_count=len(init), init_done=init_containers_succeeded(pod),
        state=AllocationState.BOUND if allocating else AllocationState.ALLOCATED,
        created_at=now, updated_at=now, container_names=names, quota_held=quota_held,
        reason="restored from the pod's annotations",
    )  # fmt: skip
    # A pod between bind and its node agent's Allocate needs the node's claim to be served.
    claim = None
    if allocating:
        claim = InFlightClaim(pod_uid=uid, namespace=namespace, name=name, taken_at=now,
                              expires_at=now + claim_ttl_s, holder="rebuild")  # fmt: skip
    return allocation, claim


def allocations_from_pods(
    pods: Iterable[dict[str, Any]], *, quota_held: bool, now: float, claim_ttl_s: float,
    report: RestoreReport,
) -> dict[str, list[tuple[Allocation, InFlightClaim | None]]]:
    """Bound, unfinished GPU pods grouped by node."""
    by_node: dict[str, list[tuple[Allocation, InFlightClaim | None]]] = defaultdict(list)
    for pod in pods:
        report.pods_seen += 1
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not meta.get("uid") or not meta.get("name"):
            continue
        try:
            found = allocation_from_pod(pod, quota_held=quota_held, now=now,
                                        claim_ttl_s=claim_ttl_s)  # fmt: skip
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # hostile shapes too
            why = exc if isinstance(exc, ValueError | TypeError) else f"malformed pod ({exc!r})"
            report.unreadable.append(f"{meta.get('namespace')}/{meta.get('name')}: {why}"[:300])
            continue
        if found is not None:
            report.gpu_pods += 1
            by_node[found[0].node].append(found)
    return by_node
