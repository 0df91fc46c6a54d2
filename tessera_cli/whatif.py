"""What-if replay: pure parts (the trace, the cluster's GPU state, the figures per policy).

The replay itself (`tessera sim replay`, in `sim.py`) runs the real scheduler: it starts the local
stack once per policy and creates/deletes the trace's pods through kube-sim, so the placements are
exactly what Tessera would do. This module only reads the trace and turns pod annotations into
utilisation and fragmentation figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tessera.device_kinds.pod_grants import pod_grants_text
from tessera.hami import decode_pod_devices


class TraceEvent(BaseModel):
    """One line of a trace: a pod arrives (with its GPU request) or leaves."""

    t: float = Field(0.0, ge=0, description="seconds from the start (orders the events)")
    op: Literal["create", "delete"] = "create"
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str = "default"
    gpus: int = Field(1, ge=1, le=64)
    gpumem: int | None = Field(None, ge=1, description="MiB per GPU")
    gpumem_percentage: int | None = Field(None, ge=1, le=100)
    gpucores: int | None = Field(None, ge=0, le=100)
    annotations: dict[str, str] = Field(default_factory=dict)
    pod: dict[str, Any] | None = Field(None, description="a full pod instead of the fields above")

    def to_pod(self) -> dict[str, Any]:
        if self.pod is not None:
            pod = json.loads(json.dumps(self.pod))
            pod.setdefault("metadata", {})["name"] = self.name
            return pod
        limits: dict[str, Any] = {"nvidia.com/gpu": self.gpus}
        if self.gpumem is not None:
            limits["nvidia.com/gpumem"] = self.gpumem
        if self.gpumem_percentage is not None:
            limits["nvidia.com/gpumem-percentage"] = self.gpumem_percentage
        if self.gpucores is not None:
            limits["nvidia.com/gpucores"] = self.gpucores
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.name, "annotations": dict(self.annotations)},
            "spec": {"containers": [{"name": "main", "image": "trace",
                                     "resources": {"limits": limits}}]},
        }


def load_trace(path: Path) -> list[TraceEvent]:
    """Events ordered by time (stable for equal times); ValueError names the bad line."""
    events: list[TraceEvent] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            events.append(TraceEvent.model_validate_json(line))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    return sorted(events, key=lambda e: e.t)


@dataclass
class GpuState:
    memory_mib: int
    used_mib: int = 0
    used_cores: int = 0
    pods: int = 0


@dataclass
class Snapshot:
    """Cluster GPU figures at one moment."""

    placed: int
    pending: int
    memory_utilisation: float
    compute_utilisation: float
    fragmentation: float  # free memory stranded on shared cards / all free memory
    idle_gpus: int


@dataclass
class PolicyResult:
    policy: str
    snapshots: list[Snapshot] = field(default_factory=list)
    ever_placed: set[str] = field(default_factory=set)
    never_placed: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        shots = self.snapshots
        last = shots[-1] if shots else Snapshot(0, 0, 0, 0, 0, 0)
        return {
            "policy": self.policy,
            "pods_placed": len(self.ever_placed),
            "pods_never_placed": len(self.never_placed),
            "pending_at_end": last.pending,
            "memory_utilisation_peak": round(max((s.memory_utilisation for s in shots),
                                                 default=0.0), 4),
            "memory_utilisation_mean": _mean([s.memory_utilisation for s in shots]),
            "compute_utilisation_mean": _mean([s.compute_utilisation for s in shots]),
            "fragmentation_mean": _mean([s.fragmentation for s in shots]),
            "idle_gpus_min": min((s.idle_gpus for s in shots), default=0),
        }


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def pod_grants(pod: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(uuid, MiB, cores) of every GPU slice a pod holds, from the scheduler's annotation."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    try:
        text = pod_grants_text(annotations)  # each device family's record
    except ValueError:
        return []
    if not text or not (pod.get("spec") or {}).get("nodeName"):
        return []
    try:
        containers = decode_pod_devices(text)
    except ValueError:
        return []
    return [(g.uuid, g.memory_mib, g.cores) for c in containers for g in c]


def snapshot(gpus: dict[str, int], pods: list[dict[str, Any]]) -> Snapshot:
    """Figures for the pods as they are; `gpus` maps every GPU uuid to its memory (MiB)."""
    state = {uuid: GpuState(memory) for uuid, memory in gpus.items()}
    placed = pending = 0
    for pod in pods:
        grants = pod_grants(pod)
        if not grants:
            pending += 1
            continue
        placed += 1
        for uuid, memory, cores in grants:
            gpu = state.setdefault(uuid, GpuState(0))
            gpu.used_mib += memory
            gpu.used_cores += cores
            gpu.pods += 1
    total_mem = sum(g.memory_mib for g in state.values()) or 1
    used_mem = sum(min(g.used_mib, g.memory_mib) for g in state.values())
    free = [(g.memory_mib - g.used_mib, g.pods) for g in state.values()]
    free_total = sum(max(0, f) for f, _ in free)
    stranded = sum(max(0, f) for f, pods_on in free if pods_on > 0)
    return Snapshot(
        placed=placed,
        pending=pending,
        memory_utilisation=used_mem / total_mem,
        compute_utilisation=sum(min(g.used_cores, 100) for g in state.values())
        / (100 * max(1, len(state))),
        fragmentation=stranded / free_total if free_total else 0.0,
        idle_gpus=sum(1 for g in state.values() if g.pods == 0),
    )


def render_chart(results: list[PolicyResult], path: Path) -> None:
    """Memory utilisation and fragmentation over the replay, one line per policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for result in results:
        steps = range(len(result.snapshots))
        top.plot(steps, [100 * s.memory_utilisation for s in result.snapshots], label=result.policy)
        middle.plot(steps, [100 * s.fragmentation for s in result.snapshots], label=result.policy)
        bottom.plot(steps, [s.pending for s in result.snapshots], label=result.policy)
    top.set_ylabel("GPU memory used (%)")
    middle.set_ylabel("free memory on shared GPUs (%)")
    bottom.set_ylabel("pods pending")
    bottom.set_xlabel("trace event")
    top.set_title("Tessera what-if replay")
    for axis in (top, middle, bottom):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
