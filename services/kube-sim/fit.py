"""kube-scheduler's NodeResourcesFit filter and its "0/N nodes are available" message.

A pod fits a node when, for every resource it requests (cpu, memory, ephemeral-storage and
every extended resource such as `nvidia.com/mig-1g.10gb`), the node's allocatable minus what the
pods already bound there request covers it. A node that does not advertise a resource at all
has none of it: nodes advertise exactly the extended resources their device plugins registered
(kubelet writes those into `status.allocatable`), so a pod asking for a resource no plugin
serves stays Pending with `Insufficient <resource>`, never Running without its device.
Resources the scheduler extender manages with `ignoredByScheduler: true` are left to it.
The effective request is kube-scheduler's: the sum over app containers, or the largest init
container's request when that is larger. Pure functions.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any

from tessera.kube_sim.quantity import QuantityError, parse

KubeObject = dict[str, Any]
Requests = dict[str, Fraction]
CHECKED_NATIVE = ("cpu", "memory", "ephemeral-storage")


def _container_requests(container: dict[str, Any]) -> Requests:
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = {**limits, **(resources.get("requests") or {})}  # a limit alone is the request
    found: Requests = {}
    for name, value in requests.items():
        try:
            found[str(name)] = parse(value)
        except QuantityError:
            continue
    return found


def pod_requests(pod: KubeObject) -> Requests:
    spec = pod.get("spec") or {}
    total: Requests = {}
    for container in spec.get("containers") or []:
        for name, value in _container_requests(container).items():
            total[name] = total.get(name, Fraction(0)) + value
    sidecars: Requests = {}
    for container in spec.get("initContainers") or []:
        requested = _container_requests(container)
        if container.get("restartPolicy") == "Always":  # a sidecar runs beside the app
            for name, value in requested.items():
                sidecars[name] = sidecars.get(name, Fraction(0)) + value
            continue
        for name, value in requested.items():
            total[name] = max(total.get(name, Fraction(0)), value + sidecars.get(name, 0))
    for name, value in sidecars.items():
        total[name] = total.get(name, Fraction(0)) + value
    return total


def checked(name: str) -> bool:
    """Resources NodeResourcesFit compares: cpu, memory, storage and extended resources."""
    return name in CHECKED_NATIVE or ("/" in name and not name.startswith("kubernetes.io/"))


def allocatable(node: KubeObject) -> Requests:
    status = node.get("status") or {}
    found: Requests = {}
    for name, value in (status.get("allocatable") or status.get("capacity") or {}).items():
        try:
            found[str(name)] = parse(value)
        except QuantityError:
            continue
    return found


def insufficient(
    wanted: Requests, node: KubeObject, used: Requests, ignored: frozenset[str] | set[str]
) -> list[str]:
    """The reasons the node cannot take the pod (empty: it fits), kube-scheduler's wording."""
    free = allocatable(node)
    reasons = []
    for name in sorted(wanted):
        amount = wanted[name]
        if amount <= 0 or name in ignored or not checked(name):
            continue
        if name in CHECKED_NATIVE and name not in free:
            continue  # a node that reports no cpu/memory is not limited by it
        if used.get(name, Fraction(0)) + amount > free.get(name, Fraction(0)):
            reasons.append(f"Insufficient {name}")
    return reasons


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration.get("key") == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and (
            toleration.get("value") or ""
        ) == (taint.get("value") or ""):
            return True
    return False


def node_refusal(pod: KubeObject, node: KubeObject) -> str | None:
    """kube-scheduler's NodeUnschedulable and TaintToleration filters (None: no objection)."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    spec = node.get("spec") or {}
    if spec.get("unschedulable") and not tolerates(
        tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ):
        return "node(s) were unschedulable"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(
            tolerations, taint
        ):
            return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"
    return None


def unavailable_message(total_nodes: int, reasons: dict[str, list[str]]) -> str:
    """`0/3 nodes are available: 1 Insufficient cpu, 3 Insufficient nvidia.com/gpu.`:
    each reason counted over the nodes, sorted, as kube-scheduler's FitError prints it."""
    counts: Counter[str] = Counter()
    for node_reasons in reasons.values():
        counts.update(set(node_reasons))
    parts = [f"{count} {reason}" for reason, count in sorted(counts.items())]
    missing = total_nodes - len(reasons)
    if missing > 0:
        parts.append(f"{missing} node(s) were filtered out")
    return f"0/{total_nodes} nodes are available: {', '.join(parts)}."


class NodeUsage:
    """What the pods bound to each node request, kept up to date from the pod watch, with
    kube-scheduler's "assume": a pod counts on its node from the moment its bind starts."""

    def __init__(self) -> None:
        self._by_pod: dict[tuple[str, str], tuple[str, Requests]] = {}
        self._by_node: dict[str, Requests] = {}

    def used(self, node: str) -> Requests:
        return self._by_node.get(node, {})

    def add(self, key: tuple[str, str], node: str, requests: Requests) -> None:
        if self._by_pod.get(key, (None, None))[0] == node:
            return
        self.remove(key)
        self._by_pod[key] = (node, requests)
        usage = self._by_node.setdefault(node, {})
        for name, value in requests.items():
            usage[name] = usage.get(name, Fraction(0)) + value

    def remove(self, key: tuple[str, str]) -> None:
        entry = self._by_pod.pop(key, None)
        if entry is None:
            return
        node, requests = entry
        usage = self._by_node.get(node, {})
        for name, value in requests.items():
            usage[name] = usage.get(name, Fraction(0)) - value

    def observe(self, pod: KubeObject, deleted: bool = False) -> None:
        """Follow one pod event: bound and active counts, deleted or finished does not."""
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if deleted or not node or phase in ("Succeeded", "Failed"):
            self.remove(key)
        else:
            self.add(key, node, pod_requests(pod))
