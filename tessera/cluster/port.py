"""The cluster port: the few Kubernetes operations Tessera's services need.

Services talk to the cluster only through this interface. Objects are plain Kubernetes JSON
(dicts exactly as the API server serves them), so the real adapter and the local stand-in
(kube-sim) stay interchangeable and tests can build objects from YAML.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from tessera.cluster.slim_pods import Listed, Need

KubeObject = dict[str, Any]
WatchEventType = Literal["ADDED", "MODIFIED", "DELETED"]


_WATCH_EVENT_TYPES = frozenset(("ADDED", "MODIFIED", "DELETED"))


class WatchEvent:
    """One change seen by a watch. A (re)list is replayed as ADDED events.

    A plain class with the checks and the copy of the pydantic model it was: `type` one of
    `WatchEventType`, `object` a mapping with string keys (else ValueError, as pydantic's
    ValidationError is), held as a shallow copy (a new dict, its values shared); equal when
    type and object are. A restart's pod watch replays every pod of the cluster through one
    (80,000 at 5,000 nodes × 8 GPUs) while the scheduler starts: ~4 µs each validated by
    pydantic, ~2 here."""

    __slots__ = ("object", "type")
    __hash__ = None  # type: ignore[assignment]  # mutable, as the model was

    def __init__(self, *, type: WatchEventType, object: KubeObject) -> None:
        if type not in _WATCH_EVENT_TYPES:
            raise ValueError(f"watch event type must be one of {sorted(_WATCH_EVENT_TYPES)}, "
                             f"not {type!r}")  # fmt: skip
        if _type(object) is dict:
            copied = object.copy()
        elif isinstance(object, Mapping):
            copied = dict(object)
        else:
            raise ValueError(f"watch event object must be a mapping, not {_type(object).__name__}")
        try:
            "".join(copied)  # every key a str, checked in C
        except TypeError:
            raise ValueError("watch event object keys must be strings") from None
        self.type: WatchEventType = type
        self.object: KubeObject = copied

    def __eq__(self, other: object) -> bool:
        if _type(other) is not WatchEvent:
            return NotImplemented
        return self.type == other.type and self.object == other.object  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"WatchEvent(type={self.type!r}, object={self.object!r})"


_type = type


class ObjectRef(BaseModel):
    """What an Event is about (core/v1 ObjectReference, the fields we use)."""

    # Its validator is built when the first event is recorded, not at every service's import.
    model_config = ConfigDict(defer_build=True)

    kind: str = "Pod"
    namespace: str = ""
    name: str
    uid: str = ""
    api_version: str = "v1"


class ClusterError(Exception):
    """A cluster call failed; `status` is the HTTP status when there is one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFoundError(ClusterError):
    """The object does not exist (HTTP 404)."""


class ConflictError(ClusterError):
    """The write lost a race or the object is already in that state (HTTP 409)."""


class DisruptionRefusedError(ClusterError):
    """An eviction the API server refused because it would violate a PodDisruptionBudget
    (HTTP 429 on the Eviction subresource)."""


@runtime_checkable
class ClusterPort(Protocol):
    """Everything the services ask of Kubernetes.

    Implementations: `tessera.cluster.memory.InMemoryCluster` (tests), the Kubernetes adapter
    (`kubernetes` client) and the kube-sim adapter. All methods are coroutines; watches are async
    iterators that list first (yielding ADDED for every existing object), then stream changes,
    and relist by themselves when the server says their resourceVersion is too old (410 Gone).
    """

    async def get_pod(self, namespace: str, name: str) -> KubeObject:
        """The pod as the API serves it. Raises NotFoundError."""
        ...

    async def list_pods(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> list[KubeObject]:
        """Pods, optionally only one namespace and/or only those bound to `node_name`."""
        ...

    async def list_pods_slim(self, need: Need | None = None) -> Listed:
        """Every pod, holding only the fields `tessera.cluster.slim_pods.SlimPod` keeps (what
        the ledger rebuild and HAMi's classification read; any superset will do), less those
        `need` (given each page's `metadata.uid`s and `spec.schedulerName`s) says the caller
        does not read, which are counted and never decoded: `slim_pods.Listed`. Callers go through
        `slim_pods.list_pods_slim(cluster)`, which takes `list_pods()` from a stand-in without
        this method."""
        ...

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str | None] | None = None,
        labels: dict[str, str | None] | None = None,
    ) -> KubeObject:
        """JSON merge patch of metadata; a None value removes the key. Returns the new pod."""
        ...

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """POST pods/<name>/binding. ConflictError if the pod is already bound."""
        ...

    def watch_pods(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> AsyncIterator[WatchEvent]:
        """List then watch pods (see the class doc for relist semantics)."""
        ...

    def watch_resource_quotas(self, namespace: str | None = None) -> AsyncIterator[WatchEvent]:
        """List then watch ResourceQuota objects."""
        ...

    async def patch_resource_quota_used(self, namespace: str, name: str,
                                        used: dict[str, str]) -> None:
        """Merge `used` into a ResourceQuota's `status.used` (its status subresource): the keys
        kube-controller-manager does not evaluate (`limits.nvidia.com/gpumem`)."""
        ...

    async def get_node(self, name: str) -> KubeObject:
        """The Node as the API serves it (labels, taints). Raises NotFoundError."""
        ...

    async def patch_node_annotations(self, node: str, annotations: dict[str, str | None]) -> None:
        """JSON merge patch of a node's annotations; None removes the key."""
        ...

    def watch_nodes(self) -> AsyncIterator[WatchEvent]:
        """List then watch Node objects (the scheduler reads HAMi's registration annotation)."""
        ...

    async def record_event(
        self,
        involved: ObjectRef,
        reason: str,
        message: str,
        event_type: Literal["Normal", "Warning"] = "Normal",
    ) -> None:
        """Create a core/v1 Event about `involved` (best effort: callers may ignore failures)."""
        ...

    async def get_config_map(self, namespace: str, name: str) -> KubeObject:
        """A ConfigMap (per-node device configuration). Raises NotFoundError."""
        ...

    def watch_config_maps(self, namespace: str) -> AsyncIterator[WatchEvent]:
        """List then watch the ConfigMaps of one namespace."""
        ...

    # --- preemption (scheduler) -----------------------------------------------------------------

    async def evict_pod(
        self, namespace: str, name: str, uid: str, grace_period_s: int | None = None
    ) -> None:
        """POST pods/<name>/eviction (policy/v1 Eviction): the pod is deleted gracefully (its
        grace period runs). DisruptionRefusedError when a PodDisruptionBudget forbids it,
        NotFoundError when it is gone, ConflictError when `uid` no longer names it."""
        ...

    async def set_nominated_node(self, namespace: str, name: str, node: str | None) -> None:
        """Set (or clear, with None) the pod's `status.nominatedNodeName`."""
        ...

    async def list_disruption_budgets(self, namespace: str | None = None) -> list[KubeObject]:
        """PodDisruptionBudgets (policy/v1), with their status (`disruptionsAllowed`)."""
        ...


def watch_pods_listed(cluster: ClusterPort) -> AsyncIterator[WatchEvent | None]:
    """The cluster's pod watch with the end of its listing marked: None once the ADDED events of
    the first listing (and of each relist) have been yielded, so the caller knows its view of
    the pods is complete, and that a pod it has not seen does not exist. The adapter and the
    in-memory cluster mark it (`watch_pods_marked`); a stand-in with only `watch_pods` gives
    None first (taken as listed at once, as every caller assumed before the mark existed)."""
    marked = getattr(cluster, "watch_pods_marked", None)
    if marked is not None:
        events: AsyncIterator[WatchEvent | None] = marked()
        return events
    return _listed_at_once(cluster)


async def _listed_at_once(cluster: ClusterPort) -> AsyncIterator[WatchEvent | None]:
    yield None
    events = cluster.watch_pods()
    async with aclosing(events):
        async for event in events:
            yield event


WebhookKind = Literal["mutating", "validating"]


@runtime_checkable
class WebhookCertificatePort(Protocol):
    """What a webhook that provisions its own certificate asks of Kubernetes: one Secret to keep
    the CA and serving certificate in, and its own webhook configurations to put the CA into
    (`caBundle`). The chart's RBAC grants exactly these objects, by name.

    Replacements are optimistic: the object's `metadata.resourceVersion` must still be current,
    else ConflictError (another replica wrote first; read again)."""

    async def get_secret(self, namespace: str, name: str) -> KubeObject:
        """The Secret as the API serves it (`data` values base64). Raises NotFoundError."""
        ...

    async def create_secret(self, namespace: str, secret: KubeObject) -> KubeObject:
        """Create it; ConflictError when it exists already."""
        ...

    async def replace_secret(self, namespace: str, secret: KubeObject) -> KubeObject:
        """PUT with the resourceVersion it was read at; ConflictError when that is stale."""
        ...

    async def get_webhook_configuration(self, kind: WebhookKind, name: str) -> KubeObject:
        """A Mutating- or ValidatingWebhookConfiguration. Raises NotFoundError."""
        ...

    async def replace_webhook_configuration(self, kind: WebhookKind, config: KubeObject
                                            ) -> KubeObject:
        """PUT with the resourceVersion it was read at; ConflictError when that is stale."""
        ...
