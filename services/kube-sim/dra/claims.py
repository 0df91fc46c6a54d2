"""kube-controller-manager's resourceclaim controller, for kube-sim.

- For each `pod.spec.resourceClaims[]` entry naming a `resourceClaimTemplateName`, one
  ResourceClaim is created from the template (`generateName: <pod>-<entry>-`, the template's
  labels and annotations, the annotation `resource.kubernetes.io/pod-claim-name: <entry>`, a
  controller ownerReference to the pod) and recorded in `pod.status.resourceClaimStatuses`
  (`{name: <entry>, resourceClaimName: <claim>}`); a missing template is retried and reported
  as a warning event on the pod. The claim is created as through the API: a create that the
  namespace's ResourceQuota refuses (dra/quota.py) is reported as a `FailedResourceClaimCreation`
  warning with the quota's sentence and retried when a claim of the namespace goes or a quota
  changes (the real controller retries with backoff); the pod pends meanwhile.
- When a pod is deleted or finishes, it leaves the `status.reservedFor` of every claim it used;
  a claim reserved for nobody is deallocated (`status.allocation` removed), and the claims the
  pod owns (generated from templates, or the scheduler's extended-resource claim) are deleted
  with it, as the garbage collector does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from tessera.kube_sim.events import record_event
from tessera.kube_sim.store import KubeObject, ObjectStore, Selector, StoreError

log = logging.getLogger("tessera.kube_sim.dra.claims")

POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
EXTENDED_CLAIM = "resource.kubernetes.io/extended-resource-claim"
MAX_GENERATE_NAME = 57  # what leaves room for the five random characters in 63


def generate_name(pod_name: str, entry: str) -> str:
    """`<pod>-<entry>-`, each part shortened to fit as the controller does."""
    name = f"{pod_name}-{entry}"
    if len(name) > MAX_GENERATE_NAME - 1:
        name = f"{pod_name[:28]}-{entry[:28]}"
    return f"{name}-"


def owner_reference(pod: KubeObject) -> dict[str, Any]:
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta.get("uid", ""),
            "controller": True, "blockOwnerDeletion": True}


def owned_by(claim: KubeObject, pod_uid: str) -> bool:
    return any(r.get("uid") == pod_uid and r.get("controller")
               for r in (claim.get("metadata") or {}).get("ownerReferences") or [])


def pod_claim_names(pod: KubeObject) -> dict[str, str | None]:
    """pod claim entry → the ResourceClaim's name (None: from a template, not created yet)."""
    statuses = {s.get("name"): s.get("resourceClaimName")
                for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    found: dict[str, str | None] = {}
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = entry.get("name", "")
        if entry.get("resourceClaimName"):
            found[name] = entry["resourceClaimName"]
        else:
            found[name] = statuses.get(name)
    return found


def all_claim_names(pod: KubeObject) -> list[str]:
    """Every ResourceClaim the pod uses (known so far), its extended-resource claim included."""
    names = [n for n in pod_claim_names(pod).values() if n]
    extended = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get(
        "resourceClaimName")
    if extended:
        names.append(extended)
    return names


def terminal(pod: KubeObject) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class ClaimController:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        # Nodes whose kubelet releases a deleted pod's claims itself, once it unprepared them
        # (kube-apiserver removes a pod only after its kubelet stopped it; kube-sim's DELETE is
        # at once, so the device must not go to another claim before the driver let go of it).
        self.kubelet_nodes: set[str] = set()
        self._warned: set[tuple[str, str]] = set()  # (pod uid, entry): missing template told
        self._refused: dict[tuple[str, str], str] = {}  # (pod uid, entry) -> the quota's words

    async def run(self, stop: asyncio.Event) -> None:
        pods = self.store.watch("Pod", Selector(), self.store.version)
        templates = self.store.watch("ResourceClaimTemplate", Selector(), self.store.version)
        quota = [self.store.watch(kind, Selector(), self.store.version, copies=False)
                 for kind in ("ResourceQuota", "ResourceClaim")]  # read only: no copies
        for pod in self.store.list("Pod", Selector()):
            self.sync_pod(pod)
        tasks = [asyncio.create_task(self._follow_pods(pods.queue)),
                 asyncio.create_task(self._follow_templates(templates.queue)),
                 asyncio.create_task(self._retry_refused(quota[0].queue, every=True)),
                 asyncio.create_task(self._retry_refused(quota[1].queue, every=False))]
        try:
            await stop.wait()
        finally:
            self.store.unwatch(pods)
            self.store.unwatch(templates)
            for watcher in quota:
                self.store.unwatch(watcher)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _follow_pods(self, queue: asyncio.Queue[tuple[str, KubeObject]]) -> None:
        while True:
            event_type, pod = await queue.get()
            try:
                if event_type == "DELETED":
                    self.pod_gone(pod)
                else:
                    self.sync_pod(pod)
            except Exception:  # one bad pod must not stop the controller
                log.exception("claim sync failed", extra={"pod": pod["metadata"].get("name")})

    async def _follow_templates(self, queue: asyncio.Queue[tuple[str, KubeObject]]) -> None:
        while True:
            event_type, template = await queue.get()
            if event_type != "ADDED":
                continue
            namespace = template["metadata"].get("namespace", "")
            for pod in self.store.list("Pod", Selector(namespace=namespace)):
                self.sync_pod(pod)

    async def _retry_refused(self, queue: asyncio.Queue[tuple[str, KubeObject]],
                             every: bool) -> None:
        """A quota changed (`every` event) or a claim went (DELETED): the pods whose claim the
        quota refused, again."""
        while True:
            event_type, obj = await queue.get()
            if not self._refused or not (every or event_type == "DELETED"):
                continue
            namespace = obj["metadata"].get("namespace", "")
            waiting = {uid for uid, _ in self._refused}
            for pod in self.store.list("Pod", Selector(namespace=namespace)):
                if pod["metadata"].get("uid") in waiting:
                    try:
                        self.sync_pod(pod)
                    except Exception:  # one bad pod must not stop the retries
                        log.exception("claim retry failed")

    # --- a pod that lives ------------------------------------------------------------------------

    def sync_pod(self, pod: KubeObject) -> None:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            return
        if terminal(pod):
            if (pod.get("spec") or {}).get("nodeName") not in self.kubelet_nodes:
                self.release(pod)  # else its kubelet releases it once it unprepared the claims
            return
        statuses = list((pod.get("status") or {}).get("resourceClaimStatuses") or [])
        recorded = {s.get("name") for s in statuses}
        added = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            template_name = entry.get("resourceClaimTemplateName")
            if not template_name or entry.get("name") in recorded:
                continue
            claim = self._existing_claim(pod, entry["name"]) or self._create_claim(
                pod, entry["name"], template_name)
            if claim is not None:
                added.append({"name": entry["name"],
                              "resourceClaimName": claim["metadata"]["name"]})
        if added:
            self._record_statuses(pod, added)

    def _existing_claim(self, pod: KubeObject, entry: str) -> KubeObject | None:
        """A claim created for this entry before (its status write lost): adopt it."""
        namespace = pod["metadata"].get("namespace", "")
        for claim in self.store.list("ResourceClaim", Selector(namespace=namespace)):
            annotations = (claim.get("metadata") or {}).get("annotations") or {}
            if owned_by(claim, pod["metadata"].get("uid", "")) and annotations.get(
                    POD_CLAIM_NAME) == entry:
                return claim
        return None

    def _create_claim(self, pod: KubeObject, entry: str, template_name: str) -> KubeObject | None:
        namespace = pod["metadata"].get("namespace", "")
        try:
            template = self.store.get("ResourceClaimTemplate", namespace, template_name)
        except StoreError:
            warned = (pod["metadata"].get("uid", ""), entry)
            if warned in self._warned:
                return None
            if len(self._warned) > 10_000:
                self._warned.clear()
            self._warned.add(warned)
            record_event(self.store, pod, "FailedResourceClaimCreation",
                         f'PodResourceClaim {entry}: resource claim template "{template_name}":'
                         f' resourceclaimtemplate.resource.k8s.io "{template_name}" not found',
                         "Warning", component="resource_claim")
            return None
        template_meta = (template.get("spec") or {}).get("metadata") or {}
        claim = {
            "metadata": {
                "generateName": generate_name(pod["metadata"]["name"], entry),
                "namespace": namespace,
                "labels": dict(template_meta.get("labels") or {}),
                "annotations": {**(template_meta.get("annotations") or {}),
                                POD_CLAIM_NAME: entry},
                "ownerReferences": [owner_reference(pod)],
            },
            "spec": (template.get("spec") or {}).get("spec") or {},
            "status": {},
        }
        from tessera.kube_sim.dra.quota import admit_claim  # (it reads EXTENDED_CLAIM here)

        refused = (pod["metadata"].get("uid", ""), entry)
        try:
            admit_claim(self.store, claim)  # through the API upstream: quota admission applies
        except StoreError as error:
            if self._refused.get(refused) != error.message:  # told once per sentence
                record_event(self.store, pod, "FailedResourceClaimCreation",
                             f"PodResourceClaim {entry}: create ResourceClaim "
                             f"{claim['metadata']['generateName']}: {error.message}",
                             "Warning", component="resource_claim")
            if len(self._refused) > 10_000:
                self._refused.clear()
            self._refused[refused] = error.message
            return None
        self._refused.pop(refused, None)
        created = self.store.create("ResourceClaim", claim)
        log.info("claim created", extra={"pod": pod["metadata"]["name"],
                                         "claim": created["metadata"]["name"]})
        return created

    def _record_statuses(self, pod: KubeObject, added: list[dict[str, str]]) -> None:
        uid = pod["metadata"].get("uid")

        def record(obj: KubeObject) -> None:
            if obj["metadata"].get("uid") != uid:
                raise StoreError(409, "Conflict", "the pod was replaced")
            status = obj.setdefault("status", {})
            kept = [s for s in status.get("resourceClaimStatuses") or []
                    if s.get("name") not in {a["name"] for a in added}]
            status["resourceClaimStatuses"] = kept + added

        with contextlib.suppress(StoreError):
            self.store.mutate("Pod", pod["metadata"].get("namespace", ""),
                              pod["metadata"]["name"], record)

    # --- a pod that is gone or done --------------------------------------------------------------

    def pod_gone(self, pod: KubeObject) -> None:
        uid = pod["metadata"].get("uid", "")
        for key in [k for k in self._refused if k[0] == uid]:
            del self._refused[key]
        if (pod.get("spec") or {}).get("nodeName") not in self.kubelet_nodes:
            self.release(pod)

    def release(self, pod: KubeObject) -> None:
        """The pod leaves every claim's reservedFor; claims it owns go; unused ones deallocate."""
        namespace = pod["metadata"].get("namespace", "")
        uid = pod["metadata"].get("uid", "")
        for claim in self.store.list("ResourceClaim", Selector(namespace=namespace)):
            name = claim["metadata"]["name"]
            if owned_by(claim, uid):
                with contextlib.suppress(StoreError):
                    self.store.delete("ResourceClaim", namespace, name)
                continue
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            if not any(r.get("uid") == uid for r in reserved):
                continue

            def unreserve(obj: KubeObject) -> None:
                status = obj.setdefault("status", {})
                left = [r for r in status.get("reservedFor") or [] if r.get("uid") != uid]
                if left:
                    status["reservedFor"] = left
                else:
                    status.pop("reservedFor", None)
                    status.pop("allocation", None)  # nobody uses it: deallocated

            with contextlib.suppress(StoreError):
                self.store.mutate("ResourceClaim", namespace, name, unreserve)
