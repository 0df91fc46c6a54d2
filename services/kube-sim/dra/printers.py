"""kube-apiserver's Table columns for the resource.k8s.io kinds (`kubectl get`): DeviceClass
and ResourceClaimTemplate NAME, AGE; ResourceClaim NAME, STATE (`pending`, `allocated`,
`allocated,reserved`, `deleted` first when being deleted), AGE; ResourceSlice NAME, NODE, DRIVER,
POOL, AGE."""

from __future__ import annotations

from datetime import datetime

from tessera.kube_sim.store import KubeObject
from tessera.kube_sim.tables import PRINTERS, Row, age

S = "string"


def claim_state(claim: KubeObject) -> str:
    status = claim.get("status") or {}
    states = []
    if (claim.get("metadata") or {}).get("deletionTimestamp"):
        states.append("deleted")
    if status.get("allocation"):
        states.append("allocated")
    if status.get("reservedFor"):
        states.append("reserved")
    return ",".join(states) or "pending"


def _claim(claim: KubeObject, now: datetime) -> Row:
    return [claim["metadata"]["name"], claim_state(claim),
            age(claim["metadata"].get("creationTimestamp"), now)]


def _slice(resource_slice: KubeObject, now: datetime) -> Row:
    spec = resource_slice.get("spec") or {}
    return [resource_slice["metadata"]["name"], spec.get("nodeName") or "",
            spec.get("driver", ""), (spec.get("pool") or {}).get("name", ""),
            age(resource_slice["metadata"].get("creationTimestamp"), now)]


PRINTERS["ResourceClaim"] = ([("Name", S, 0), ("State", S, 0), ("Age", S, 0)], _claim)
PRINTERS["ResourceSlice"] = (
    [("Name", S, 0), ("Node", S, 0), ("Driver", S, 0), ("Pool", S, 0), ("Age", S, 0)], _slice)
