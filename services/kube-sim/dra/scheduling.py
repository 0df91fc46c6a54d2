"""kube-scheduler's DynamicResources plugin for kube-sim's scheduling loop.

PreFilter: the pod's claims must exist (`waiting for dynamic resource controller to create the
resourceclaim "<pod>-<entry>"` while the controller has not made a template's claim yet;
`resourceclaim "<name>" not found` for a named one) and not be reserved for too many pods.
Filter, per node: an allocated claim's `nodeSelector` must match the node; the claims not yet
allocated, plus the pod's extended-resource claim (KEP-5004: a container's request for a
resource that a DeviceClass maps through `extendedResourceName`, or the implicit
`deviceclass.resource.kubernetes.io/<class>`, on a node whose kubelet does not advertise that
resource: one request `container-<i>-request-<j>` per container and resource, `count` = the
amount), go through the structured allocator; a node where that fails gets upstream's reason
`cannot allocate all claims`. Reserve, before the bind: each allocated claim's
`status.allocation` and every claim's `status.reservedFor` (the pod) are written, the
extended-resource claim is created (owned by the pod, annotated
`resource.kubernetes.io/extended-resource-claim`) and named in the pod's
`status.extendedResourceClaimStatus` with its `requestMappings`. A failed bind undoes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tessera.kube_sim.dra.allocator import UNSCHEDULABLE, Allocator, Outcome
from tessera.kube_sim.dra.claims import (
    EXTENDED_CLAIM,
    all_claim_names,
    owner_reference,
    pod_claim_names,
)
from tessera.kube_sim.dra.model import (
    Device,
    DeviceId,
    Pool,
    Usage,
    device_index,
    holdings,
    newest_slices,
    node_selector_matches,
    pools_for_node,
    usage_of,
)
from tessera.kube_sim.dra.quota import admit_claim
from tessera.kube_sim.fit import _container_requests, allocatable
from tessera.kube_sim.store import Change, KubeObject, ObjectStore, Selector, StoreError

from tessera.dra_quota import IMPLICIT_PREFIX

log = logging.getLogger("tessera.kube_sim.dra.scheduling")

MAX_RESERVED_FOR = 256


def extended_resource_classes(classes: list[KubeObject]) -> dict[str, str]:
    """extended resource name → DeviceClass name: explicit `extendedResourceName` (the newest
    class wins a tie, then the first name), and every class's implicit name."""
    mapping: dict[str, str] = {}
    chosen: dict[str, tuple[str, str]] = {}  # explicit name -> (created, class) of the winner
    for device_class in classes:
        name = device_class["metadata"]["name"]
        mapping[IMPLICIT_PREFIX + name] = name
        explicit = (device_class.get("spec") or {}).get("extendedResourceName")
        if not explicit:
            continue
        created = str(device_class["metadata"].get("creationTimestamp", ""))
        best = chosen.get(str(explicit))
        if best is None or created > best[0] or (created == best[0] and name < best[1]):
            chosen[str(explicit)] = (created, name)
    mapping.update({resource: name for resource, (_, name) in chosen.items()})
    return mapping


@dataclass
class ExtendedRequest:
    container_index: int
    container: str
    resource: str
    request_name: str
    class_name: str
    count: int


@dataclass
class PodState:
    """What PreFilter found, and what Filter computed per node (reused by Reserve)."""

    claims: list[KubeObject]
    extended: list[ExtendedRequest]
    classes: dict[str, KubeObject]
    error: str = ""
    outcomes: dict[str, tuple[Outcome, KubeObject | None]] = field(default_factory=dict)

    def ignored_for(self, node: KubeObject) -> set[str]:
        """Extended resources NodeResourcesFit leaves to DRA on this node."""
        offered = allocatable(node)
        return {e.resource for e in self.extended if not offered.get(e.resource)}


class DynamicResources:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.reserved: dict[str, list[str]] = {}  # pod uid -> claims it allocated (undo)
        # What the filter reads, kept between cycles until the kind changes: the slices (by
        # node, parsed into pools per node) and what allocated claims hold. Reserve records its
        # own allocations in `_usage`, so a burst of pods does not re-read every claim.
        self._changes: dict[str, int] = {}
        store.listeners.append(self._changed)
        store.change_listeners.append(self._claim_changed)
        self._slices_at = -1
        self._by_node: dict[str, list[KubeObject]] = {}
        self._shared: list[KubeObject] = []
        self._devices: dict[DeviceId, Device] = {}
        self._rules: list[KubeObject] = []  # DeviceTaintRules, read with the slices
        self._pools: dict[tuple[str, str], list[Pool]] = {}
        self._usage_at = -1
        self._usage = Usage()

    def _changed(self, kind: str) -> None:
        if kind in ("ResourceSlice", "ResourceClaim", "DeviceTaintRule"):
            kind = "ResourceSlice" if kind == "DeviceTaintRule" else kind  # devices' taints
            self._changes[kind] = self._changes.get(kind, 0) + 1

    def _refresh_slices(self) -> None:
        at = self._changes.get("ResourceSlice", 0)
        if at == self._slices_at:
            return
        self._by_node, self._shared, self._pools = {}, [], {}
        slices = newest_slices(self.store.list("ResourceSlice", Selector()))
        for item in slices:
            node = (item.get("spec") or {}).get("nodeName")
            if node:
                self._by_node.setdefault(node, []).append(item)
            else:
                self._shared.append(item)
        self._devices = device_index(slices)
        self._rules = self.store.list("DeviceTaintRule", Selector())
        self._slices_at = at
        self._usage_at = -1  # which devices are shared may have changed

    def pools(self, node: KubeObject) -> list[Pool]:
        self._refresh_slices()
        name = node["metadata"]["name"]
        key = (name, str(node["metadata"].get("resourceVersion", "")))
        if key not in self._pools:
            self._pools[key] = pools_for_node(self._by_node.get(name, []) + self._shared, node,
                                              self._rules)
        return self._pools[key]

    def usage(self) -> Usage:
        self._refresh_slices()
        at = self._changes.get("ResourceClaim", 0)
        if at != self._usage_at:
            self._usage = usage_of(self.store.list("ResourceClaim", Selector()), self._devices)
            self._usage_at = at
        return self._usage

    def _claim_changed(self, change: Change) -> None:
        """The allocated-devices state kept incrementally (upstream's assume cache): a claim's
        allocation that changed is given back and the new one taken, instead of every claim
        read again on the next pod."""
        if change.kind != "ResourceClaim" or self._usage_at < 0:
            return
        before = ((change.old or {}).get("status") or {}).get("allocation")
        after = ((change.new or {}).get("status") or {}).get("allocation")
        if before != after:
            for device, consumed in holdings(change.old, self._devices):
                self._usage.give_back(device, consumed)
            for device, consumed in holdings(change.new, self._devices):
                self._usage.take(device, consumed)
        self._usage_at = self._changes.get("ResourceClaim", 0)

    # --- PreFilter ---------------------------------------------------------------------------

    def prefilter(self, pod: KubeObject) -> PodState | None:
        """None: the pod uses no DRA at all."""
        spec = pod.get("spec") or {}
        classes = {c["metadata"]["name"]: c for c in self.store.list("DeviceClass", Selector())}
        extended = self._extended_requests(pod, classes)
        if not spec.get("resourceClaims") and not extended:
            return None
        state = PodState([], extended, classes)
        namespace = pod["metadata"].get("namespace", "")
        for entry, claim_name in pod_claim_names(pod).items():
            if claim_name is None:
                state.error = ("waiting for dynamic resource controller to create the "
                               f'resourceclaim "{pod["metadata"]["name"]}-{entry}"')
                return state
            try:
                claim = self.store.get("ResourceClaim", namespace, claim_name)
            except StoreError:
                state.error = f'resourceclaim "{claim_name}" not found'
                return state
            if (claim.get("metadata") or {}).get("deletionTimestamp"):
                state.error = f'resourceclaim "{claim_name}" is being deleted'
                return state
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            if len(reserved) >= MAX_RESERVED_FOR and not any(
                    r.get("uid") == pod["metadata"].get("uid") for r in reserved):
                state.error = f'resourceclaim "{claim_name}" is reserved for too many pods'
                return state
            state.claims.append(claim)
        return state

    @staticmethod
    def _extended_requests(pod: KubeObject, classes: dict[str, KubeObject]) -> list[
            ExtendedRequest]:
        mapping = extended_resource_classes(list(classes.values()))
        if not mapping:
            return []
        spec = pod.get("spec") or {}
        found = []
        containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        for index, container in enumerate(containers):
            position = 0
            for resource, amount in sorted(_container_requests(container).items()):
                if resource not in mapping or amount <= 0:
                    continue
                found.append(ExtendedRequest(
                    index, container.get("name", ""), resource,
                    f"container-{index}-request-{position}", mapping[resource],
                    int(amount) if amount == int(amount) else int(amount) + 1))
                position += 1
        return found

    # --- Filter --------------------------------------------------------------------------------

    def filter(self, state: PodState, pod: KubeObject, node: KubeObject) -> str | None:
        """None: the pod's claims fit on `node`; else the reason for this node."""
        if state.error:
            return state.error
        name = node["metadata"]["name"]
        pending = []
        for claim in state.claims:
            allocation = (claim.get("status") or {}).get("allocation")
            if allocation:
                selector = allocation.get("nodeSelector")
                if selector and not node_selector_matches(selector, node):
                    return "resourceclaim not available on the node"
            else:
                pending.append(claim)
        ignored = state.ignored_for(node)
        special = self._extended_claim(pod, [e for e in state.extended if e.resource in ignored])
        if special is not None:
            pending.append(special)
        if not pending:
            state.outcomes[name] = (Outcome({}), None)
            return None
        outcome = Allocator(pending, self.pools(node), state.classes, self.usage(), name).run()
        if not outcome.ok:
            log.info("claims do not fit", extra={"pod": pod["metadata"]["name"], "node": name,
                                                 "reason": outcome.reason})
            return UNSCHEDULABLE
        state.outcomes[name] = (outcome, special)
        return None

    @staticmethod
    def _extended_claim(pod: KubeObject, extended: list[ExtendedRequest]) -> KubeObject | None:
        if not extended:
            return None
        meta = pod["metadata"]
        return {
            "metadata": {"namespace": meta.get("namespace", ""),
                         "name": f"{meta['name']}-extended-resources",
                         "uid": f"extended-{meta.get('uid', '')}"},
            "spec": {"devices": {"requests": [
                {"name": e.request_name, "exactly": {
                    "deviceClassName": e.class_name, "allocationMode": "ExactCount",
                    "count": e.count}}
                for e in extended]}},
        }

    # --- Reserve / PreBind, Unreserve --------------------------------------------------------

    def reserve(self, state: PodState, pod: KubeObject, node: str) -> None:
        """Write the allocation and reservations; raises StoreError (then nothing is kept)."""
        if node not in state.outcomes:
            raise StoreError(409, "Conflict", f"no allocation was computed for node {node}")
        outcome, special = state.outcomes[node]
        allocations = outcome.results()
        uid = pod["metadata"].get("uid", "")
        namespace = pod["metadata"].get("namespace", "")
        consumer = {"resource": "pods", "name": pod["metadata"]["name"], "uid": uid}
        pending = [c for c in state.claims if not (c.get("status") or {}).get("allocation")]
        allocated_by_me: list[str] = []
        self.reserved[uid] = allocated_by_me
        try:
            for claim in state.claims:
                index = next((i for i, c in enumerate(pending) if c is claim), None)
                allocation = allocations.get(index) if index is not None else None
                claim_name = claim["metadata"]["name"]
                expected = claim["metadata"].get("resourceVersion")

                def write(obj: KubeObject, allocation: Any = allocation,
                          expected: Any = expected) -> None:
                    status = obj.setdefault("status", {})
                    if allocation is not None:
                        if status.get("allocation") or obj["metadata"].get(
                                "resourceVersion") != expected:
                            raise StoreError(409, "Conflict", "the claim changed while "
                                             "the pod was scheduled")
                        status["allocation"] = allocation
                    reserved = [r for r in status.get("reservedFor") or []
                                if r.get("uid") != uid]
                    status["reservedFor"] = [*reserved, consumer]

                self.store.mutate("ResourceClaim", namespace, claim_name, write)
                if allocation is not None:
                    allocated_by_me.append(claim_name)
            if special is not None:
                self._create_extended_claim(pod, state, special, outcome, consumer)
        except StoreError:
            self.unreserve(pod)
            raise

    def _create_extended_claim(self, pod: KubeObject, state: PodState, special: KubeObject,
                               outcome: Outcome, consumer: dict[str, Any]) -> None:
        allocations = outcome.results()
        allocation = allocations[len(allocations) - 1]
        meta = pod["metadata"]
        claim = {
            "metadata": {"generateName": f"{meta['name']}-extended-resources-",
                         "namespace": meta.get("namespace", ""),
                         "annotations": {EXTENDED_CLAIM: "true"},
                         "ownerReferences": [owner_reference(pod)]},
            "spec": special["spec"],
            "status": {"allocation": allocation, "reservedFor": [consumer]},
        }
        # created through the API upstream: ResourceQuota admission (dra/quota.py) applies
        admit_claim(self.store, claim)
        created = self.store.create("ResourceClaim", claim)
        requested = {e.request_name for e in state.extended}
        mappings = [{"containerName": e.container, "resourceName": e.resource,
                     "requestName": e.request_name}
                    for e in state.extended
                    if e.request_name in {r["name"] for r in special["spec"]["devices"][
                        "requests"]} and e.request_name in requested]

        def record(obj: KubeObject) -> None:
            if obj["metadata"].get("uid") != meta.get("uid"):
                raise StoreError(409, "Conflict", "the pod was replaced")
            obj.setdefault("status", {})["extendedResourceClaimStatus"] = {
                "resourceClaimName": created["metadata"]["name"], "requestMappings": mappings}

        self.store.mutate("Pod", meta.get("namespace", ""), meta["name"], record)

    def unreserve(self, pod: KubeObject) -> None:
        """Undo reserve: the pod leaves reservedFor, claims it allocated are deallocated, its
        extended-resource claim goes."""
        uid = pod["metadata"].get("uid", "")
        namespace = pod["metadata"].get("namespace", "")
        allocated = set(self.reserved.pop(uid, []))
        current = pod
        with contextlib.suppress(StoreError):
            current = self.store.get("Pod", namespace, pod["metadata"]["name"])
        for claim_name in all_claim_names(current):
            def undo(obj: KubeObject, claim_name: str = claim_name) -> None:
                status = obj.setdefault("status", {})
                left = [r for r in status.get("reservedFor") or [] if r.get("uid") != uid]
                status["reservedFor"] = left
                if not left:
                    status.pop("reservedFor", None)
                    if claim_name in allocated:
                        status.pop("allocation", None)

            with contextlib.suppress(StoreError):
                self.store.mutate("ResourceClaim", namespace, claim_name, undo)
        for claim in self.store.list("ResourceClaim", Selector(namespace=namespace)):
            annotations = (claim.get("metadata") or {}).get("annotations") or {}
            if EXTENDED_CLAIM in annotations and any(
                    r.get("uid") == uid for r in claim["metadata"].get("ownerReferences") or []):
                with contextlib.suppress(StoreError):
                    self.store.delete("ResourceClaim", namespace, claim["metadata"]["name"])

        def forget(obj: KubeObject) -> None:
            (obj.get("status") or {}).pop("extendedResourceClaimStatus", None)

        with contextlib.suppress(StoreError):
            self.store.mutate("Pod", namespace, pod["metadata"]["name"], forget)

    def bound(self, pod: KubeObject) -> None:
        self.reserved.pop(pod["metadata"].get("uid", ""), None)

    async def follow(self, retry: Callable[[], None], stop: asyncio.Event) -> None:
        """kube-scheduler's DRA cluster events: a slice or class added or changed, a claim
        created, deallocated or deleted: every waiting pod is tried again."""
        watchers = {kind: self.store.watch(kind, Selector(), self.store.version)
                    for kind in ("ResourceSlice", "DeviceClass", "ResourceClaim")}
        queue: asyncio.Queue[tuple[str, str, KubeObject]] = asyncio.Queue()

        async def pump(kind: str, source: asyncio.Queue[tuple[str, KubeObject]]) -> None:
            while True:
                event_type, obj = await source.get()
                queue.put_nowait((kind, event_type, obj))

        tasks = [asyncio.create_task(pump(k, w.queue)) for k, w in watchers.items()]
        stopped = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, stopped},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                kind, event_type, obj = getter.result()
                if kind != "ResourceClaim" or event_type in ("ADDED", "DELETED") or not (
                        obj.get("status") or {}).get("allocation"):
                    retry()
        finally:
            for watcher in watchers.values():
                self.store.unwatch(watcher)
            for task in [*tasks, stopped]:
                task.cancel()
            for task in [*tasks, stopped]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

