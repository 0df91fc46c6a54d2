"""An in-memory cluster behind the cluster port, for unit tests of services.

It keeps the API server's contract where services rely on it: binding an already bound pod is a
conflict, merge patches with None delete keys, watches list first and then stream changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from tessera.cluster.port import (
    ConflictError,
    DisruptionRefusedError,
    KubeObject,
    NotFoundError,
    ObjectRef,
    WatchEvent,
)
from tessera.cluster.resources_port import InMemoryResources
from tessera.cluster.slim_pods import Listed, Need, SlimReader, slim


class InMemoryCluster(InMemoryResources):
    """`implicit_nodes`: every node name exists (unlabelled, untainted) unless `add_node` gave
    it an object; otherwise only added nodes exist, as on a real API server."""

    def __init__(self, *, implicit_nodes: bool = False) -> None:
        self.implicit_nodes = implicit_nodes
        self.nodes: dict[str, KubeObject] = {}
        self.pods: dict[tuple[str, str], KubeObject] = {}
        self.quotas: dict[tuple[str, str], KubeObject] = {}
        self.node_annotations: dict[str, dict[str, str]] = {}
        self.events: list[dict[str, Any]] = []
        # PodDisruptionBudgets as served (status.disruptionsAllowed set by the test), evictions
        self.disruption_budgets: list[KubeObject] = []
        self.evictions: list[tuple[str, str]] = []
        self._pod_watchers: list[asyncio.Queue[WatchEvent]] = []
        self._quota_watchers: list[asyncio.Queue[WatchEvent]] = []
        self.config_maps: dict[tuple[str, str], KubeObject] = {}
        self._config_map_watchers: list[asyncio.Queue[WatchEvent]] = []
        self._node_watchers: list[asyncio.Queue[WatchEvent]] = []

    # --- test helpers ---------------------------------------------------------------------
    def add_pod(self, pod: KubeObject) -> KubeObject:
        pod = copy.deepcopy(pod)
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("annotations", {})
        meta.setdefault("labels", {})
        pod.setdefault("status", {"phase": "Pending"})
        self.pods[(meta["namespace"], meta["name"])] = pod
        self._emit(self._pod_watchers, "ADDED", pod)
        return copy.deepcopy(pod)

    def update_pod(self, pod: KubeObject) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.pods[key] = copy.deepcopy(pod)
        self._emit(self._pod_watchers, "MODIFIED", pod)

    def delete_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name))
        self._emit(self._pod_watchers, "DELETED", pod)

    def add_node(self, node: KubeObject) -> None:
        name = node["metadata"]["name"]
        kind = "MODIFIED" if name in self.nodes else "ADDED"
        self.nodes[name] = copy.deepcopy(node)
        self._emit(self._node_watchers, kind, self._node_view(name))

    def delete_node(self, name: str) -> None:
        view = self._node_view(name)
        del self.nodes[name]
        self._emit(self._node_watchers, "DELETED", view)

    def put_quota(self, quota: KubeObject) -> None:
        key = (quota["metadata"].get("namespace", "default"), quota["metadata"]["name"])
        kind = "MODIFIED" if key in self.quotas else "ADDED"
        self.quotas[key] = copy.deepcopy(quota)
        self._emit(self._quota_watchers, kind, quota)

    # --- the port -------------------------------------------------------------------------
    async def get_pod(self, namespace: str, name: str) -> KubeObject:
        try:
            return copy.deepcopy(self.pods[(namespace, name)])
        except KeyError:
            raise NotFoundError(f"pod {namespace}/{name} not found", 404) from None

    async def list_pods(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> list[KubeObject]:
        return [copy.deepcopy(p) for p in self.pods.values() if _matches(p, namespace, node_name)]

    async def list_pods_slim(self, need: Need | None = None) -> Listed:
        """`list_pods()` cut to `tessera.cluster.slim_pods`' fields, as the real client's is."""
        reader = SlimReader(need)
        return Listed(reader.take([slim(p) for p in await self.list_pods()]), reader.skipped)

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str | None] | None = None,
        labels: dict[str, str | None] | None = None,
    ) -> KubeObject:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise NotFoundError(f"pod {namespace}/{name} not found", 404)
        meta = pod["metadata"]
        for field, patch in (("annotations", annotations), ("labels", labels)):
            target = meta.setdefault(field, {})
            for key, value in (patch or {}).items():
                if value is None:
                    target.pop(key, None)
                else:
                    target[key] = value
        self._emit(self._pod_watchers, "MODIFIED", pod)
        return copy.deepcopy(pod)

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise NotFoundError(f"pod {namespace}/{name} not found", 404)
        if uid and pod["metadata"].get("uid") != uid:
            raise ConflictError(f"pod {namespace}/{name} uid mismatch", 409)
        if pod.get("spec", {}).get("nodeName"):
            raise ConflictError(f"pod {namespace}/{name} is already bound", 409)
        pod.setdefault("spec", {})["nodeName"] = node
        self._emit(self._pod_watchers, "MODIFIED", pod)

    async def watch_pods(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> AsyncIterator[WatchEvent]:
        events = self.watch_pods_marked(namespace, node_name)
        async with contextlib.aclosing(events):
            async for event in events:
                if event is not None:
                    yield event

    async def watch_pods_marked(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> AsyncIterator[WatchEvent | None]:
        """`watch_pods`, with None yielded once the listing is replayed (as the adapter)."""
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._pod_watchers.append(queue)
        try:
            for pod in list(self.pods.values()):
                if _matches(pod, namespace, node_name):
                    yield WatchEvent(type="ADDED", object=copy.deepcopy(pod))
            yield None
            while True:
                event = await queue.get()
                if _matches(event.object, namespace, node_name):
                    yield event
        finally:
            self._pod_watchers.remove(queue)

    async def watch_resource_quotas(
        self, namespace: str | None = None
    ) -> AsyncIterator[WatchEvent]:
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._quota_watchers.append(queue)
        try:
            for quota in list(self.quotas.values()):
                if _matches(quota, namespace, None):
                    yield WatchEvent(type="ADDED", object=copy.deepcopy(quota))
            while True:
                event = await queue.get()
                if _matches(event.object, namespace, None):
                    yield event
        finally:
            self._quota_watchers.remove(queue)

    async def get_node(self, name: str) -> KubeObject:
        node = self.nodes.get(name)
        if node is None and self.implicit_nodes:
            node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        if node is None:
            raise NotFoundError(f"node {name} not found", 404)
        node = copy.deepcopy(node)
        annotations = node["metadata"].setdefault("annotations", {})
        annotations.update(self.node_annotations.get(name, {}))
        return node

    async def patch_resource_quota_used(self, namespace: str, name: str,
                                        used: dict[str, str]) -> None:
        quota = self.quotas.get((namespace, name))
        if quota is None:
            raise NotFoundError(f"resourcequotas {name!r} not found", 404)
        status = quota.setdefault("status", {})
        status["used"] = {**(status.get("used") or {}), **used}
        self.put_quota(quota)

    async def patch_node_annotations(self, node: str, annotations: dict[str, str | None]) -> None:
        target = self.node_annotations.setdefault(node, {})
        for key, value in annotations.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        if node in self.nodes:
            self._emit(self._node_watchers, "MODIFIED", self._node_view(node))

    def _node_view(self, name: str) -> KubeObject:
        """The Node as the API serves it: its object with the patched annotations merged."""
        node = copy.deepcopy(self.nodes[name])
        node["metadata"].setdefault("annotations", {}).update(self.node_annotations.get(name, {}))
        return node

    async def watch_nodes(self) -> AsyncIterator[WatchEvent]:
        """Nodes given objects by `add_node` (implicit nodes have nothing to watch)."""
        async for event in self.watch_nodes_marked():
            if event is not None:
                yield event

    async def watch_nodes_marked(self) -> AsyncIterator[WatchEvent | None]:
        """`watch_nodes` with None after the listing's ADDED events (as the adapter's)."""
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._node_watchers.append(queue)
        try:
            for name in list(self.nodes):
                yield WatchEvent(type="ADDED", object=self._node_view(name))
            yield None
            while True:
                yield await queue.get()
        finally:
            self._node_watchers.remove(queue)

    async def record_event(
        self,
        involved: ObjectRef,
        reason: str,
        message: str,
        event_type: Literal["Normal", "Warning"] = "Normal",
    ) -> None:
        self.events.append(
            {"involved": involved.model_dump(), "reason": reason, "message": message,
             "type": event_type}
        )

    # --- config maps ------------------------------------------------------------------------
    def put_config_map(self, config_map: KubeObject) -> None:
        meta = config_map.setdefault("metadata", {})
        key = (meta.setdefault("namespace", "default"), meta["name"])
        kind = "MODIFIED" if key in self.config_maps else "ADDED"
        self.config_maps[key] = copy.deepcopy(config_map)
        self._emit(self._config_map_watchers, kind, config_map)

    def delete_config_map(self, namespace: str, name: str) -> None:
        config_map = self.config_maps.pop((namespace, name))
        self._emit(self._config_map_watchers, "DELETED", config_map)

    async def get_config_map(self, namespace: str, name: str) -> KubeObject:
        try:
            return copy.deepcopy(self.config_maps[(namespace, name)])
        except KeyError:
            raise NotFoundError(f"configmap {namespace}/{name} not found", 404) from None

    async def watch_config_maps(self, namespace: str) -> AsyncIterator[WatchEvent]:
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._config_map_watchers.append(queue)
        try:
            for config_map in list(self.config_maps.values()):
                if _matches(config_map, namespace, None):
                    yield WatchEvent(type="ADDED", object=copy.deepcopy(config_map))
            while True:
                event = await queue.get()
                if _matches(event.object, namespace, None):
                    yield event
        finally:
            self._config_map_watchers.remove(queue)

    async def evict_pod(
        self, namespace: str, name: str, uid: str, grace_period_s: int | None = None
    ) -> None:
        """Deleted at once (no kubelet here to run a grace period); 429 when a budget whose
        selector matches the pod allows no disruption."""
        pod = await self.get_pod(namespace, name)
        if uid and pod["metadata"].get("uid") != uid:
            raise ConflictError(f"pod {namespace}/{name}: uid precondition failed", 409)
        labels = pod["metadata"].get("labels") or {}
        for pdb in self.disruption_budgets:
            meta, spec = pdb.get("metadata") or {}, pdb.get("spec") or {}
            wanted = (spec.get("selector") or {}).get("matchLabels") or {}
            if meta.get("namespace", "default") != namespace:
                continue
            matches = all(labels.get(k) == v for k, v in wanted.items())
            if matches and (pdb.get("status") or {}).get("disruptionsAllowed", 0) <= 0:
                raise DisruptionRefusedError(
                    "Cannot evict pod as it would violate the pod's disruption budget.", 429
                )
        self.evictions.append((namespace, name))
        self.delete_pod(namespace, name)

    async def set_nominated_node(self, namespace: str, name: str, node: str | None) -> None:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise NotFoundError(f"pod {namespace}/{name} not found", 404)
        pod.setdefault("status", {})["nominatedNodeName"] = node
        self._emit(self._pod_watchers, "MODIFIED", pod)

    async def list_disruption_budgets(self, namespace: str | None = None) -> list[KubeObject]:
        return [
            copy.deepcopy(p) for p in self.disruption_budgets
            if namespace is None or (p.get("metadata") or {}).get("namespace") == namespace
        ]  # fmt: skip

    @staticmethod
    def _emit(watchers: list[asyncio.Queue[WatchEvent]], kind: str, obj: KubeObject) -> None:
        for queue in watchers:
            queue.put_nowait(WatchEvent(type=kind, object=copy.deepcopy(obj)))  # type: ignore[arg-type]


def _matches(obj: KubeObject, namespace: str | None, node_name: str | None) -> bool:
    if namespace and obj.get("metadata", {}).get("namespace") != namespace:
        return False
    return not (node_name and obj.get("spec", {}).get("nodeName") != node_name)
