"""The cluster's word before the extender acts on a caller's say-so.

- Filter reserves (quota, a ledger reservation) only for a pod that exists in the cluster with
  that uid: a made-up pod posted to /filter holds nothing. Pods the scheduler's pod watch has
  seen are known without a round trip; others are looked up once (`get_pod`).
- Bind re-checks the pod's node constraints it can see (constraints.py) against the Node object
  (cached for a few seconds, as kube-scheduler's own cache is). The constraints of pods not yet
  bound come from the pod watch too, so a bind costs no extra API call in the common case.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tessera.cluster.port import ClusterError, ClusterPort, NotFoundError, WatchEvent

from .constraints import node_constraint_problem
from .pods import PodIdentity

POD_UNKNOWN = "PodUnknown"
_KNOWN_LIMIT = 200_000
_CONSTRAINT_FIELDS = ("nodeSelector", "affinity", "tolerations")


class PodGate:
    def __init__(
        self,
        cluster: ClusterPort | None,
        clock: Callable[[], float] = time.monotonic,
        node_cache_s: float = 5.0,
    ) -> None:
        self.cluster = cluster
        self.clock = clock
        self.node_cache_s = node_cache_s
        self.known: dict[str, tuple[str, str]] = {}  # uid -> (namespace, name), from the watch
        # uid -> the scheduling-relevant part of an unbound pod's spec, from the watch
        self.unbound: dict[str, dict[str, Any]] = {}
        self._nodes: dict[str, tuple[float, dict[str, Any]]] = {}

    def observe(self, event: WatchEvent) -> None:
        """Feed from the pod watch: which pods exist."""
        meta = event.object.get("metadata") or {}
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            return
        spec = event.object.get("spec") or {}
        if event.type == "DELETED" or spec.get("nodeName"):
            self.unbound.pop(uid, None)
        if event.type == "DELETED":
            self.known.pop(uid, None)
        elif len(self.known) < _KNOWN_LIMIT:
            self.known[uid] = (str(meta.get("namespace") or "default"), str(meta.get("name")))
            if not spec.get("nodeName"):
                self.unbound[uid] = {k: spec[k] for k in _CONSTRAINT_FIELDS if k in spec}

    async def check_identity(self, ident: PodIdentity) -> str | None:
        return await self.pod_problem(ident.namespace, ident.name, ident.uid)

    async def pod_problem(self, namespace: str, name: str, uid: str) -> str | None:
        """None when the cluster has this pod with this uid; else why not (nothing is held)."""
        if self.cluster is None:
            return None  # no cluster API: nothing can be bound; reservations lapse by themselves
        if not uid:
            return f"{POD_UNKNOWN}: pod {namespace}/{name} has no uid"
        if self.known.get(uid) == (namespace, name):
            return None
        try:
            pod = await self.cluster.get_pod(namespace, name)
        except NotFoundError:
            return f"{POD_UNKNOWN}: pod {namespace}/{name} does not exist in the cluster"
        except ClusterError as exc:
            return f"{POD_UNKNOWN}: pod {namespace}/{name} could not be checked: {exc}"
        real = (pod.get("metadata") or {}).get("uid")
        if real != uid:
            return f"{POD_UNKNOWN}: pod {namespace}/{name} in the cluster has uid {real}, not {uid}"
        return None

    async def check_bind(self, namespace: str, name: str, uid: str, node: str) -> str | None:
        """Bind's check: the pod exists (with that uid) and its constraints allow `node`."""
        if self.cluster is None:
            return None
        constraints = self.unbound.get(uid) if uid else None
        if constraints is not None and self.known.get(uid) == (namespace, name):
            pod: dict[str, Any] = {"metadata": {"uid": uid}, "spec": constraints}
        else:
            try:
                pod = await self.cluster.get_pod(namespace, name)
            except ClusterError as exc:
                return f"pod {namespace}/{name}: {exc}"
            real = (pod.get("metadata") or {}).get("uid")
            if uid and real != uid:
                return f"pod {namespace}/{name} in the cluster has uid {real}, not {uid}"
        problem = await self.bind_problem(pod, node)
        return f"refusing to bind {namespace}/{name}: {problem}" if problem else None

    async def placement_problem(self, pod: dict[str, Any], node: str) -> str | None:
        """Filter's check before it holds anything on `node`: the pod's constraints (as the pod
        watch has them, else as the request gives them) allow it, as bind will check."""
        uid = (pod.get("metadata") or {}).get("uid")
        constraints = self.unbound.get(uid) if isinstance(uid, str) else None
        if constraints is not None:
            pod = {"metadata": {"uid": uid}, "spec": constraints}
        return await self.bind_problem(pod, node)

    async def bind_problem(self, pod: dict[str, Any], node: str) -> str | None:
        """None when the pod's nodeSelector, required affinity and tolerations allow `node`."""
        if self.cluster is None:
            return None
        entry = self._nodes.get(node)
        now = self.clock()
        if entry is None or now - entry[0] > self.node_cache_s:
            try:
                obj = await self.cluster.get_node(node)
            except NotFoundError:
                return f"node {node} does not exist"
            except ClusterError as exc:
                return f"node {node} could not be read to check the pod's constraints: {exc}"
            self._nodes[node] = (now, obj)
            if len(self._nodes) > 10_000:
                self._nodes.pop(next(iter(self._nodes)))
        else:
            obj = entry[1]
        return node_constraint_problem(pod, obj)
