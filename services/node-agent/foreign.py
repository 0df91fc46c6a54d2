"""What pods placed by HAMi's scheduler hold on this node's cards while a cluster migrates from HAMi
(docs/migrating-from-hami.md): HAMi's pods that kept running on a node that switched to Tessera's
node agent. They are never in Tessera's ledger; the scheduler counts them from the cluster
(services/scheduler/README.md, "A cluster migrating from HAMi"), and so does the agent wherever it
judges whether a card has room for a grant that moves onto it (a crossed guess's trade).

A pod is HAMi's as the scheduler reads it: `spec.schedulerName` set and not Tessera's, carrying
HAMi's placement annotations. Only pods bound to this node count here: a HAMi pod only decided
for a migrated node never gets a GPU on it (the agent serves only Tessera's binds). Pure: the
caller lists the pods.
"""

from __future__ import annotations

from typing import Any

from tessera import hami
from tessera.device_kinds import pod_grants
from tessera.models import Allocation, AllocationState
from tessera.restore import FINISHED_PHASES, init_containers_succeeded
from tessera.settings import TesseraSettings

from .limits import pod_usage_on

_HAMI_KEYS = (hami.ANN_DEVICES_ALLOCATED, hami.ANN_DEVICES_TO_ALLOCATE, hami.ANN_VGPU_NODE)


class ForeignUnknownError(Exception):
    """A HAMi pod on the node whose holdings cannot be read: nothing may move onto any card."""


def hami_held(
    pods: list[dict[str, Any]], node: str, settings: TesseraSettings
) -> dict[str, tuple[int, int]]:
    """GPU uuid -> (MiB, cores) HAMi's pods bound to `node` hold there (init containers' peak
    vs app containers' sum, HAMi's rule). ForeignUnknownError when one cannot be read."""
    held: dict[str, tuple[int, int]] = {}
    for pod in pods:
        allocation = _hami_allocation(pod, node, settings)
        if allocation is None:
            continue
        for uuid in {g.uuid for c in allocation.containers for g in c}:
            mem, cores = pod_usage_on(allocation, uuid)
            old_mem, old_cores = held.get(uuid, (0, 0))
            held[uuid] = (old_mem + mem, old_cores + cores)
    return held


def _hami_allocation(
    pod: dict[str, Any], node: str, settings: TesseraSettings
) -> Allocation | None:
    meta, spec = pod.get("metadata"), pod.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return None
    annotations = meta.get("annotations") or {}
    scheduler = spec.get("schedulerName")
    if not isinstance(annotations, dict) or not scheduler or scheduler == settings.scheduler_name:
        return None
    if not any(key in annotations for key in _HAMI_KEYS) or spec.get("nodeName") != node:
        return None
    status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
    if status.get("phase") in FINISHED_PHASES:
        return None
    ref = f"{meta.get('namespace')}/{meta.get('name')}"
    try:
        init = spec.get("initContainers") or []
        app = spec.get("containers") or []
        if not isinstance(init, list) or not isinstance(app, list):
            raise ValueError("containers must be lists")
        if not hami.asks_gpu([*init, *app], settings):
            return None  # kubelet gives it no GPU, whatever its annotations say
        grants = pod_grants.placed_grants(annotations, len(init) + len(app))
        if not any(grants):
            raise ValueError(f"it lists no device in {hami.ANN_DEVICES_ALLOCATED} or another "
                             "device family's hami.io/…-devices-allocated")
        grants = grants + [[] for _ in range(len(init) + len(app) - len(grants))]
        return Allocation(
            pod_uid=str(meta.get("uid") or ref), namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""), node=node, containers=grants,
            init_count=len(init), init_done=init_containers_succeeded(pod),
            sidecars=sorted(hami.sidecar_indices(init)), state=AllocationState.ALLOCATED,
            created_at=0.0, updated_at=0.0,
        )  # fmt: skip
    except (ValueError, TypeError, AttributeError, KeyError) as exc:  # hostile shapes too
        raise ForeignUnknownError(f"HAMi pod {ref[:160]}: {str(exc)[:300]}") from exc
