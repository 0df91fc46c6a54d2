"""The Kubernetes kinds the CLI knows: names as kubectl accepts them, and their REST paths."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str  # "v1", "apps/v1", "batch/v1"
    plural: str
    namespaced: bool = True
    short: tuple[str, ...] = ()

    @property
    def singular(self) -> str:
        return self.kind.lower()

    def collection(self, namespace: str | None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            return f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{self.plural}"

    def item(self, namespace: str | None, name: str) -> str:
        return f"{self.collection(namespace)}/{name}"


KINDS = (
    Kind("Pod", "v1", "pods", short=("po",)),
    Kind("ResourceQuota", "v1", "resourcequotas", short=("quota",)),
    Kind("Namespace", "v1", "namespaces", namespaced=False, short=("ns",)),
    Kind("Node", "v1", "nodes", namespaced=False, short=("no",)),
    Kind("Event", "v1", "events", short=("ev",)),
    Kind("Deployment", "apps/v1", "deployments", short=("deploy",)),
    Kind("ReplicaSet", "apps/v1", "replicasets", short=("rs",)),
    Kind("Job", "batch/v1", "jobs"),
)


def by_kind(kind: str) -> Kind | None:
    return next((k for k in KINDS if k.kind == kind), None)


def by_name(resource: str) -> Kind | None:
    """`pods`, `pod`, `po`, `Pod`, `deployments.apps`: as kubectl reads a resource name."""
    name = resource.lower().split(".", 1)[0]
    return next(
        (k for k in KINDS if name in (k.plural, k.singular, *k.short)), None
    )


def known_names() -> str:
    return ", ".join(k.plural for k in KINDS)


def is_kubeconfig(api_version: str, kind: str) -> bool:
    """A kubeconfig file (`apiVersion: v1`, `kind: Config`): client configuration, not an object
    the API serves; `apply -f DIR` skips it with a note."""
    return api_version == "v1" and kind == "Config"


_GROUP_VERSION = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?/v[0-9]+((alpha|beta)[0-9]+)?")


def discover(client: Any, api_version: str, kind: str) -> Kind | None:
    """The kind as the server's discovery lists it (`/api/v1`, `/apis/<group>/<version>`):
    what kubectl does for any kind it applies. None when the server does not serve it."""
    if api_version != "v1" and not _GROUP_VERSION.fullmatch(api_version):
        return None  # also never a path of the caller's making (`../`, a query)
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    try:
        listing = client.get(path)
    except Exception:  # the group-version is not served (404), or the server is away
        return None
    for resource in (listing or {}).get("resources") or []:
        name = resource.get("name") or ""
        if resource.get("kind") == kind and name and "/" not in name:
            shorts = tuple(resource.get("shortNames") or ())
            return Kind(kind, api_version, name, bool(resource.get("namespaced")), shorts)
    return None


def discover_by_name(client: Any, resource: str) -> Kind | None:
    """A resource named as kubectl accepts it (plural, singular, short name; `name.group`
    narrows the group), found in the server's discovery: the core group, then every group's
    preferred version. None when the server lists no such resource."""
    name, _, group = resource.lower().partition(".")
    versions = [] if group else ["v1"]
    try:
        groups = (client.get("/apis") or {}).get("groups") or []
    except Exception as exc:
        if getattr(exc, "status", None) == 0:
            raise  # the server is away: say that, not that it lacks the resource
        groups = []
    for entry in groups:
        preferred = (entry.get("preferredVersion") or {}).get("groupVersion")
        if preferred and (not group or entry.get("name") == group):
            versions.append(preferred)
    for api_version in versions:
        path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            listing = client.get(path) or {}
        except Exception:
            continue
        for r in listing.get("resources") or []:
            plural = r.get("name") or ""
            if "/" in plural or not r.get("kind"):
                continue
            names = {plural, r.get("singularName") or "", *(r.get("shortNames") or ())}
            if name in names or name == str(r["kind"]).lower():
                return Kind(str(r["kind"]), api_version, plural, bool(r.get("namespaced")),
                            tuple(r.get("shortNames") or ()))  # fmt: skip
    return None
