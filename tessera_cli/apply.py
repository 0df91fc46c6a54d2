"""`apply` as kubectl does it: create, or update what changed since the last apply, or say why
it cannot change. The applied form is kept in the `last-applied-configuration` annotation (the
same key kubectl uses), so a re-apply compares like with like and removed fields are removed.

Pods are immutable apart from their labels, annotations and container images (Kubernetes'
rule): a re-apply that changes anything else says which fields and what to do.

Writes ask for `fieldValidation=Strict`, kubectl's default: a misspelt field (`resources.limit:`)
is refused by the API server naming it, never stored without its meaning. The server's
`Warning` headers (admission warnings among them) are kept on the client for the caller to print.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from .kube import ApiError, KubeClient
from .manifests import Manifest, ManifestError, check
from .resources import Kind, by_kind, discover, is_kubeconfig

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
STRICT = "?fieldValidation=Strict"
_POD_MUTABLE = re.compile(
    r"^(metadata\.(labels|annotations)\b|spec\.(init)?[cC]ontainers\[\d+\]\.image$"
    r"|spec\.activeDeadlineSeconds$|spec\.tolerations\b)"
)
_SERVER_OWNED = ("status",)
_SERVER_META = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")


def diff_paths(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The field paths where `new` differs from `old` (lists compared item by item)."""
    if isinstance(old, dict) and isinstance(new, dict):
        paths = []
        for key in sorted(set(old) | set(new), key=str):
            here = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                paths.append(here)
            else:
                paths += diff_paths(old[key], new[key], here)
        return paths
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        paths = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            paths += diff_paths(a, b, f"{prefix}[{i}]")
        return paths
    return [] if old == new else [prefix or "(the object)"]


def subset_diff(given: Any, current: Any, prefix: str = "") -> list[str]:
    """Paths of what `given` sets differently from `current` (what the server added is not a
    change): the comparison for an object created without a last-applied record."""
    if isinstance(given, dict) and isinstance(current, dict):
        paths = []
        for key, value in given.items():
            here = f"{prefix}.{key}" if prefix else str(key)
            paths += subset_diff(value, current.get(key), here) if key in current else [here]
        return paths
    if isinstance(given, list) and isinstance(current, list) and len(given) == len(current):
        return [p for i, (a, b) in enumerate(zip(given, current, strict=True))
                for p in subset_diff(a, b, f"{prefix}[{i}]")]  # fmt: skip
    return [] if given == current else [prefix]


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 patch turning `old` into `new` (removed keys become null)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


def applied_form(manifest: Manifest, kind: Kind, namespace: str) -> dict[str, Any]:
    """The object as sent: the namespace filled in, server-owned fields dropped."""
    doc = copy.deepcopy(manifest.doc)
    doc.setdefault("apiVersion", kind.api_version)
    for key in _SERVER_OWNED:
        doc.pop(key, None)
    meta = doc.setdefault("metadata", {})
    for key in _SERVER_META:
        meta.pop(key, None)
    if kind.namespaced:
        meta["namespace"] = meta.get("namespace") or namespace
    else:
        meta.pop("namespace", None)
    annotations = meta.get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(LAST_APPLIED, None)
        if not annotations:
            meta.pop("annotations")
    return doc


def _with_record(doc: dict[str, Any]) -> dict[str, Any]:
    sent = copy.deepcopy(doc)
    annotations = sent["metadata"].setdefault("annotations", {})
    annotations[LAST_APPLIED] = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return sent


def kind_for(client: KubeClient, manifest: Manifest) -> Kind:
    """The kind's REST paths: those tessera knows, else from the server's discovery (any kind
    it serves: PriorityClass, ConfigMap, ...), else ManifestError."""
    check(manifest)
    kind = by_kind(manifest.kind)
    api_version = str(manifest.doc.get("apiVersion") or "")
    if kind is not None and api_version in ("", kind.api_version):
        return kind
    found = discover(client, api_version, manifest.kind)
    if found is None:
        raise ManifestError(
            f"{manifest.where}: no matches for kind \"{manifest.kind}\" in version "
            f"\"{api_version}\" (the server does not serve it): \"kind: {manifest.kind}\""
        )
    return found


def skipped(manifest: Manifest) -> str:
    """Why this document is not applied ('' when it is): a kubeconfig in a directory applied."""
    if is_kubeconfig(str(manifest.doc.get("apiVersion") or ""), manifest.kind):
        return f"skipped {manifest.where}: a kubeconfig (kind: Config), not an object to apply"
    return ""


def apply_one(client: KubeClient, manifest: Manifest, namespace: str) -> str:
    """`pod/x created|configured|unchanged`; ApiError/ManifestError say why not."""
    if skipped(manifest):
        return skipped(manifest)
    kind = kind_for(client, manifest)
    doc = applied_form(manifest, kind, namespace)
    meta = doc["metadata"]
    ns = meta.get("namespace")
    label = f"{kind.singular}/{meta.get('name') or meta.get('generateName')}"
    if not meta.get("name"):
        created = client.post(kind.collection(ns) + STRICT, _with_record(doc))
        return f"{kind.singular}/{created['metadata']['name']} created"
    try:
        client.post(kind.collection(ns) + STRICT, _with_record(doc))
        return f"{label} created"
    except ApiError as error:
        if error.status != 409:
            raise
    current = client.get(kind.item(ns, meta["name"]))
    record = ((current.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        previous = json.loads(record) if record else None
    except ValueError:
        previous = None
    changed = diff_paths(previous, doc) if isinstance(previous, dict) else subset_diff(doc, current)
    if not changed:
        return f"{label} unchanged"
    if kind.kind == "Pod":
        frozen = [p for p in changed if not _POD_MUTABLE.match(p)]
        if frozen:
            shown = ", ".join(frozen[:4]) + (f" and {len(frozen) - 4} more" if len(frozen) > 4
                                             else "")  # fmt: skip
            raise ApiError(
                f"a pod's {shown} cannot change once it exists (Kubernetes allows only "
                f"labels, annotations and images): delete it and apply again", 422, "Invalid"
            )
    patch = merge_patch(previous if isinstance(previous, dict) else {}, doc)
    patch.setdefault("metadata", {})
    if patch["metadata"] is None:
        patch["metadata"] = {}
    patch["metadata"].setdefault("annotations", {})
    if patch["metadata"]["annotations"] is None:
        patch["metadata"]["annotations"] = {}
    patch["metadata"]["annotations"][LAST_APPLIED] = _with_record(doc)["metadata"][
        "annotations"][LAST_APPLIED]
    client.patch(kind.item(ns, meta["name"]) + STRICT, patch)
    return f"{label} configured"


_NEEDLES = (
    re.compile(r"[a-z0-9.-]+\.[a-z]{2,}/[A-Za-z0-9._-]+"),  # nvidia.com/gpumem, hami.io/...
    re.compile(r"\b([a-zA-Z]+)\b(?=[^.\w]*?:\s*(Invalid|Required|Unsupported|Forbidden))"),
)


def quote_for(manifest: Manifest, message: str) -> str:
    """The line of the manifest an API error is about, quoted (when one can be found): a
    resource name or field the message names, else an extended resource (`nvidia.com/gpumem:`)
    whose short name it uses ("gpumem 0 used + 10000 requested")."""
    for pattern in _NEEDLES:
        for match in pattern.finditer(message):
            quoted = manifest.quote(match.group(0))
            if quoted:
                return quoted
    for word in re.findall(r"[a-z][a-z-]{2,}", message):
        quoted = manifest.quote(f"/{word}:")
        if quoted:
            return quoted
    return ""
