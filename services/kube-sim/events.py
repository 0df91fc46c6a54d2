"""core/v1 Events written by kube-sim's own parts (scheduler, kubelets), as Kubernetes does."""

from __future__ import annotations

import time

from tessera.kube_sim.store import KubeObject, ObjectStore, StoreError, now_rfc3339

EVENTS_KEPT = 5000


def record_event(
    store: ObjectStore,
    involved: KubeObject,
    reason: str,
    message: str,
    event_type: str = "Normal",
    component: str = "default-scheduler",
) -> None:
    meta = involved.get("metadata", {})
    namespace = meta.get("namespace") or "default"
    stamp = now_rfc3339()
    event = {
        "metadata": {"name": f"{meta.get('name', '')}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion", "v1"),
            "kind": involved.get("kind", "Pod"),
            "namespace": namespace,
            "name": meta.get("name", ""),
            "uid": meta.get("uid", ""),
        },
        "reason": reason,
        "message": message[:1024],
        "type": event_type,
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        store.create("Event", event)
    except StoreError:
        return
    store.trim("Event", EVENTS_KEPT)
