"""What kube-sim serves, described the way kube-apiserver describes itself to clients.

One table of resource types (`TYPES`) drives the routes' kind lookup, legacy discovery
(`/api`, `/api/v1`, `/apis`, `/apis/<group>/<version>`: APIVersions, APIGroupList,
APIResourceList with verbs, shortNames, namespaced, kind, categories) and a minimal OpenAPI v3
(`/openapi/v3` and one document per group-version). kubectl reads that OpenAPI only to learn
whether the server validates fields itself (the `fieldValidation` query parameter on each kind's
PATCH operation); finding it, kubectl leaves validation to the server instead of downloading
schemas. Adding a kind to kube-sim is one `ResourceType` line here plus its handling elsewhere.
Pure data and functions: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ResourceType:
    plural: str
    kind: str
    group: str = ""
    version: str = "v1"
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS
    subresources: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """`pods`, `deployments.apps`: how error messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """`Pod`, `Deployment.apps`: how Invalid errors name the kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


TYPES: tuple[ResourceType, ...] = (
    ResourceType("pods", "Pod", short_names=("po",), subresources=("status", "binding"),
                 categories=("all",)),
    ResourceType("events", "Event", short_names=("ev",)),
    ResourceType("nodes", "Node", namespaced=False, short_names=("no",),
                 subresources=("status",)),
    ResourceType("namespaces", "Namespace", namespaced=False, short_names=("ns",),
                 verbs=("create", "delete", "get", "list", "patch", "update", "watch"),
                 subresources=("status",)),
    ResourceType("resourcequotas", "ResourceQuota", short_names=("quota",),
                 subresources=("status",)),
    ResourceType("deployments", "Deployment", group="apps", short_names=("deploy",),
                 subresources=("status", "scale"), categories=("all",)),
    ResourceType("replicasets", "ReplicaSet", group="apps", short_names=("rs",),
                 subresources=("status", "scale"), categories=("all",)),
    ResourceType("jobs", "Job", group="batch", subresources=("status",),
                 categories=("all",)),
    ResourceType("configmaps", "ConfigMap", short_names=("cm",)),
    # stored and served (quantities canonical); LimitRanger's defaulting is not modelled
    ResourceType("limitranges", "LimitRange", short_names=("limits",)),
    ResourceType("secrets", "Secret"),
    ResourceType("mutatingwebhookconfigurations", "MutatingWebhookConfiguration",
                 group="admissionregistration.k8s.io", namespaced=False),
    ResourceType("validatingwebhookconfigurations", "ValidatingWebhookConfiguration",
                 group="admissionregistration.k8s.io", namespaced=False),
    # served by disruption.py (the verbs it implements)
    ResourceType("priorityclasses", "PriorityClass", group="scheduling.k8s.io",
                 namespaced=False, short_names=("pc",), verbs=("create", "delete", "get", "list")),
    ResourceType("poddisruptionbudgets", "PodDisruptionBudget", group="policy",
                 short_names=("pdb",), verbs=("create", "delete", "get", "list")),
    # Dynamic Resource Allocation (dra/)
    ResourceType("deviceclasses", "DeviceClass", group="resource.k8s.io", namespaced=False),
    ResourceType("resourceclaims", "ResourceClaim", group="resource.k8s.io",
                 subresources=("status",)),
    ResourceType("resourceclaimtemplates", "ResourceClaimTemplate", group="resource.k8s.io"),
    ResourceType("resourceslices", "ResourceSlice", group="resource.k8s.io", namespaced=False),
    ResourceType("devicetaintrules", "DeviceTaintRule", group="resource.k8s.io",
                 version="v1beta2", namespaced=False),  # beta (dra/taint_rules.py)
)


def default_type(plural: str, kind: str, cluster_scoped: bool) -> ResourceType:
    """A core/v1 kind some other part registered only by name (apiserver.RESOURCES)."""
    return ResourceType(plural, kind, namespaced=not cluster_scoped)


def all_types(extra: dict[str, str], cluster_scoped: set[str]) -> list[ResourceType]:
    """`TYPES` plus every plural → kind of `extra` not described there (core/v1)."""
    known = {t.plural for t in TYPES}
    added = [
        default_type(plural, kind, kind in cluster_scoped)
        for plural, kind in extra.items()
        if plural not in known
    ]
    return [*TYPES, *added]


def by_kind(kind: str) -> ResourceType | None:
    return next((t for t in TYPES if t.kind == kind), None)


def qualified_resource(kind: str) -> str:
    found = by_kind(kind)
    return found.qualified if found else f"{kind.lower()}s"


def api_version_of(kind: str) -> str | None:
    found = by_kind(kind)
    return found.api_version if found else None


def group_versions(types: list[ResourceType]) -> dict[str, list[str]]:
    """group → versions, core group ("") included."""
    groups: dict[str, list[str]] = {}
    for t in types:
        versions = groups.setdefault(t.group, [])
        if t.version not in versions:
            versions.append(t.version)
    return groups


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def _group_entry(group: str, versions: list[str]) -> dict[str, Any]:
    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": listed, "preferredVersion": listed[0]}


def api_group_list(types: list[ResourceType]) -> dict[str, Any]:
    groups = [
        _group_entry(group, versions)
        for group, versions in group_versions(types).items()
        if group
    ]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(types: list[ResourceType], group: str) -> dict[str, Any] | None:
    versions = group_versions(types).get(group)
    if not group or not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group_entry(group, versions)}


def resource_list(types: list[ResourceType], group: str, version: str) -> dict[str, Any] | None:
    chosen = [t for t in types if t.group == group and t.version == version]
    if not chosen:
        return None
    resources: list[dict[str, Any]] = []
    for t in chosen:
        entry: dict[str, Any] = {
            "name": t.plural,
            "singularName": t.kind.lower(),
            "namespaced": t.namespaced,
            "kind": t.kind,
            "verbs": list(t.verbs),
        }
        if t.short_names:
            entry["shortNames"] = list(t.short_names)
        if t.categories:
            entry["categories"] = list(t.categories)
        resources.append(entry)
        for sub in t.subresources:
            if sub == "binding":
                resources.append(
                    {"name": f"{t.plural}/binding", "singularName": "", "namespaced": True,
                     "kind": "Binding", "verbs": ["create"]}
                )
            elif sub == "scale":
                resources.append(
                    {"name": f"{t.plural}/scale", "singularName": "", "namespaced": t.namespaced,
                     "group": "autoscaling", "version": "v1", "kind": "Scale",
                     "verbs": ["get", "patch", "update"]}
                )
            else:
                resources.append(
                    {"name": f"{t.plural}/{sub}", "singularName": "", "namespaced": t.namespaced,
                     "kind": t.kind, "verbs": ["get", "patch", "update"]}
                )
    group_version = f"{group}/{version}" if group else version
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }


# --- OpenAPI v3 --------------------------------------------------------------------------------


def _openapi_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def openapi_document(types: list[ResourceType], group: str, version: str) -> dict[str, Any]:
    """One group-version's OpenAPI v3: each kind's paths, PATCH naming its GVK and the query
    parameters kube-apiserver takes (`fieldValidation`, `dryRun`, `fieldManager`, `force`).

    Schemas are left open (`type: object`): kube-sim validates on the server, not through
    client-side schemas.
    """
    prefix = "/" + _openapi_path(group, version)
    params = [
        {"name": name, "in": "query", "schema": {"type": "string"}, "uniqueItems": True}
        for name in ("dryRun", "fieldManager", "fieldValidation", "force", "pretty")
    ]
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    for t in types:
        if t.group != group or t.version != version:
            continue
        gvk = [{"group": t.group, "version": t.version, "kind": t.kind}]
        item = (
            f"{prefix}/namespaces/{{namespace}}/{t.plural}/{{name}}"
            if t.namespaced
            else f"{prefix}/{t.plural}/{{name}}"
        )
        reply = {"200": {"description": "OK"}}
        paths[item] = {
            "get": {"operationId": f"read{t.kind}", "responses": reply,
                    "x-kubernetes-action": "get", "x-kubernetes-group-version-kind": gvk[0]},
            "patch": {"operationId": f"patch{t.kind}", "parameters": params, "responses": reply,
                      "x-kubernetes-action": "patch", "x-kubernetes-group-version-kind": gvk[0]},
            "put": {"operationId": f"replace{t.kind}", "parameters": params, "responses": reply,
                    "x-kubernetes-action": "put", "x-kubernetes-group-version-kind": gvk[0]},
        }
        schema_name = f"io.k8s.kube-sim.{t.group or 'core'}.{t.version}.{t.kind}"
        schemas[schema_name] = {
            "type": "object",
            "x-kubernetes-group-version-kind": gvk,
            "x-kubernetes-preserve-unknown-fields": True,
        }
    return {
        "openapi": "3.0.0",
        "info": {"title": "kube-sim", "version": "v1.31.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def openapi_root(types: list[ResourceType]) -> dict[str, Any]:
    """`/openapi/v3`: each group-version's document, with a hash of its content as real
    kube-apiserver gives (clients cache by it)."""
    paths: dict[str, Any] = {}
    for group, versions in group_versions(types).items():
        for version in versions:
            doc = json.dumps(openapi_document(types, group, version), sort_keys=True)
            digest = hashlib.sha512(doc.encode()).hexdigest()[:64].upper()
            path = _openapi_path(group, version)
            paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
    return {"paths": paths}


def openapi_for_path(types: list[ResourceType], path: str) -> dict[str, Any] | None:
    """The document for `api/v1` or `apis/<group>/<version>` (None: no such group-version)."""
    parts = path.strip("/").split("/")
    if parts[:1] == ["api"] and len(parts) == 2:
        group, version = "", parts[1]
    elif parts[:1] == ["apis"] and len(parts) == 3:
        group, version = parts[1], parts[2]
    else:
        return None
    if version not in group_versions(types).get(group, []):
        return None
    return openapi_document(types, group, version)
