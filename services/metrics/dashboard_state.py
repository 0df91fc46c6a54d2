"""The JSON the dashboard page polls (/api/state), computed from the view. Pure."""

from __future__ import annotations

from typing import Any

from tessera import mig
from tessera.device_kinds import registry
from tessera.gpuid import short_uuid

from .summary import MIB, GpuSummary, Slice, summarise
from .view import ClusterView

RECENT_ON_PAGE = 60


def _slice(piece: Slice) -> dict[str, Any]:
    return {
        "namespace": piece.namespace,
        "pod": piece.pod,
        "pod_uid": piece.pod_uid,
        "container": piece.container,
        "container_index": piece.container_index,
        "memory_mib": piece.memory_mib,
        "cores": piece.cores,
        "state": piece.state,
        "used_mib": round(piece.used_bytes / MIB, 1) if piece.used_bytes is not None else None,
        "sm_util": piece.sm_util,
        "sm_limit": piece.sm_limit,
        "breach": piece.breach,
        # elastic memory (docs/elastic.md): guaranteed = memory_mib; burst limit and borrowed
        "memory_limit_mib": piece.memory_limit_mib or None,
        "borrowed_mib": round(piece.borrowed_bytes / MIB, 1)
        if piece.memory_limit_mib and piece.borrowed_bytes is not None else None,
        # elastic compute: guaranteed = cores; burst limit and what is lent now beyond it
        "cores_limit": piece.cores_limit or None,
        "lent_pct": round(max(0.0, piece.sm_allowance - piece.cores), 1)
        if piece.cores_limit and piece.sm_allowance is not None else None,
    }


def mig_instances(gpu: GpuSummary) -> list[dict[str, Any]]:
    """The card's MIG instances with the pod holding each: static ones (migstrategy mixed) as
    the node registered them, dynamic ones from the ledger's grants."""
    out = [{"source": "static", "uuid": i.uuid, "profile": i.profile, "start": i.start,
            "size": i.size, "pod": i.pod, "container": "", "state": "created"}
           for i in gpu.device.mig_instances]
    out += [{"source": "dynamic", "uuid": s.mig.mig_uuid, "profile": s.mig.profile,
             "start": s.mig.start, "size": s.mig.size, "pod": f"{s.namespace}/{s.pod}",
             "container": s.container, "state": str(s.mig.state)}
            for s in gpu.slices if s.mig is not None]
    return sorted(out, key=lambda i: (i["start"], i["source"]))


def mps_clients(gpu: GpuSummary) -> list[dict[str, Any]]:
    """On a card in MPS mode, each container's own MPS server and the limits the node agent put
    on it (its grant: pinned device memory, and the cores as active thread %, 0 = 100 %)."""
    if gpu.device.mode != "mps":
        return []
    return [{"pod": f"{s.namespace}/{s.pod}", "container": s.container,
             "memory_mib": max(1, s.memory_mib),
             "thread_pct": min(s.cores, 100) if s.cores > 0 else 100, "state": s.state}
            for s in gpu.slices]


def _mig_slices(gpu: GpuSummary) -> int:
    model = mig.model_for(gpu.device.type)
    return model.memory_slices if model else 0


def _gpu(gpu: GpuSummary) -> dict[str, Any]:
    device = gpu.device
    family = registry.family_of_type(device.type)
    return {
        "device_word": family.device_word,  # "GPU", "NPU", "MLU", "DCU"
        "vendor": family.vendor,
        "uuid": device.uuid,
        "short_uuid": short_uuid(device.uuid),  # the CLI shows the same (tessera.gpuid)
        "index": device.index,
        "type": device.type,
        "memory_mib": device.memory_mib,
        "physical_memory_mib": gpu.physical_mib,
        "cores": device.cores,
        "split_count": device.split_count,
        "healthy": device.healthy,
        "mode": device.mode,
        "numa": device.numa,
        "allocated_mib": gpu.allocated_mib,
        "allocated_cores": gpu.allocated_cores,
        "shared": len(gpu.slices),
        "host_used_mib": round(gpu.host.used_bytes / MIB, 1) if gpu.host else None,
        "host_utilization": gpu.host.utilization if gpu.host else None,
        "slices": [_slice(s) for s in gpu.slices],
        "mig_slices": _mig_slices(gpu),  # memory slices of the card (placement positions)
        "mig_instances": mig_instances(gpu),
        "mps_clients": mps_clients(gpu),
    }


def dashboard_state(view: ClusterView, now: float) -> dict[str, Any]:
    nodes = summarise(view, now)
    gpus = [gpu for node in nodes for gpu in node.gpus]
    pending = view.pending_pods(now)
    total_mib = sum(g.device.memory_mib for g in gpus)
    allocated_mib = sum(g.allocated_mib for g in gpus)
    return {
        "now": now,
        "synced": view.synced,
        "totals": {
            "nodes": sum(1 for n in nodes if n.registered),
            "gpus": len(gpus),
            "unhealthy_gpus": sum(1 for g in gpus if not g.device.healthy),
            "memory_mib": total_mib,
            "allocated_mib": allocated_mib,
            "cores": sum(g.device.cores for g in gpus),
            "allocated_cores": sum(g.allocated_cores for g in gpus),
            "pods": len({s.pod_uid for g in gpus for s in g.slices}),
            "pending": len(pending),
            "ooms": sum(view.ooms.values()),
            "limit_breaches": sum(view.limit_breaches.values()),
            "bad_messages": sum(view.bad_messages.values()),
        },
        "nodes": [
            {
                "name": node.name,
                "registered": node.registered,
                "heartbeat_age_s": (
                    round(max(0.0, now - node.heartbeat_at), 1) if node.heartbeat_at else None
                ),
                "gpus": [_gpu(g) for g in node.gpus],
                "orphans": [dict(_slice(s), uuid=uuid) for uuid, s in node.orphan_slices],
            }
            for node in nodes
        ],
        "pending": [
            {
                "namespace": pod.namespace,
                "name": pod.name,
                "pod_uid": pod.pod_uid,
                "since": pod.since,
                "waiting_s": round(max(0.0, now - pod.since), 1),
                "attempts": pod.attempts,
                "summary": pod.summary,
                "node_reasons": dict(sorted(pod.node_reasons.items())),
            }
            for pod in pending
        ],
        "quotas": [
            {
                "namespace": ns,
                "limits": state.limits.model_dump(),
                "used": state.used().model_dump(),
            }
            for ns, state in sorted(view.quotas.items())
        ],
        "events": [
            {
                "at": e.at,
                "kind": e.kind,
                "action": e.action,
                "scope": e.scope,
                "text": e.text,
                "reason": e.reason,
                "severity": e.severity,
            }
            for e in reversed(list(view.recent)[-RECENT_ON_PAGE:])
        ],
    }
