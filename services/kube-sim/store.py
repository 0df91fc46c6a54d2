"""The object store behind kube-sim's API: objects by kind, a resourceVersion, a watch history.

It keeps the API server's contract that clients rely on: every write bumps one global
resourceVersion; a watch started at version V sees every change after V (replayed from a
bounded history, 410 Gone once V has fallen out of it); a field selector on `spec.nodeName`
turns a pod moving onto a node into ADDED and off it into DELETED, as kube-apiserver does.
No I/O here: the HTTP layer and the scheduler loop both drive it.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tessera.kube_sim.discovery import api_version_of, qualified_resource
from tessera.kube_sim.quantity import QuantityError, canonicalise
from tessera.kube_sim.selectors import Requirement, fields_match, labels_match

KubeObject = dict[str, Any]
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped kinds


class StoreError(Exception):
    """An API error with its HTTP status and Kubernetes reason."""

    def __init__(
        self, status: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.details = details  # metav1.StatusDetails: name, group, kind, causes


def _details(kind: str, name: str) -> dict[str, Any]:
    resource = qualified_resource(kind)
    plural, _, group = resource.partition(".")
    return {"name": name, "group": group, "kind": plural} if group else {
        "name": name, "kind": plural}


def not_found(kind: str, name: str) -> StoreError:
    return StoreError(
        404, "NotFound", f'{qualified_resource(kind)} "{name}" not found', _details(kind, name)
    )


def already_exists(kind: str, name: str) -> StoreError:
    return StoreError(
        409, "AlreadyExists", f'{qualified_resource(kind)} "{name}" already exists',
        _details(kind, name),
    )


def conflict(message: str) -> StoreError:
    return StoreError(409, "Conflict", message)


def gone(version: int) -> StoreError:
    return StoreError(410, "Expired", f"too old resource version: {version}")


def decoded(kind: str, obj: KubeObject) -> KubeObject:
    """`obj` as kube-apiserver holds it once decoded into its Go type: every quantity in
    canonical form (in place). A value that is no quantity is the decoding error kube-apiserver
    answers, 400 `<Kind> in version "<v>" cannot be handled as a <Kind>: <Go's message>`."""
    try:
        canonicalise(kind, obj)
    except QuantityError as exc:
        version = api_version_of(kind) or "v1"
        raise StoreError(400, "BadRequest", f'{kind} in version "{version.split("/")[-1]}" '
                         f"cannot be handled as a {kind}: {exc}") from None
    return obj


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def key_of(obj: KubeObject) -> Key:
    meta = obj.get("metadata", {})
    return (meta.get("namespace", "") or "", meta.get("name", ""))


@dataclass(frozen=True)
class Selector:
    """Which objects a list or watch wants: a namespace and/or `spec.nodeName`."""

    namespace: str | None = None
    node_name: str | None = None  # "" selects unbound pods (spec.nodeName=)
    labels: dict[str, str] = field(default_factory=dict)
    # full selectors (`!=`, `in`, `notin`, existence; any field path), beside the simple ones
    label_requirements: tuple[Requirement, ...] = ()
    field_requirements: tuple[Requirement, ...] = ()

    def matches(self, obj: KubeObject | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        if self.namespace and meta.get("namespace") != self.namespace:
            return False
        if self.node_name is not None and (obj.get("spec", {}).get("nodeName") or "") != (
            self.node_name
        ):
            return False
        object_labels = meta.get("labels") or {}
        if not all(object_labels.get(k) == v for k, v in self.labels.items()):
            return False
        return labels_match(self.label_requirements, object_labels) and fields_match(
            self.field_requirements, obj
        )

    def __hash__(self) -> int:
        return hash(
            (
                self.namespace,
                self.node_name,
                tuple(sorted(self.labels.items())),
                self.label_requirements,
                self.field_requirements,
            )
        )


@dataclass
class Change:
    """One write, as kept in the history: the object before and after (None = absent)."""

    version: int
    kind: str
    old: KubeObject | None
    new: KubeObject | None


def event_for(change: Change, selector: Selector) -> tuple[str, KubeObject] | None:
    """The watch event a watcher with `selector` sees for `change` (None: nothing)."""
    was, now = selector.matches(change.old), selector.matches(change.new)
    if now and not was:
        return "ADDED", change.new  # type: ignore[return-value]
    if now and was:
        return "MODIFIED", change.new  # type: ignore[return-value]
    if was and not now:
        # A delete carries the final state; an object leaving the selection its new state.
        return "DELETED", change.new if change.new is not None else change.old  # type: ignore[return-value]
    return None


@dataclass
class Watcher:
    kind: str
    selector: Selector
    queue: asyncio.Queue[tuple[str, KubeObject]]
    since: int = 0  # the resourceVersion it started after
    # False: the watcher only reads what it is handed (an HTTP watch stream serialises it), so
    # it gets the stored object itself, which the store never changes in place (every write
    # stores a new object): no copy per watcher and event
    copies: bool = True

    def hand(self, event_type: str, obj: KubeObject) -> None:
        self.queue.put_nowait((event_type, clone(obj) if self.copies else obj))


_SCALARS = (str, int, float, bool, type(None))


def clone(value: Any) -> Any:
    """A deep copy of a JSON-shaped object (dicts, lists, scalars), as `copy.deepcopy` makes
    it at a third of its cost (no memo: an API object is a tree); anything else in it is copied
    by `copy.deepcopy`. Every read and watch event hands out a copy, so this is kube-sim's
    hottest function under a burst of pods."""
    kind = type(value)
    if kind is dict:
        return {k: v if type(v) in _SCALARS else clone(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _SCALARS else clone(v) for v in value]
    if kind in _SCALARS:
        return value
    return copy.deepcopy(value)


class ObjectStore:
    """Objects of several kinds with one resourceVersion sequence and a bounded history."""

    def __init__(self, history_size: int = 20000, clock: Callable[[], str] = now_rfc3339) -> None:
        self._objects: dict[str, dict[Key, KubeObject]] = {}
        self._history: deque[Change] = deque(maxlen=history_size)
        self._watchers: list[Watcher] = []
        # called with the kind of every write, without a copy (in-process controllers)
        self.listeners: list[Callable[[str], None]] = []
        # told each write itself (after `listeners`), for caches kept up to date incrementally
        self.change_listeners: list[Callable[[Change], None]] = []
        self._version = 0
        self._clock = clock
        self.first_version = 1  # the API server was born at version 1

    @property
    def version(self) -> int:
        return self._version

    # --- reads ------------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> KubeObject:
        obj = self._objects.get(kind, {}).get((namespace, name))
        if obj is None:
            raise not_found(kind, name)
        return clone(obj)

    def peek(self, kind: str, namespace: str, name: str) -> KubeObject:
        """The stored object itself, for a caller that only reads it (never changes it): the
        store never changes a stored object in place, so it stays what was read."""
        obj = self._objects.get(kind, {}).get((namespace, name))
        if obj is None:
            raise not_found(kind, name)
        return obj

    def kinds(self) -> list[str]:
        return list(self._objects)

    def list(self, kind: str, selector: Selector) -> list[KubeObject]:
        objects = self._objects.get(kind, {})
        return [clone(objects[k]) for k in sorted(objects) if selector.matches(objects[k])]

    # --- writes -----------------------------------------------------------------------------

    def create(self, kind: str, obj: KubeObject) -> KubeObject:
        obj = decoded(kind, clone(obj))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise StoreError(422, "Invalid", "metadata.name: Required value")
            # five characters from the alphabet Kubernetes uses for generated names
            digits = uuid.uuid4().int
            suffix = "".join(NAME_ALPHABET[(digits >> (5 * i)) % 27] for i in range(5))
            meta["name"] = f"{prefix[:58]}{suffix}"
        key = key_of(obj)
        if key in self._objects.get(kind, {}):
            raise already_exists(kind, key[1])
        meta["uid"] = str(uuid.uuid4())
        meta.setdefault("creationTimestamp", self._clock())
        obj["apiVersion"] = api_version_of(kind) or obj.get("apiVersion") or "v1"
        obj["kind"] = kind
        return self._write(kind, key, obj)

    def replace(
        self, kind: str, obj: KubeObject, expected_version: str | None = None,
        persist: bool = True, owned: bool = False,
    ) -> KubeObject:
        """`owned`: the caller hands `obj` over (made for this write, used no more), so the
        store keeps it without a copy."""
        key = key_of(obj)
        current = self._objects.get(kind, {}).get(key)
        if current is None:
            raise not_found(kind, key[1])
        if expected_version and expected_version != current["metadata"]["resourceVersion"]:
            raise conflict(
                f'Operation cannot be fulfilled on {qualified_resource(kind)} "{key[1]}": the '
                "object has been modified; please apply your changes to the latest version and "
                "try again"
            )
        obj = decoded(kind, obj if owned else clone(obj))
        obj["metadata"]["uid"] = current["metadata"]["uid"]
        obj["metadata"]["creationTimestamp"] = current["metadata"].get("creationTimestamp")
        obj["kind"] = kind
        obj["apiVersion"] = api_version_of(kind) or obj.get("apiVersion") or "v1"
        if not persist:  # dryRun=All: the object as it would be, nothing written
            obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            return obj
        return self._write(kind, key, obj)

    def mutate(
        self, kind: str, namespace: str, name: str, change: Callable[[KubeObject], None],
        persist: bool = True,
    ) -> KubeObject:
        """Apply `change` to a copy of the object and store it (raises what `change` raises);
        `persist=False` (dryRun=All) returns the result without storing it."""
        current = self._objects.get(kind, {}).get((namespace, name))
        if current is None:
            raise not_found(kind, name)
        obj = clone(current)
        change(obj)
        decoded(kind, obj)
        if obj == current or not persist:
            return obj  # a no-op write keeps its resourceVersion and wakes no watcher
        return self._write(kind, (namespace, name), obj)

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> KubeObject:
        objects = self._objects.get(kind, {})
        current = objects.get((namespace, name))
        if current is None:
            raise not_found(kind, name)
        if uid and current["metadata"].get("uid") != uid:
            raise conflict(f"Precondition failed: UID in precondition: {uid}")
        del objects[(namespace, name)]
        final = clone(current)
        self._version += 1
        final["metadata"]["resourceVersion"] = str(self._version)
        self._publish(Change(self._version, kind, current, None), final)
        return clone(final)

    def trim(self, kind: str, keep: int) -> None:
        """Forget the oldest objects of a kind beyond `keep` (events), without watch events."""
        objects = self._objects.get(kind, {})
        while len(objects) > keep:
            del objects[next(iter(objects))]

    def _write(self, kind: str, key: Key, obj: KubeObject) -> KubeObject:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        objects = self._objects.setdefault(kind, {})
        old = objects.get(key)
        if "spec" in obj:
            # metadata.generation counts spec changes (controllers report observedGeneration)
            generation = int((old or {}).get("metadata", {}).get("generation") or 0)
            changed = old is None or old.get("spec") != obj.get("spec")
            obj["metadata"]["generation"] = generation + 1 if changed else max(generation, 1)
        objects[key] = obj
        self._publish(Change(self._version, kind, old, obj), None)
        return clone(obj)

    def _publish(self, change: Change, deleted_final: KubeObject | None) -> None:
        if deleted_final is not None:
            # Watchers see the deleted object at the delete's resourceVersion.
            change = Change(change.version, change.kind, deleted_final, None)
        self._history.append(change)
        for listener in self.listeners:
            listener(change.kind)
        for change_listener in self.change_listeners:
            change_listener(change)
        for watcher in self._watchers:
            if watcher.kind != change.kind:
                continue
            seen = event_for(change, watcher.selector)
            if seen is not None:
                watcher.hand(*seen)

    # --- watches ----------------------------------------------------------------------------

    def watch(self, kind: str, selector: Selector, since: int, copies: bool = True) -> Watcher:
        """A watcher that gets every change after version `since` (410 if no longer known).
        `copies=False`: a read-only watcher, handed the stored objects themselves (`Watcher`).

        Replay and registration happen without yielding to the loop, so nothing falls between.
        """
        oldest_known = self._history[0].version - 1 if self._history else self._version
        if since < oldest_known and since < self._version:
            raise gone(since)
        watcher = Watcher(kind, selector, asyncio.Queue(), since, copies)
        for change in self._history:
            if change.version > since and change.kind == kind:
                seen = event_for(change, selector)
                if seen is not None:
                    watcher.hand(*seen)
        self._watchers.append(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.remove(watcher)
