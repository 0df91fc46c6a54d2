"""The pod's own node constraints, re-checked at bind: kube-scheduler applied them already, but
a bind call may come from elsewhere, and kubelet does not re-check NoSchedule taints.

Pure functions over plain Kubernetes JSON: `nodeSelector`, required node affinity
(`requiredDuringSchedulingIgnoredDuringExecution`: terms OR'ed, expressions AND'ed; In, NotIn,
Exists, DoesNotExist, Gt, Lt; `matchFields` on metadata.name), and taints with effect NoSchedule
or NoExecute against the pod's tolerations (a cordoned node counts as tainted
`node.kubernetes.io/unschedulable:NoSchedule`, as kube-scheduler treats it).
"""

from __future__ import annotations

from typing import Any

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def _requirement_matches(expression: dict[str, Any], values: dict[str, str]) -> bool:
    key = expression.get("key", "")
    operator = expression.get("operator", "")
    wanted = [str(v) for v in expression.get("values") or []]
    present = key in values
    if operator == "In":
        return present and values[key] in wanted
    if operator == "NotIn":
        return not present or values[key] not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(wanted) == 1:
        try:
            have, limit = int(values[key]), int(wanted[0])
        except ValueError:
            return False
        return have > limit if operator == "Gt" else have < limit
    return False  # an unknown operator matches nothing, as the API server would reject it


def _term_matches(term: dict[str, Any], labels: dict[str, str], name: str) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches no objects
    return all(_requirement_matches(e, labels) for e in expressions) and all(
        _requirement_matches(f, {"metadata.name": name}) for f in fields
    )


def _tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (
        taint.get("value") or ""
    )


def node_constraint_problem(pod: dict[str, Any], node: dict[str, Any]) -> str | None:
    """Why the pod may not run on the node, or None."""
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    name = str(meta.get("name", ""))
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != str(value):
            return f"node {name} does not match the pod's nodeSelector {key}={value}"
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if affinity is not None:
        terms = affinity.get("nodeSelectorTerms") or []
        if not any(_term_matches(t, labels, name) for t in terms):
            return f"node {name} does not match the pod's required node affinity"
    node_spec = node.get("spec") or {}
    taints = list(node_spec.get("taints") or [])
    if node_spec.get("unschedulable"):
        taints.append(UNSCHEDULABLE_TAINT)
    tolerations = spec.get("tolerations") or []
    for taint in taints:
        if taint.get("effect") not in BLOCKING_EFFECTS:
            continue
        if not any(_tolerates(t, taint) for t in tolerations):
            value = f"={taint['value']}" if taint.get("value") else ""
            return (f"node {name} has taint {taint.get('key')}{value}:{taint.get('effect')} "
                    "that the pod does not tolerate")  # fmt: skip
    return None
