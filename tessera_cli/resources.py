"""The Kubernetes kinds the CLI knows: names as kubectl accepts them, and their REST paths."""

from __future__ import annotations

from dataclasses import dataclass


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
