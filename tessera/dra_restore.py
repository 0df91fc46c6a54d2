"""What running DRA pods hold, read back from their ResourceClaims: pure, no I/O.

The cluster is the durable record (DESIGN §4). A pod placed by kube-scheduler's structured
allocator carries no HAMi annotations: its slice is in its ResourceClaims' `status.allocation`
(this driver's results, the `consumedCapacity` of each card) and `status.reservedFor`. When NATS
lost its store, the scheduler restores these into the ledger before any new placement (as it
restores extender pods from their annotations, `tessera.restore`), and quota gives their charges
back, so neither a DRA pod's card nor its namespace's quota is given away while the node agents
(whose own records restore the same entries within seconds) are not back, are switched to
extender mode, or lost their records.

Read as strictly as the driver reads a claim it prepares (`tessera.dra_grants.claim_results`,
the same code): a result naming a device the node's registration does not list, more memory
than the card has or more than 100 % of its compute is not restored and is reported. A claim
counts once, for the first pod it is reserved for that runs on the claim's node, on the first
container naming it (as the driver's ledger entry counts it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tessera.dra_grants import (
    ClaimError,
    claim_ref,
    claim_results,
    container_names,
    pod_use,
    reserved_pods,
    result_pools,
)
from tessera.dra_names import DRA_REASON
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo
from tessera.restore import FINISHED_PHASES, RestoreReport, init_containers_succeeded

DevicesOf = Callable[[str], list[DeviceInfo] | None]  # node -> its registered GPUs (None: unknown)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def pods_with_claims(pods: Iterable[Any]) -> dict[str, Any]:
    """uid -> pod of the pods that name ResourceClaims (anything else in `pods` is skipped)."""
    found = {}
    for pod in pods:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        spec = pod.get("spec") if isinstance(pod, dict) else None
        if isinstance(meta, dict) and isinstance(spec, dict) and spec.get("resourceClaims"):
            found[str(meta.get("uid"))] = pod
    return found


def claim_nodes(claims: Iterable[Any]) -> set[str]:
    """The nodes whose GPUs these claims were allocated (this driver's pools)."""
    return {pool for c in claims if isinstance(c, dict) for pool in result_pools(c)}


def _running_pod(claim: dict[str, Any], pods: Mapping[str, Any], pools: set[str]
                 ) -> dict[str, Any] | None:  # fmt: skip
    """The first pod the claim is reserved for that the listing holds, bound to one of the
    claim's nodes and not finished (None: no such pod; nothing of the claim runs)."""
    namespace = _obj(claim.get("metadata")).get("namespace")
    for _name, uid in reserved_pods(claim):
        pod = pods.get(uid)
        if not isinstance(pod, dict):
            continue
        meta, spec, status = (_obj(pod.get(k)) for k in ("metadata", "spec", "status"))
        if meta.get("namespace") != namespace or spec.get("nodeName") not in pools:
            continue
        if status.get("phase") in FINISHED_PHASES:
            continue
        return pod
    return None


def allocations_from_claims(
    claims: Iterable[Any],
    pods: Mapping[str, Any],
    devices_of: DevicesOf,
    *,
    quota_held: bool,
    now: float,
    report: RestoreReport,
) -> dict[str, list[tuple[Allocation, None]]]:
    """The allocations of running DRA pods, by node. `pods`: uid -> pod of the pods to restore
    (a listing less those the ledger already places); `devices_of`: a node's registered GPUs."""
    # pod uid -> (pod, node, [(claim uid, container index, grants)])
    held: dict[str, tuple[dict[str, Any], str, list[tuple[str, int, list[DeviceGrant]]]]] = {}
    for claim in claims:
        if not isinstance(claim, dict):
            continue
        pools = result_pools(claim)
        if not pools:
            continue  # not this driver's, or not allocated
        pod = _running_pod(claim, pods, pools)
        if pod is None:
            continue
        meta = _obj(pod.get("metadata"))
        node = str(_obj(pod.get("spec")).get("nodeName"))
        who = f"{meta.get('namespace')}/{meta.get('name')} on {node}"
        devices = devices_of(node)
        if devices is None:
            report.refused.append(f"{who}: ResourceClaim {claim_ref(claim)} not restored: the "
                                  "node has not registered its GPUs (its agent restores it)")
            continue
        try:
            found = [f for f in claim_results(claim, node, devices) if not f.admin_access]
        except ClaimError as exc:
            report.refused.append(f"{who}: not restored: {exc}"[:400])
            continue
        if not found:
            continue  # admin access only: it holds no slice
        use = pod_use(pod, str(_obj(claim.get("metadata")).get("name", "")))
        index = use.indices[0] if use.indices else 0
        uid = str(meta.get("uid"))
        entry = held.setdefault(uid, (pod, node, []))
        entry[2].append((str(_obj(claim.get("metadata")).get("uid", "")), index,
                         [f.grant for f in found]))  # fmt: skip
    by_node: dict[str, list[tuple[Allocation, None]]] = defaultdict(list)
    for uid, (pod, node, claimed) in sorted(held.items()):
        report.gpu_pods += 1
        by_node[node].append((_allocation(uid, pod, node, claimed, quota_held, now), None))
    return by_node


def _allocation(uid: str, pod: dict[str, Any], node: str,
                claimed: list[tuple[str, int, list[DeviceGrant]]], quota_held: bool, now: float
                ) -> Allocation:  # fmt: skip
    """The pod's allocation as the driver writes it (`node_agent.dra.accounting`): container
    `i` holds the devices of the claims whose first user it is, claims in uid order."""
    meta = _obj(pod.get("metadata"))
    names = container_names(pod)
    count = max(len(names), 1 + max(index for _uid, index, _grants in claimed))
    containers: list[list[DeviceGrant]] = [[] for _ in range(count)]
    for _claim_uid, index, grants in sorted(claimed, key=lambda c: c[0]):
        containers[index].extend(grants)
    init = len(_obj(pod.get("spec")).get("initContainers") or [])
    return Allocation(
        pod_uid=uid, namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""), node=node, containers=containers,
        init_count=min(init, count), init_done=init_containers_succeeded(pod),
        state=AllocationState.ALLOCATED, created_at=now, updated_at=now, reason=DRA_REASON,
        quota_held=quota_held, container_names=names + [""] * (count - len(names)),
    )  # fmt: skip
