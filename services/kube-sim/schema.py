"""Which fields each kind has: kube-apiserver's strict decoding (`fieldValidation`).

kubectl leaves field validation to the server (kube-sim's OpenAPI says it supports
`fieldValidation`), so a typo such as `resources: {limit: ...}` must be caught here, as
kube-apiserver does: with `fieldValidation=Strict` (kubectl's default) the write is refused with
`Pod in version "v1" cannot be handled as a Pod: strict decoding error: unknown field
"spec.containers[0].resources.limit"`; with `Warn` (the API's default) it is stored and the reply
carries a `Warning` header per field. The schemas name the fields of the API types kube-sim's
kinds carry; `OPEN` marks a subtree kube-sim does not describe (anything goes there). Pure data.
"""

from __future__ import annotations

from typing import Any

OPEN: dict[str, Any] = {}  # an object whose fields are not checked
MAP = "map"  # string → value map (labels, limits): any key
LEAF = "leaf"  # a scalar or a list of scalars


def _fields(*names: str, **typed: Any) -> dict[str, Any]:
    return {**dict.fromkeys(names, LEAF), **typed}


OBJECT_META = _fields(
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "finalizers",
    labels=MAP, annotations=MAP, ownerReferences=[OPEN], managedFields=[OPEN],
)
RESOURCES = _fields(limits=MAP, requests=MAP, claims=[OPEN])
ENV_VAR = _fields("name", "value", valueFrom=OPEN)
CONTAINER = _fields(
    "name", "image", "command", "args", "workingDir", "terminationMessagePath",
    "terminationMessagePolicy", "imagePullPolicy", "restartPolicy", "stdin", "stdinOnce", "tty",
    ports=[OPEN], envFrom=[OPEN], env=[ENV_VAR], resources=RESOURCES, resizePolicy=[OPEN],
    volumeMounts=[OPEN], volumeDevices=[OPEN], livenessProbe=OPEN, readinessProbe=OPEN,
    startupProbe=OPEN, lifecycle=OPEN, securityContext=OPEN,
)
POD_SPEC = _fields(
    "restartPolicy", "terminationGracePeriodSeconds", "activeDeadlineSeconds", "dnsPolicy",
    "serviceAccountName", "serviceAccount", "automountServiceAccountToken", "nodeName",
    "hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace", "hostname", "subdomain",
    "schedulerName", "priorityClassName", "priority", "runtimeClassName", "enableServiceLinks",
    "preemptionPolicy", "setHostnameAsFQDN", "hostUsers",
    volumes=[OPEN], initContainers=[CONTAINER], containers=[CONTAINER],
    ephemeralContainers=[OPEN], nodeSelector=MAP, securityContext=OPEN, imagePullSecrets=[OPEN],
    affinity=OPEN, tolerations=[OPEN], hostAliases=[OPEN], dnsConfig=OPEN,
    readinessGates=[OPEN], overhead=MAP, topologySpreadConstraints=[OPEN], os=OPEN,
    schedulingGates=[OPEN], resourceClaims=[OPEN], resources=RESOURCES,
)
TEMPLATE = _fields(metadata=OBJECT_META, spec=POD_SPEC)


def _kind(spec: dict[str, Any]) -> dict[str, Any]:
    return _fields("apiVersion", "kind", metadata=OBJECT_META, spec=spec, status=OPEN)


SCHEMAS: dict[str, dict[str, Any]] = {
    "Pod": _kind(POD_SPEC),
    "Deployment": _kind(_fields(
        "replicas", "minReadySeconds", "revisionHistoryLimit", "paused",
        "progressDeadlineSeconds", selector=OPEN, template=TEMPLATE, strategy=OPEN,
    )),
    "ReplicaSet": _kind(_fields("replicas", "minReadySeconds", selector=OPEN,
                                template=TEMPLATE)),
    "Job": _kind(_fields(
        "parallelism", "completions", "activeDeadlineSeconds", "backoffLimit",
        "backoffLimitPerIndex", "maxFailedIndexes", "manualSelector", "ttlSecondsAfterFinished",
        "completionMode", "suspend", "podReplacementPolicy", "managedBy",
        podFailurePolicy=OPEN, successPolicy=OPEN, selector=OPEN, template=TEMPLATE,
    )),
    "ResourceQuota": _kind(_fields("scopes", hard=MAP, scopeSelector=OPEN)),
    "Namespace": _kind(_fields("finalizers")),
}


def unknown_fields(kind: str, obj: Any) -> list[str]:
    """Paths of the fields `obj` has that its kind does not (empty for undescribed kinds)."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        return []
    found: list[str] = []
    _walk(schema, obj, "", found)
    return found


def _walk(schema: Any, value: Any, path: str, found: list[str]) -> None:
    if schema is OPEN or schema in (MAP, LEAF):
        return
    if isinstance(schema, list):
        if isinstance(value, list):
            for index, item in enumerate(value):
                _walk(schema[0], item, f"{path}[{index}]", found)
        return
    if not isinstance(value, dict):
        return
    for key, item in value.items():
        if key.startswith("$"):
            continue  # strategic merge directives
        where = f"{path}.{key}" if path else key
        if key not in schema:
            found.append(where)
        else:
            _walk(schema[key], item, where, found)


def strict_error_message(kind: str, api_version: str, problems: list[str]) -> str:
    """`problems`: `unknown field "x"` / `duplicate field "y"`, as `field_problems` words them."""
    return (f'{kind} in version "{api_version.rsplit("/", 1)[-1]}" cannot be handled as a '
            f"{kind}: strict decoding error: {', '.join(problems)}")


def field_problems(kind: str, obj: Any, duplicates: list[str]) -> list[str]:
    """What strict decoding reports: each unknown field, each field given twice in the JSON."""
    return ([f'unknown field "{f}"' for f in unknown_fields(kind, obj)]
            + [f'duplicate field "{f}"' for f in duplicates])


class _Pairs(dict[str, Any]):
    """A JSON object that remembers the keys it was given more than once."""

    repeated: list[str]


def _pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    obj = _Pairs(pairs)
    obj.repeated = [] if len(obj) == len(pairs) else sorted(
        {k for i, (k, _) in enumerate(pairs) if any(k == other for other, _ in pairs[:i])})
    return obj


def has_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads(object_pairs_hook=...)`: a plain dict; flags a repeated key by raising."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise DuplicateKeys
    return obj


class DuplicateKeys(ValueError):
    pass


def duplicate_fields(text: bytes | str, parse_float: Any) -> list[str]:
    """Paths of the fields given twice in a JSON document (`spec.replicas`), in order found.
    Only called when a first, cheap decode saw a repeated key."""
    import json

    found: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, _Pairs):
            found.extend(f"{path}.{k}" if path else k for k in value.repeated)
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else key)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")

    walk(json.loads(text, object_pairs_hook=_pairs, parse_float=parse_float), "")
    return found
