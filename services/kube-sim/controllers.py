"""The workload controllers of kube-controller-manager, for kube-sim: Deployment, ReplicaSet, Job.

They watch the store and converge, one reconcile pass at a time, as the real controllers do:
- **ReplicaSet**: keeps `spec.replicas` active pods that it controls (ownerReferences with
  `controller: true`), made from its template with `generateName: <rs>-`; surplus pods go
  unscheduled first, then pending, then not ready, then newest. Status: replicas,
  readyReplicas, availableReplicas, fullyLabeledReplicas, observedGeneration.
- **Deployment**: one ReplicaSet per pod template, named `<deployment>-<pod-template-hash>` and
  labelled with that hash; the current template's ReplicaSet is scaled to `spec.replicas` and
  every older one to 0 at the same time (a template change rolls as a *recreate*: kube-sim
  ignores maxSurge/maxUnavailable), keeping `revisionHistoryLimit` old ones. Status and the
  Available/Progressing conditions are what `kubectl rollout status` reads.
- **Job**: runs up to `parallelism` pods at once until `completions` pods Succeeded (without
  `completions`: until one succeeds and none is left running), fails once more than
  `backoffLimit` pods Failed (condition Failed, reason BackoffLimitExceeded); `suspend` stops
  its pods. Indexed completion mode is not modelled.

Pods are created through the API server's create path, so they pass the admission webhook as on
a real cluster; a refused create is a `FailedCreate` event on the owner and is retried with
backoff. Deleting an owner takes its dependents with it (`ApiServer.delete_object`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tessera.kube_sim import quota_usage
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.events import record_event
from tessera.kube_sim.selectors import from_label_selector, labels_match
from tessera.kube_sim.store import KubeObject, Selector, StoreError, now_rfc3339

from tessera.cancelling import cancel_and_wait

log = logging.getLogger("tessera.kube_sim.controllers")

HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the characters Kubernetes uses in names
TERMINAL = ("Succeeded", "Failed")
MAX_BURST = 500  # pods one owner creates or deletes per pass (the real controllers' burst)
REVISION = "deployment.kubernetes.io/revision"
FOLLOWED = ("Deployment", "ReplicaSet", "Job", "Pod", "ResourceQuota", "ResourceClaim")


def normalized(value: Any) -> Any:
    """A template as its meaning: empty and null fields dropped (`resources: {}` that a typed
    client writes is no change), the pod-template-hash label left out."""
    if isinstance(value, dict):
        kept = {k: normalized(v) for k, v in value.items() if k != "pod-template-hash"}
        return {k: v for k, v in kept.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def template_hash(template: dict[str, Any]) -> str:
    """The pod-template-hash: equal for templates that mean the same (as
    kube-controller-manager's EqualIgnoreHash), so a rollback finds its old ReplicaSet."""
    text = json.dumps(normalized(template), sort_keys=True)
    digest = hashlib.sha256(text.encode()).digest()
    return "".join(HASH_ALPHABET[b % len(HASH_ALPHABET)] for b in digest[:10])


def controller_uid(obj: KubeObject) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def owner_ref(owner: KubeObject) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pod_ready(pod: KubeObject) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def active(pod: KubeObject) -> bool:
    return (pod.get("status") or {}).get("phase") not in TERMINAL and not pod["metadata"].get(
        "deletionTimestamp"
    )


def deletion_order(pods: list[KubeObject]) -> list[KubeObject]:
    """Which surplus pods go first: unscheduled, pending, not ready, then the newest."""
    newest_first = sorted(
        pods, key=lambda p: p["metadata"].get("creationTimestamp", ""), reverse=True
    )

    def rank(pod: KubeObject) -> tuple[int, int, int]:
        status = pod.get("status") or {}
        return (
            0 if not (pod.get("spec") or {}).get("nodeName") else 1,
            0 if status.get("phase") == "Pending" else 1,
            0 if not pod_ready(pod) else 1,
        )

    return sorted(newest_first, key=rank)  # stable: the newest first within a rank


def pod_from_template(owner: KubeObject, template: dict[str, Any]) -> KubeObject:
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{owner['metadata']['name']}-",
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [owner_ref(owner)],
        },
        "spec": copy.deepcopy(template.get("spec") or {}),
    }


@dataclass
class Backoff:
    """Per owner: when creating pods may be tried again after a refused create."""

    delays: dict[str, float] = field(default_factory=dict)
    ready_at: dict[str, float] = field(default_factory=dict)

    def blocked(self, uid: str, now: float) -> bool:
        return self.ready_at.get(uid, 0.0) > now

    def failed(self, uid: str, now: float) -> None:
        delay = min(30.0, self.delays.get(uid, 0.5) * 2)
        self.delays[uid] = delay
        self.ready_at[uid] = now + delay

    def succeeded(self, uid: str) -> None:
        self.delays.pop(uid, None)
        self.ready_at.pop(uid, None)


class WorkloadControllers:
    def __init__(
        self,
        api: ApiServer,
        clock: Callable[[], float] = time.monotonic,
        stamp: Callable[[], str] = now_rfc3339,
    ) -> None:
        self.api = api
        self.store = api.store
        self.clock = clock
        self.stamp = stamp
        self.backoff = Backoff()
        self._dirty = asyncio.Event()

    # --- loop ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        # A change to any kind they follow wakes a pass (no copies: the store calls back).
        self.store.listeners.append(self._changed)
        tasks = [asyncio.create_task(self._reconcile_forever()),
                 asyncio.create_task(self._retry_refused())]
        self._dirty.set()
        try:
            await stop.wait()
        finally:
            self.store.listeners.remove(self._changed)
            await cancel_and_wait(tasks)  # (a cancel Python 3.11's wait_for drops is sent again)

    def _changed(self, kind: str) -> None:
        if kind in FOLLOWED:
            self._dirty.set()

    async def _retry_refused(self) -> None:
        """Every second while an owner backs off a refused create: a pass to retry it."""
        while True:
            await asyncio.sleep(1.0)
            if self.backoff.ready_at:
                self._dirty.set()

    async def _reconcile_forever(self) -> None:
        while True:
            await self._dirty.wait()  # a change, or a retry due
            self._dirty.clear()
            await asyncio.sleep(0.01)  # coalesce a burst of changes into one pass
            try:
                await self.reconcile()
            except Exception:  # one bad object must not stop the controllers
                log.exception("reconcile pass failed")

    async def reconcile(self) -> None:
        """One pass over every workload (a no-op when there is none), and quotas' usage."""
        self.sync_quotas()
        deployments = self.store.list("Deployment", Selector())
        for deployment in deployments:
            await self.sync_deployment(deployment)
        replicasets = self.store.list("ReplicaSet", Selector())
        jobs = self.store.list("Job", Selector())
        if not replicasets and not jobs:
            return
        pods_by_owner: dict[str, list[KubeObject]] = {}
        for pod in self.store.list("Pod", Selector()):
            uid = controller_uid(pod)
            if uid:
                pods_by_owner.setdefault(uid, []).append(pod)
        for rs in replicasets:
            await self.sync_replicaset(rs, pods_by_owner.get(rs["metadata"]["uid"], []))
        for job in jobs:
            await self.sync_job(job, pods_by_owner.get(job["metadata"]["uid"], []))

    def sync_quotas(self) -> None:
        """The resource quota controller: `status.used` of every ResourceQuota (quota_usage)."""
        for quota in self.store.list("ResourceQuota", Selector()):
            namespace, name = quota["metadata"]["namespace"], quota["metadata"]["name"]
            pods = self.store.list("Pod", Selector(namespace=namespace))
            claims = self.store.list("ResourceClaim", Selector(namespace=namespace))
            classes = self.store.list("DeviceClass", Selector()) if claims else []
            used = quota_usage.usage(quota, pods, claims, classes)

            def apply(current: KubeObject, used: dict[str, str] = used) -> None:
                status = current.setdefault("status", {})
                status["hard"] = dict((current.get("spec") or {}).get("hard") or {})
                kept = status.get("used") or {}  # written meanwhile by someone else: kept
                status["used"] = {k: v for k, v in used.items() if quota_usage.evaluated(k)} | {
                    k: kept[k] for k in status["hard"]
                    if k in kept and not quota_usage.evaluated(k)}

            with contextlib.suppress(StoreError):
                self.store.mutate("ResourceQuota", namespace, name, apply)

    # --- pods ----------------------------------------------------------------------------------

    async def _create_pods(
        self, owner: KubeObject, template: dict[str, Any], count: int, component: str
    ) -> None:
        uid = owner["metadata"]["uid"]
        if count <= 0 or self.backoff.blocked(uid, self.clock()):
            return
        namespace = owner["metadata"]["namespace"]
        for _ in range(min(count, MAX_BURST)):
            try:
                pod = await self.api.create_object(
                    "Pod", namespace, pod_from_template(owner, template)
                )
            except StoreError as error:
                self.backoff.failed(uid, self.clock())
                record_event(self.store, owner, "FailedCreate",
                             f"Error creating: {error.message}", "Warning", component=component)
                return
            self.backoff.succeeded(uid)
            record_event(self.store, owner, "SuccessfulCreate",
                         f"Created pod: {pod['metadata']['name']}", component=component)

    def _delete_pods(self, owner: KubeObject, pods: list[KubeObject], component: str) -> None:
        for pod in pods[:MAX_BURST]:
            meta = pod["metadata"]
            with contextlib.suppress(StoreError):
                self.api.delete_object("Pod", meta["namespace"], meta["name"], meta.get("uid"))
                record_event(self.store, owner, "SuccessfulDelete",
                             f"Deleted pod: {meta['name']}", component=component)

    def _set_status(self, kind: str, obj: KubeObject, status: dict[str, Any]) -> None:
        def apply(current: KubeObject) -> None:
            current["status"] = status

        with contextlib.suppress(StoreError):
            self.store.mutate(kind, obj["metadata"]["namespace"], obj["metadata"]["name"], apply)

    # --- ReplicaSet ----------------------------------------------------------------------------

    async def sync_replicaset(self, rs: KubeObject, owned: list[KubeObject]) -> None:
        spec = rs.get("spec") or {}
        running = [p for p in owned if active(p)]
        wanted = int(spec.get("replicas", 1))
        component = "replicaset-controller"
        if len(running) < wanted:
            await self._create_pods(rs, spec.get("template") or {}, wanted - len(running),
                                    component)
        elif len(running) > wanted:
            surplus = deletion_order(running)[: len(running) - wanted]
            self._delete_pods(rs, surplus, component)
        owned = [
            p for p in self.store.list("Pod", Selector(namespace=rs["metadata"]["namespace"]))
            if controller_uid(p) == rs["metadata"]["uid"] and active(p)
        ]
        requirements = from_label_selector(spec.get("selector"))
        ready = sum(1 for p in owned if pod_ready(p))
        status = {
            "replicas": len(owned),
            "fullyLabeledReplicas": sum(
                1 for p in owned if labels_match(requirements, p["metadata"].get("labels"))
            ),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": rs["metadata"].get("generation", 1),
        }
        self._set_status("ReplicaSet", rs, status)

    # --- Deployment ----------------------------------------------------------------------------

    async def sync_deployment(self, deployment: KubeObject) -> None:
        meta, spec = deployment["metadata"], deployment.get("spec") or {}
        namespace, uid = meta["namespace"], meta["uid"]
        template = copy.deepcopy(spec.get("template") or {})
        digest = template_hash(template)
        owned = [
            rs for rs in self.store.list("ReplicaSet", Selector(namespace=namespace))
            if controller_uid(rs) == uid
        ]
        current = next(
            (rs for rs in owned
             if template_hash((rs.get("spec") or {}).get("template") or {}) == digest),
            None,
        )
        old = [rs for rs in owned if rs is not current]
        wanted = int(spec.get("replicas", 1))
        revisions = [int((rs["metadata"].get("annotations") or {}).get(REVISION, "0") or 0)
                     for rs in owned]
        if spec.get("paused"):
            return
        if current is None:
            current = await self._new_replicaset(deployment, template, digest,
                                                 max(revisions, default=0) + 1)
            if current is None:
                return
        else:
            self._mark_revision(deployment, current, max(revisions, default=0))
            if current["spec"].get("replicas") != wanted:
                self._scale(deployment, current, wanted)
        for rs in old:
            if rs["spec"].get("replicas", 0) != 0:
                self._scale(deployment, rs, 0)
        self._prune_history(deployment, old)
        self._deployment_status(deployment, current)

    async def _new_replicaset(
        self, deployment: KubeObject, template: dict[str, Any], digest: str, revision: int
    ) -> KubeObject | None:
        meta, spec = deployment["metadata"], deployment["spec"]
        labels = {**((template.get("metadata") or {}).get("labels") or {}),
                  "pod-template-hash": digest}
        template.setdefault("metadata", {})["labels"] = labels
        selector = copy.deepcopy(spec.get("selector") or {})
        selector.setdefault("matchLabels", {})["pod-template-hash"] = digest
        wanted = int(spec.get("replicas", 1))
        rs = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{meta['name']}-{digest}",
                "labels": labels,
                "annotations": {REVISION: str(revision),
                                "deployment.kubernetes.io/desired-replicas": str(wanted)},
                "ownerReferences": [owner_ref(deployment)],
            },
            "spec": {"replicas": wanted, "selector": selector, "template": template},
        }
        try:
            created = await self.api.create_object("ReplicaSet", meta["namespace"], rs)
        except StoreError as error:
            record_event(self.store, deployment, "FailedCreate", error.message, "Warning",
                         component="deployment-controller")
            return None
        record_event(self.store, deployment, "ScalingReplicaSet",
                     f"Scaled up replica set {created['metadata']['name']} from 0 to {wanted}",
                     component="deployment-controller")

        def annotate(obj: KubeObject) -> None:
            obj["metadata"].setdefault("annotations", {})[REVISION] = str(revision)

        with contextlib.suppress(StoreError):
            self.store.mutate("Deployment", meta["namespace"], meta["name"], annotate)
        return created

    def _mark_revision(self, deployment: KubeObject, rs: KubeObject, newest: int) -> None:
        """A rollback reuses the old template's ReplicaSet, which becomes the newest revision."""
        revision = int((rs["metadata"].get("annotations") or {}).get(REVISION, "0") or 0)
        shown = (deployment["metadata"].get("annotations") or {}).get(REVISION)
        if revision < newest:
            revision = newest + 1
        elif shown == str(revision):
            return

        def annotate(obj: KubeObject) -> None:
            obj["metadata"].setdefault("annotations", {})[REVISION] = str(revision)

        with contextlib.suppress(StoreError):
            self.store.mutate("ReplicaSet", rs["metadata"]["namespace"], rs["metadata"]["name"],
                              annotate)
            self.store.mutate("Deployment", deployment["metadata"]["namespace"],
                              deployment["metadata"]["name"], annotate)

    def _scale(self, deployment: KubeObject, rs: KubeObject, replicas: int) -> None:
        before = rs["spec"].get("replicas", 0)

        def apply(obj: KubeObject) -> None:
            obj["spec"]["replicas"] = replicas

        with contextlib.suppress(StoreError):
            self.store.mutate("ReplicaSet", rs["metadata"]["namespace"], rs["metadata"]["name"],
                              apply)
            direction = "up" if replicas > before else "down"
            record_event(
                self.store, deployment, "ScalingReplicaSet",
                f"Scaled {direction} replica set {rs['metadata']['name']} from {before} to "
                f"{replicas}",
                component="deployment-controller",
            )

    def _prune_history(self, deployment: KubeObject, old: list[KubeObject]) -> None:
        limit = int((deployment.get("spec") or {}).get("revisionHistoryLimit", 10))
        idle = [rs for rs in old if rs["spec"].get("replicas", 0) == 0
                and (rs.get("status") or {}).get("replicas", 0) == 0]
        idle.sort(key=lambda rs: int((rs["metadata"].get("annotations") or {}).get(REVISION, 0)))
        for rs in idle[: max(0, len(idle) - limit)]:
            with contextlib.suppress(StoreError):
                self.api.delete_object("ReplicaSet", rs["metadata"]["namespace"],
                                       rs["metadata"]["name"])

    def _deployment_status(self, deployment: KubeObject, current: KubeObject) -> None:
        meta = deployment["metadata"]
        owned = [
            rs for rs in self.store.list("ReplicaSet", Selector(namespace=meta["namespace"]))
            if controller_uid(rs) == meta["uid"]
        ]
        fresh = next((rs for rs in owned if rs["metadata"]["uid"] == current["metadata"]["uid"]),
                     current)

        def total(key: str) -> int:
            return sum(int((rs.get("status") or {}).get(key, 0)) for rs in owned)

        wanted = int(deployment["spec"].get("replicas", 1))
        available = total("availableReplicas")
        updated = int((fresh.get("status") or {}).get("replicas", 0))
        previous = {c.get("type"): c for c in (deployment.get("status") or {}).get(
            "conditions") or []}

        def condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
            state = "True" if ok else "False"
            before = previous.get(kind) or {}
            changed = before.get("status") != state
            stamp = self.stamp() if changed else before.get("lastTransitionTime", self.stamp())
            return {"type": kind, "status": state, "reason": reason, "message": message,
                    "lastUpdateTime": stamp if changed or before.get("reason") != reason
                    else before.get("lastUpdateTime", stamp),
                    "lastTransitionTime": stamp}

        name = fresh["metadata"]["name"]
        done = updated == wanted and available >= wanted and total("replicas") == wanted
        conditions = [
            condition("Available", available >= wanted,
                      "MinimumReplicasAvailable" if available >= wanted
                      else "MinimumReplicasUnavailable",
                      "Deployment has minimum availability." if available >= wanted
                      else "Deployment does not have minimum availability."),
            condition("Progressing", True,
                      "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                      f'ReplicaSet "{name}" has successfully progressed.' if done
                      else f'ReplicaSet "{name}" is progressing.'),
        ]
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": total("replicas"),
            "updatedReplicas": updated,
            "readyReplicas": total("readyReplicas"),
            "availableReplicas": available,
            "conditions": conditions,
        }
        if wanted - available > 0:
            status["unavailableReplicas"] = wanted - available
        self._set_status("Deployment", deployment, status)

    # --- Job -----------------------------------------------------------------------------------

    async def sync_job(self, job: KubeObject, owned: list[KubeObject]) -> None:
        spec = job.get("spec") or {}
        status = copy.deepcopy(job.get("status") or {})
        component = "job-controller"
        finished = any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                       for c in status.get("conditions") or [])
        running = [p for p in owned if active(p)]
        succeeded = sum(1 for p in owned if (p.get("status") or {}).get("phase") == "Succeeded")
        failed = sum(1 for p in owned if (p.get("status") or {}).get("phase") == "Failed")
        if finished:
            if running:
                self._delete_pods(job, running, component)
            return
        status.setdefault("startTime", self.stamp())
        parallelism = int(spec.get("parallelism", 1))
        completions = spec.get("completions")
        conditions = list(status.get("conditions") or [])
        if failed > int(spec.get("backoffLimit", 6)):
            self._delete_pods(job, running, component)
            running = []
            conditions.append(self._job_condition("Failed", "BackoffLimitExceeded",
                                                  "Job has reached the specified backoff limit"))
            record_event(self.store, job, "BackoffLimitExceeded",
                         "Job has reached the specified backoff limit", "Warning",
                         component=component)
        elif (completions is not None and succeeded >= int(completions)) or (
            completions is None and succeeded > 0 and not running
        ):
            conditions.append(self._job_condition("Complete", "", ""))
            status["completionTime"] = self.stamp()
            record_event(self.store, job, "Completed", "Job completed", component=component)
        elif spec.get("suspend"):
            self._delete_pods(job, running, component)
            running = []
        else:
            if completions is not None:
                want = min(parallelism, int(completions) - succeeded)
            else:
                want = len(running) if succeeded > 0 else parallelism
            if len(running) < want:
                await self._create_pods(job, spec.get("template") or {}, want - len(running),
                                        component)
            elif len(running) > want:
                surplus = deletion_order(running)[: len(running) - want]
                self._delete_pods(job, surplus, component)
            running = [
                p for p in self.store.list("Pod", Selector(namespace=job["metadata"]["namespace"]))
                if controller_uid(p) == job["metadata"]["uid"] and active(p)
            ]
        status.update(
            active=len(running),
            succeeded=succeeded,
            failed=failed,
            ready=sum(1 for p in running if pod_ready(p)),
            conditions=conditions,
        )
        if not conditions:
            del status["conditions"]
        self._set_status("Job", job, status)

    def _job_condition(self, kind: str, reason: str, message: str) -> dict[str, Any]:
        stamp = self.stamp()
        condition = {"type": kind, "status": "True", "lastProbeTime": stamp,
                     "lastTransitionTime": stamp}
        if reason:
            condition.update(reason=reason, message=message)
        return condition
