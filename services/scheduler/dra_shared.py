"""A DRA pod's booking kept while a claim it books is still in use by another pod of its node.

A ResourceClaim may be reserved for several pods of one node (`status.reservedFor`): kubelet
prepares it once, for the first pod, and the DRA driver books its slice under that pod (the
ledger entry and the quota charge; a MIG partition's instance is made for it). When that first
pod ends, kube-apiserver's claim controller takes it out of `reservedFor`, and the claim stays
prepared for the others. Releasing the first pod's allocation then would take the slice out of
the ledger and the quota while another pod still holds it, and the MIG reconcile would destroy
the instance it runs in. So the release keeps such a booking; the node's DRA driver hands it on
to the next pod (`DraDriver._hand_on`: one ledger CAS moves the grants, the quota charge moves
with them), and the next release of the ended pod frees what is left as for any pod.

`shared_in_use` decides from the cluster (pure apart from the reads): which claims of the
ended pod's namespace are reserved for another running pod of the node and allocated exactly
devices the ended pod's booking holds and that pod's booking does not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from tessera.cluster.port import ClusterError
from tessera.dra_grants import ClaimError, claim_ref, claim_results, reserved_pods
from tessera.dra_names import DRA_REASON
from tessera.models import Allocation, DeviceGrant, DeviceInfo, NodeLedger

GrantKey = tuple[str, int, int, str, int]


def grant_key(grant: DeviceGrant) -> GrantKey:
    """What identifies a booked slice whatever became of it since (a MIG instance made)."""
    mig = grant.mig
    return (grant.uuid, grant.memory_mib, grant.cores, mig.profile if mig else "",
            mig.start if mig else -1)  # fmt: skip


def held_keys(allocation: Allocation | None) -> Counter[GrantKey]:
    if allocation is None:
        return Counter()
    return Counter(grant_key(g) for row in allocation.containers for g in row)


def claim_keys(claim: dict[str, Any], node: str, devices: list[DeviceInfo]) -> Counter[GrantKey]:
    """The slices the claim books on `node` (admin access books none); empty when unreadable."""
    try:
        found = claim_results(claim, node, devices)
    except ClaimError:
        return Counter()
    return Counter(grant_key(r.grant) for r in found if not r.admin_access)


def _within(part: Counter[GrantKey], whole: Counter[GrantKey]) -> bool:
    return bool(part) and all(whole[k] >= n for k, n in part.items())


async def shared_in_use(
    cluster: Any, node: str, ended: Allocation, ledger: NodeLedger | None,
    devices: Iterable[DeviceInfo],
) -> list[str]:
    """The claims (namespace/name) the ended pod's DRA booking holds that are still reserved for
    another pod running on `node` whose own booking does not hold them yet. Empty for any other
    allocation, or when the cluster cannot say (the release goes ahead as ever)."""
    lister = getattr(cluster, "list_resource_claims", None)
    if ended.reason != DRA_REASON or lister is None or ledger is None:
        return []
    held = held_keys(ended)
    if not held:
        return []
    try:
        claims = await lister(ended.namespace)
    except ClusterError:
        return []
    cards = list(devices)
    out: list[str] = []
    for claim in claims:
        others = [(n, u) for n, u in reserved_pods(claim) if u and u != ended.pod_uid]
        if not others:
            continue
        keys = claim_keys(claim, node, cards)
        if not _within(keys, held):
            continue
        for name, uid in others:
            if _within(keys, held_keys(ledger.allocations.get(uid))):
                continue  # its own booking holds these (its own claim, or handed on already)
            if await _runs_on(cluster, ended.namespace, name, uid, node):
                out.append(claim_ref(claim))
                break
    return out


async def _runs_on(cluster: Any, namespace: str, name: str, uid: str, node: str) -> bool:
    try:
        pod = await cluster.get_pod(namespace, name)
    except ClusterError:
        return False
    meta, spec, status = (pod.get(k) or {} for k in ("metadata", "spec", "status"))
    return (meta.get("uid") == uid and spec.get("nodeName") == node
            and status.get("phase") not in ("Succeeded", "Failed"))  # fmt: skip
