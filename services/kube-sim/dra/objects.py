"""The four `resource.k8s.io/v1` kinds as kube-apiserver stores them: defaults, validation
(422 Invalid worded as kube-apiserver's field errors), what an update may not change, and which
fields are Quantities (canonical on every write).

Defaults (API reference): `allocationMode: ExactCount` and `count: 1` for `exactly` requests and
each `firstAvailable` subrequest; a toleration's `operator: Equal`; a device taint's `timeAdded`.
Immutable: a ResourceClaim's and a ResourceClaimTemplate's `spec`; a ResourceSlice's `driver`,
`pool.name` and `nodeName`. Pod side: `spec.resourceClaims[]` names one of
`resourceClaimName`/`resourceClaimTemplateName`, and a container's `resources.claims[].name`
must be one of them.
"""

from __future__ import annotations

import re
from typing import Any

from tessera.kube_sim.dra import cel, taint_rules
from tessera.kube_sim.dra.model import maybe_quantity
from tessera.kube_sim.dra.slices import dns_label as _label
from tessera.kube_sim.dra.slices import validate_slice
from tessera.kube_sim.dra.taint_rules import BLOCKING
from tessera.kube_sim.quantity import register
from tessera.kube_sim.store import KubeObject, StoreError
from tessera.kube_sim.validation import (
    DNS1123_SUBDOMAIN,
    FieldError,
    raise_if,
    validate_name,
)

KINDS = ("DeviceClass", "ResourceClaim", "ResourceClaimTemplate", "ResourceSlice",
         "DeviceTaintRule")
RESOURCES = {"deviceclasses": "DeviceClass", "resourceclaims": "ResourceClaim",
             "resourceclaimtemplates": "ResourceClaimTemplate", "resourceslices": "ResourceSlice",
             "devicetaintrules": "DeviceTaintRule"}  # (v1beta2: taint_rules.py)
CLUSTER_SCOPED = {"DeviceClass", "ResourceSlice", "DeviceTaintRule"}
# the field selectors kube-apiserver supports for ResourceSlices
FIELD_LABELS = {"ResourceSlice": {"spec.nodeName", "spec.driver"}}
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_TOLERATIONS = 16
MAX_SELECTORS = 32
QUALIFIED = re.compile(r"^(?:[a-z0-9]([-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")

_CLAIM_SPEC = (
    "devices.requests.*.exactly.capacity.requests.{}",
    "devices.requests.*.firstAvailable.*.capacity.requests.{}",
)
for _kind, _paths in {
    "ResourceClaim": (*(f"spec.{p}" for p in _CLAIM_SPEC),
                      "status.allocation.devices.results.*.consumedCapacity.{}"),
    "ResourceClaimTemplate": tuple(f"spec.spec.{p}" for p in _CLAIM_SPEC),
    "ResourceSlice": (
        "spec.devices.*.capacity.{}.value",
        "spec.devices.*.capacity.{}.requestPolicy.default",
        "spec.devices.*.capacity.{}.requestPolicy.validValues.*",
        "spec.devices.*.capacity.{}.requestPolicy.validRange.min",
        "spec.devices.*.capacity.{}.requestPolicy.validRange.max",
        "spec.devices.*.capacity.{}.requestPolicy.validRange.step",
        "spec.devices.*.consumesCounters.*.counters.{}.value",
        "spec.sharedCounters.*.counters.{}.value",
    ),
}.items():
    register(_kind, _paths)


def _selectors(raw: Any, path: str, errors: list[FieldError]) -> None:
    if raw is None:
        return
    if not isinstance(raw, list) or len(raw) > MAX_SELECTORS:
        errors.append(FieldError("Invalid", path, f"must be a list of at most {MAX_SELECTORS}",
                                 "..."))
        return
    for i, selector in enumerate(raw):
        expression = ((selector or {}).get("cel") or {}).get("expression") if isinstance(
            selector, dict) else None
        where = f"{path}[{i}].cel.expression"
        if not isinstance(expression, str) or not expression.strip():
            errors.append(FieldError("Required", where))
            continue
        problem = cel.compile_error(expression)
        if problem:
            errors.append(FieldError("Invalid", where, problem, expression))


def _tolerations(raw: Any, path: str, errors: list[FieldError]) -> None:
    if raw is None:
        return
    if not isinstance(raw, list) or len(raw) > MAX_TOLERATIONS:
        errors.append(FieldError("Invalid", path,
                                 f"must have at most {MAX_TOLERATIONS} items", "..."))
        return
    for i, toleration in enumerate(raw):
        where = f"{path}[{i}]"
        if not isinstance(toleration, dict):
            errors.append(FieldError("Invalid", where, "must be an object", toleration))
            continue
        toleration.setdefault("operator", "Equal")
        operator = toleration["operator"]
        if operator not in ("Equal", "Exists"):
            errors.append(FieldError("NotSupported", f"{where}.operator",
                                     'supported values: "Equal", "Exists"', operator))
        if operator == "Exists" and toleration.get("value"):
            errors.append(FieldError("Invalid", f"{where}.operator",
                                     "value must be empty when `operator` is 'Exists'", operator))
        if not toleration.get("key") and operator != "Exists":
            errors.append(FieldError("Invalid", f"{where}.operator",
                                     "operator must be Exists when `key` is empty, which means "
                                     '"match all values and all keys"', operator))
        effect = toleration.get("effect")
        if effect and effect not in BLOCKING:
            errors.append(FieldError("NotSupported", f"{where}.effect",
                                     'supported values: "NoExecute", "NoSchedule"', effect))


def _capacity_requests(raw: Any, path: str, errors: list[FieldError]) -> None:
    for name, value in ((raw or {}).get("requests") or {}).items():
        if maybe_quantity(value) is None:
            errors.append(FieldError("Invalid", f"{path}.requests[{name}]",
                                     "must be a quantity", value))


def _exact(raw: Any, path: str, errors: list[FieldError], subrequest: bool) -> None:
    if not isinstance(raw, dict):
        errors.append(FieldError("Invalid", path, "must be an object", raw))
        return
    if not raw.get("deviceClassName"):
        errors.append(FieldError("Required", f"{path}.deviceClassName"))
    elif not DNS1123_SUBDOMAIN.match(str(raw["deviceClassName"])):
        errors.append(FieldError("Invalid", f"{path}.deviceClassName",
                                 "must be a DNS subdomain", raw["deviceClassName"]))
    mode = raw.setdefault("allocationMode", "ExactCount")
    if mode == "ExactCount":
        count = raw.setdefault("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            errors.append(FieldError("Invalid", f"{path}.count", "must be greater than zero",
                                     count))
    elif mode == "All":
        if raw.get("count") is not None:
            errors.append(FieldError("Invalid", f"{path}.count",
                                     'must not be specified when allocationMode is "All"',
                                     raw["count"]))
    else:
        errors.append(FieldError("NotSupported", f"{path}.allocationMode",
                                 'supported values: "All", "ExactCount"', mode))
    if subrequest and raw.get("adminAccess") is not None:
        errors.append(FieldError("Forbidden", f"{path}.adminAccess",
                                 "not supported in a subrequest"))
    _selectors(raw.get("selectors"), f"{path}.selectors", errors)
    _tolerations(raw.get("tolerations"), f"{path}.tolerations", errors)
    _capacity_requests(raw.get("capacity"), f"{path}.capacity", errors)


def validate_claim_spec(spec: Any, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if not isinstance(spec, dict):
        return [FieldError("Required", path)]
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or []
    if not isinstance(requests, list) or len(requests) > MAX_REQUESTS:
        return [FieldError("Invalid", f"{path}.devices.requests",
                           f"must be a list of at most {MAX_REQUESTS}", "...")]
    names: dict[str, set[str]] = {}
    for i, request in enumerate(requests):
        where = f"{path}.devices.requests[{i}]"
        if not isinstance(request, dict):
            errors.append(FieldError("Invalid", where, "must be an object", request))
            continue
        name = request.get("name")
        _label(name, f"{where}.name", errors)
        if isinstance(name, str) and name in names:
            errors.append(FieldError("Duplicate", f"{where}.name", value=name))
        subs: set[str] = set()
        exactly, first = request.get("exactly"), request.get("firstAvailable")
        if (exactly is None) == (first is None):
            errors.append(FieldError("Required", where,
                                     "exactly one of `exactly` or `firstAvailable` is required"))
        elif exactly is not None:
            _exact(exactly, f"{where}.exactly", errors, subrequest=False)
        else:
            if not isinstance(first, list) or len(first) > MAX_SUBREQUESTS:
                errors.append(FieldError("Invalid", f"{where}.firstAvailable",
                                         f"must have at most {MAX_SUBREQUESTS} items", "..."))
                first = []
            for j, sub in enumerate(first):
                sub_where = f"{where}.firstAvailable[{j}]"
                sub_name = (sub or {}).get("name") if isinstance(sub, dict) else None
                _label(sub_name, f"{sub_where}.name", errors)
                if isinstance(sub_name, str) and sub_name in subs:
                    errors.append(FieldError("Duplicate", f"{sub_where}.name", value=sub_name))
                subs.add(str(sub_name))
                _exact(sub, sub_where, errors, subrequest=True)
        if isinstance(name, str):
            names[name] = subs
    for i, constraint in enumerate(devices.get("constraints") or []):
        where = f"{path}.devices.constraints[{i}]"
        if not isinstance(constraint, dict):
            errors.append(FieldError("Invalid", where, "must be an object", constraint))
            continue
        for j, ref in enumerate(constraint.get("requests") or []):
            main, _, sub = str(ref).partition("/")
            if main not in names or (sub and sub not in names[main]):
                errors.append(FieldError("Invalid", f"{where}.requests[{j}]",
                                         "must be the name of a request in the claim or the "
                                         "name of a request and a subrequest separated by '/'",
                                         ref))
        set_fields = [k for k in ("matchAttribute", "distinctAttribute") if constraint.get(k)]
        if len(set_fields) != 1:
            errors.append(FieldError("Required", where,
                                     "exactly one of `matchAttribute` or `distinctAttribute` "
                                     "is required"))
        for key in set_fields:
            value = str(constraint[key])
            if "/" not in value or not QUALIFIED.match(value):
                errors.append(FieldError("Invalid", f"{where}.{key}",
                                         "a fully qualified name must be a domain and a name "
                                         "separated by a slash", value))
    return errors


def decode_error(kind: str, detail: str) -> StoreError:
    return StoreError(400, "BadRequest", f'{kind} in version "v1" cannot be handled as a '
                      f"{kind}: {detail}")


def prepare(kind: str, obj: KubeObject) -> None:
    """Decoding (JSON types), defaults and validation on create and update."""
    from tessera.kube_sim.dra.schemas import type_problem

    problem = type_problem(kind, obj)
    if problem:
        raise decode_error(kind, problem)
    try:
        _prepare(kind, obj)
    except (TypeError, AttributeError, ValueError) as exc:  # a scalar of the wrong type
        raise decode_error(kind, f"a field has a value of the wrong type ({exc})") from None


def _prepare(kind: str, obj: KubeObject) -> None:
    meta = obj.get("metadata") or {}
    errors = validate_name(meta)
    if kind == "DeviceClass":
        spec = obj.setdefault("spec", {})
        if not isinstance(spec, dict):
            errors.append(FieldError("Invalid", "spec", "must be an object", spec))
        else:
            _selectors(spec.get("selectors"), "spec.selectors", errors)
            name = spec.get("extendedResourceName")
            if name is not None and ("/" not in str(name) or not QUALIFIED.match(str(name))
                                     or str(name).startswith("kubernetes.io/")):
                errors.append(FieldError("Invalid", "spec.extendedResourceName",
                                         "must be a valid extended resource name", name))
    elif kind == "ResourceClaim":
        errors += validate_claim_spec(obj.get("spec"), "spec")
        obj.setdefault("status", {})
    elif kind == "ResourceClaimTemplate":
        template = obj.get("spec")
        if not isinstance(template, dict):
            errors.append(FieldError("Required", "spec"))
        else:
            errors += validate_claim_spec(template.get("spec"), "spec.spec")
    elif kind == "ResourceSlice":
        errors += validate_slice(obj)
    elif kind == taint_rules.KIND:
        errors += taint_rules.validate(obj)
    raise_if(kind, obj, errors)


ADMIN_NAMESPACE_LABEL = "resource.kubernetes.io/admin-access"


def check_admin_access(kind: str, obj: KubeObject, namespace_labels: dict[str, str]) -> None:
    """`adminAccess: true` only in a namespace labelled `resource.kubernetes.io/admin-access:
    "true"` (kube-apiserver's DRAAdminAccess rule, on create)."""
    if kind not in ("ResourceClaim", "ResourceClaimTemplate"):
        return
    spec, path = (obj.get("spec") or {}, "spec") if kind == "ResourceClaim" else (
        (obj.get("spec") or {}).get("spec") or {}, "spec.spec")
    if namespace_labels.get(ADMIN_NAMESPACE_LABEL) == "true":
        return
    errors = [
        FieldError("Forbidden", f"{path}.devices.requests[{i}].exactly.adminAccess",
                   f"admin access to devices requires the `{ADMIN_NAMESPACE_LABEL}: true` "
                   "label on the containing namespace")
        for i, request in enumerate((spec.get("devices") or {}).get("requests") or [])
        if isinstance(request, dict) and isinstance(request.get("exactly"), dict)
        and request["exactly"].get("adminAccess") is True
    ]
    raise_if(kind, obj, errors)


def check_update(kind: str, old: KubeObject, new: KubeObject) -> None:
    """The create rules (defaults first) on the result, then what an update may not change."""
    name = old["metadata"]["name"]
    prepare(kind, new)
    errors: list[FieldError] = []
    if kind == taint_rules.KIND:
        errors += taint_rules.validate(new, old)  # timeAdded follows a changed effect
    if kind in ("ResourceClaim", "ResourceClaimTemplate") and old.get("spec") != new.get("spec"):
        errors.append(FieldError("Invalid", "spec", "field is immutable", "..."))
    if kind == "ResourceSlice":
        old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
        for path, before, after in (
            ("spec.driver", old_spec.get("driver"), new_spec.get("driver")),
            ("spec.pool.name", (old_spec.get("pool") or {}).get("name"),
             (new_spec.get("pool") or {}).get("name")),
            ("spec.nodeName", old_spec.get("nodeName"), new_spec.get("nodeName")),
        ):
            if before != after:
                errors.append(FieldError("Invalid", path, "field is immutable", after))
    raise_if(kind, {"metadata": {"name": name}}, errors)


def validate_pod_claims(pod: KubeObject) -> None:
    """pod.spec.resourceClaims and containers' resources.claims, as kube-apiserver checks them."""
    spec = pod.get("spec") or {}
    errors: list[FieldError] = []
    names: set[str] = set()
    entries = spec.get("resourceClaims") or []
    if not isinstance(entries, list):
        raise_if("Pod", pod, [FieldError("Invalid", "spec.resourceClaims", "must be a list",
                                         "...")])
    for i, entry in enumerate(entries):
        where = f"spec.resourceClaims[{i}]"
        if not isinstance(entry, dict):
            errors.append(FieldError("Invalid", where, "must be an object", entry))
            continue
        _label(entry.get("name"), f"{where}.name", errors)
        if isinstance(entry.get("name"), str) and entry["name"] in names:
            errors.append(FieldError("Duplicate", f"{where}.name", value=entry.get("name")))
        names.add(str(entry.get("name")))
        sources = [k for k in ("resourceClaimName", "resourceClaimTemplateName") if entry.get(k)]
        if len(sources) != 1:
            errors.append(FieldError("Invalid", where, "must specify one of: "
                                     "`resourceClaimName`, `resourceClaimTemplateName`", "..."))
    for section in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(section) or []):
            resources = container.get("resources") if isinstance(container, dict) else None
            claims = (resources.get("claims") if isinstance(resources, dict) else None) or []
            if not isinstance(claims, list):
                errors.append(FieldError("Invalid", f"spec.{section}[{i}].resources.claims",
                                         "must be a list", "..."))
                continue
            for j, ref in enumerate(claims):
                name = ref.get("name") if isinstance(ref, dict) else None
                if not isinstance(name, str) or name not in names:
                    errors.append(FieldError(
                        "Invalid", f"spec.{section}[{i}].resources.claims[{j}].name",
                        "must be the name of an entry in pod.spec.resourceClaims", name))
    raise_if("Pod", pod, errors)
