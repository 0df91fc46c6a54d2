"""kube-scheduler's NodeResourcesFit for extended resources (`vendor/name`, such as the MIG
resources `nvidia.com/mig-1g.10gb`): a node fits when its allocatable minus what the pods bound
to it request covers the pod's request. Resources the extender manages are left out (kube-
scheduler ignores them: `ignoredByScheduler`). Pure functions over API objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KubeObject = dict[str, Any]


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def _container_requests(container: KubeObject) -> dict[str, int]:
    resources = container.get("resources") or {}
    out = {k: _quantity(v) for k, v in (resources.get("requests") or {}).items()}
    out.update({k: _quantity(v) for k, v in (resources.get("limits") or {}).items()})
    return {k: v for k, v in out.items() if "/" in k and not k.startswith("kubernetes.io/")}


def pod_requests(pod: KubeObject, ignored: Iterable[str] = ()) -> dict[str, int]:
    """The pod's extended resources: app containers summed, init containers by max."""
    skip = set(ignored)
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for k, v in _container_requests(c).items():
            total[k] = total.get(k, 0) + v
    for c in spec.get("initContainers") or []:
        for k, v in _container_requests(c).items():
            total[k] = max(total.get(k, 0), v)
    return {k: v for k, v in total.items() if k not in skip and v > 0}


def refusal(pod: KubeObject, node: KubeObject, bound: Iterable[KubeObject],
            ignored: Iterable[str] = ()) -> str | None:
    """kube-scheduler's reason (`Insufficient nvidia.com/mig-1g.10gb`), or None when it fits."""
    wanted = pod_requests(pod, ignored)
    if not wanted:
        return None
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    used: dict[str, int] = {}
    for other in bound:
        if (other.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for k, v in pod_requests(other, ignored).items():
            used[k] = used.get(k, 0) + v
    for name, count in sorted(wanted.items()):
        if _quantity(allocatable.get(name, 0)) - used.get(name, 0) < count:
            return f"Insufficient {name}"
    return None
