"""kube-controller-manager's device taint eviction controller (KEP-5055), for kube-sim.

A device of an allocated claim that gets a `NoExecute` taint its allocation does not tolerate
(the tolerations were copied into the allocation result) evicts every pod the claim is
reserved for: a `DisruptionTarget` condition (`DeletionByDeviceTaintManager`, "Device Taint
manager: deleting due to NoExecute taint"), a `DeviceTaintManagerEviction` event
("Marking for deletion") and the pod's deletion; the claim is then released and deallocated as
for any deleted pod. A toleration with `tolerationSeconds` defers the eviction to the taint's
`timeAdded` plus those seconds; one without tolerates forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from tessera.kube_sim.dra.allocator import tolerates
from tessera.kube_sim.dra.model import newest_slices
from tessera.kube_sim.dra.taint_rules import taints_for
from tessera.kube_sim.events import record_event
from tessera.kube_sim.store import KubeObject, ObjectStore, Selector, StoreError, now_rfc3339

log = logging.getLogger("tessera.kube_sim.dra.eviction")

TICK_S = 0.25


def _time(stamp: Any) -> datetime | None:
    try:
        return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def eviction_time(taint: dict[str, Any], tolerations: list[dict[str, Any]],
                  now: datetime) -> datetime | None:
    """When a pod using a device with this NoExecute taint must go (None: never)."""
    matching = [t for t in tolerations if tolerates([t], taint)]
    if not matching:
        return now
    if any(t.get("tolerationSeconds") is None for t in matching):
        return None
    seconds = min(max(0, int(t["tolerationSeconds"])) for t in matching)
    added = _time(taint.get("timeAdded")) or now
    return added + timedelta(seconds=seconds)


class DeviceTaintEviction:
    def __init__(self, store: ObjectStore, delete_pod: Callable[[str, str, str], Any],
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.store = store
        self.delete_pod = delete_pod  # (namespace, name, uid): the API's DELETE
        self.now = now
        # the NoExecute taints of the slices, re-read only when a slice changed
        self._slice_changes = 0
        self._read_at = -1
        self._taints: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        store.listeners.append(self._changed)

    def _changed(self, kind: str) -> None:
        if kind in ("ResourceSlice", "DeviceTaintRule"):
            self._slice_changes += 1

    def _no_execute_taints(self) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
        if self._read_at == self._slice_changes:
            return self._taints
        self._read_at = self._slice_changes
        taints: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        rules = self.store.list("DeviceTaintRule", Selector())  # an admin's (taint_rules.py)
        for item in newest_slices(self.store.list("ResourceSlice", Selector())):
            spec = item.get("spec") or {}
            for device in spec.get("devices") or []:
                key = (spec.get("driver", ""), (spec.get("pool") or {}).get("name", ""),
                       device.get("name", ""))
                added = taints_for(rules, *key) if rules else []
                found = [t for t in [*(device.get("taints") or []), *added]
                         if isinstance(t, dict) and t.get("effect") == "NoExecute"]
                if found:
                    taints[key] = found
        self._taints = taints
        return taints

    def due(self) -> list[tuple[str, str, str]]:
        """The pods (namespace, name, uid) whose claims' devices must evict them now."""
        taints = self._no_execute_taints()
        if not taints:
            return []
        now = self.now()
        evict: list[tuple[str, str, str]] = []
        for claim in self.store.list("ResourceClaim", Selector()):
            status = claim.get("status") or {}
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results")
            if not results or not status.get("reservedFor"):
                continue
            if not any(self._must_go(r, taints, now) for r in results):
                continue
            namespace = claim["metadata"].get("namespace", "")
            evict += [(namespace, r.get("name", ""), r.get("uid", ""))
                      for r in status["reservedFor"] if r.get("resource") == "pods"]
        return evict

    @staticmethod
    def _must_go(result: dict[str, Any], taints: dict[tuple[str, str, str], list[Any]],
                 now: datetime) -> bool:
        if result.get("adminAccess"):
            return False
        key = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        for taint in taints.get(key, []):
            when = eviction_time(taint, result.get("tolerations") or [], now)
            if when is not None and when <= now:
                return True
        return False

    def evict(self, namespace: str, name: str, uid: str) -> None:
        try:
            pod = self.store.get("Pod", namespace, name)
        except StoreError:
            return
        if pod["metadata"].get("uid") != uid:
            return

        def mark(obj: KubeObject) -> None:
            status = obj.setdefault("status", {})
            kept = [c for c in status.get("conditions") or []
                    if c.get("type") != "DisruptionTarget"]
            kept.append({"type": "DisruptionTarget", "status": "True",
                         "reason": "DeletionByDeviceTaintManager",
                         "message": "Device Taint manager: deleting due to NoExecute taint",
                         "lastTransitionTime": now_rfc3339()})
            status["conditions"] = kept

        with contextlib.suppress(StoreError):
            self.store.mutate("Pod", namespace, name, mark)
        record_event(self.store, pod, "DeviceTaintManagerEviction", "Marking for deletion",
                     "Normal", component="device-taint-eviction-controller")
        log.info("evicting pod for a NoExecute device taint",
                 extra={"pod": f"{namespace}/{name}"})
        with contextlib.suppress(StoreError):
            self.delete_pod(namespace, name, uid)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                for namespace, name, uid in self.due():
                    self.evict(namespace, name, uid)
            except Exception:  # a bad object must not stop the controller
                log.exception("device taint eviction pass failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await stop.wait()
