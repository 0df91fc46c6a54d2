"""`tessera get nodes`: each node's GPUs, what the pods on it hold, their mode and health.

The GPUs come from the node's `hami.io/node-nvidia-register` (what the node agent, or HAMi's
device plugin, advertises; another vendor's node: its register annotation, docs/vendors.md);
what is used from the grants of the pods bound to the node (`hami.io/vgpu-devices-allocated`,
else `-to-allocate`), as the scheduler counts them: a pod's
init containers run one after another before its app containers, so a card holds the larger of
the init containers' largest grant and the app containers' sum; once the pod runs, only the app
containers. Pure: `summarise` takes the listed nodes and pods.
"""

from __future__ import annotations

import re
from typing import Any

from tessera.hami import ANN_NODE_REGISTER, read_node_register

from .table import render

_DONE = ("Succeeded", "Failed")
# The other vendors' register annotations, in HAMi's two forms (docs/vendors.md): Ascend's
# `hami.io/node-register-<chip>` (JSON) and Hygon's `hami.io/node-dcu-register` (list form).
_VENDOR_REGISTER = re.compile(
    r"^(?:hami\.io/node-(?:dcu-register|register-[A-Za-z0-9._-]+)|tessera\.io/node-register-mlu)$")


def register_annotation(annotations: dict[str, Any]) -> str | None:
    """The node's register annotation: NVIDIA's when it lists a device, else a vendor's (a node
    has one vendor; its NVIDIA annotation is then an empty list)."""
    nvidia = annotations.get(ANN_NODE_REGISTER)
    if nvidia is not None and nvidia.strip() not in ("", "[]"):
        return nvidia
    vendor = next((v for k, v in sorted(annotations.items()) if _VENDOR_REGISTER.match(k)), None)
    return vendor if vendor is not None else nvidia


def _gpu_use(pods: list[dict[str, Any]]) -> tuple[dict[str, dict[str, list[int]]], dict[str, int]]:
    """node -> GPU uuid -> [memory MiB, cores %, pods] held by the pods bound there; and node ->
    how many pods there hold a GPU."""
    from .get import pod_gpus

    use: dict[str, dict[str, list[int]]] = {}
    gpu_pods: dict[str, int] = {}
    for pod in pods:
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in _DONE:
            continue
        containers = pod_gpus(pod)
        inits = min(len(spec.get("initContainers") or []), len(containers))
        held: dict[str, list[int]] = {}
        for container in containers[inits:]:
            for g in container:
                slot = held.setdefault(g["uuid"], [0, 0])
                slot[0] += g["memory_mib"]
                slot[1] += g["cores"]
        if phase != "Running":  # init containers still to run: the larger of the two
            for container in containers[:inits]:
                for g in container:
                    slot = held.setdefault(g["uuid"], [0, 0])
                    slot[0] = max(slot[0], g["memory_mib"])
                    slot[1] = max(slot[1], g["cores"])
        on_node = use.setdefault(node, {})
        gpu_pods[node] = gpu_pods.get(node, 0) + bool(held)
        for uuid, (memory, cores) in held.items():
            total = on_node.setdefault(uuid, [0, 0, 0])
            total[0] += memory
            total[1] += cores
            total[2] += 1
    return use, gpu_pods


def _ready(node: dict[str, Any]) -> str:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return "Ready" if condition.get("status") == "True" else "NotReady"
    return "Unknown"


def summarise(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per node (what `-o json` prints)."""
    use, gpu_pods = _gpu_use(pods)
    out = []
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        register = register_annotation(meta.get("annotations") or {})
        problem = ""
        devices = []
        if register is not None:
            try:
                devices = read_node_register(register)
            except ValueError as exc:
                problem = str(exc)
        held = use.get(name, {})
        gpus = []
        for d in sorted(devices, key=lambda d: d.index):
            memory, cores, count = held.get(d.uuid, [0, 0, 0])
            gpus.append({
                "uuid": d.uuid, "index": d.index, "type": d.type, "mode": d.mode,
                "healthy": d.healthy, "memory_used_mib": memory, "memory_mib": d.memory_mib,
                "cores_used": cores, "cores": d.cores, "pods": count, "split_count": d.split_count,
            })  # fmt: skip
        out.append({
            "name": name, "status": _ready(node), "created": meta.get("creationTimestamp", ""),
            "gpus": gpus, "register_problem": problem,
            "memory_used_mib": sum(g["memory_used_mib"] for g in gpus),
            "memory_mib": sum(g["memory_mib"] for g in gpus),
            "cores_used": sum(g["cores_used"] for g in gpus),
            "cores": sum(g["cores"] for g in gpus),
            "gpu_pods": gpu_pods.get(name, 0),
        })  # fmt: skip
    return out


def _health(gpus: list[dict[str, Any]], problem: str) -> str:
    if problem:
        return "unreadable"
    if not gpus:
        return "-"
    healthy = sum(1 for g in gpus if g["healthy"])
    return "healthy" if healthy == len(gpus) else f"{len(gpus) - healthy} unhealthy"


def nodes_table(summaries: list[dict[str, Any]], wide: bool = False) -> str:
    headers = ["NAME", "STATUS", "GPUS", "MEMORY (MiB)", "CORES", "MODE", "HEALTH"]
    if wide:
        headers += ["GPU PODS", "TYPE", "SPLIT", "CREATED"]
    rows = []
    for s in summaries:
        gpus = s["gpus"]
        modes = sorted({g["mode"] for g in gpus})
        row = [
            s["name"], s["status"], str(len(gpus)),
            f"{s['memory_used_mib']}/{s['memory_mib']}" if gpus else "-",
            f"{s['cores_used']}/{s['cores']}%" if gpus else "-",
            ",".join(modes) or "-", _health(gpus, s["register_problem"]),
        ]  # fmt: skip
        if wide:
            types = sorted({g["type"] for g in gpus})
            splits = sorted({g["split_count"] for g in gpus})
            row += [str(s["gpu_pods"]), ",".join(types) or "-",
                    ",".join(map(str, splits)) or "-", s["created"]]  # fmt: skip
        rows.append(row)
    return render(headers, rows)
