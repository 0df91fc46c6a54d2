"""Defaulting and validation of the objects kube-sim stores, worded as kube-apiserver words it.

An invalid object is refused with 422 `Invalid` and a `metav1.Status` whose message reads
`Pod "x" is invalid: <field>: <error>` (several errors: `[e1, e2]`) and whose `details.causes`
list each field error (`FieldValueRequired`, `FieldValueInvalid`, `FieldValueNotSupported`).
The rules are the documented ones kube-sim's users meet: containers and images required;
extended resources (names outside `kubernetes.io/`, e.g. `nvidia.com/gpu`) are whole numbers,
need a limit, and a request must equal it ("Limit must be set for non overcommitable
resources", "must be equal to nvidia.com/gpu limit of 1"); a limit without a request defaults
the request to it; workloads need a selector that matches their template's labels; a Job's pods
restart `Never` or `OnFailure`. Pure functions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tessera.kube_sim.discovery import by_kind
from tessera.kube_sim.quantity import QuantityError, parse
from tessera.kube_sim.selectors import SelectorError, from_label_selector, labels_match
from tessera.kube_sim.store import KubeObject, StoreError

DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SUBDOMAIN_HELP = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_HELP = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)


def _go_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        inner = ", ".join(f"{json.dumps(str(k))}:{json.dumps(str(v))}" for k, v in value.items())
        return f"map[string]string{{{inner}}}"
    return str(value)


@dataclass(frozen=True)
class FieldError:
    """One `field.Error`: its type decides the wording, as apimachinery's ErrorBody does."""

    type: str  # Required, Invalid, NotSupported, Forbidden, Duplicate
    field: str
    detail: str = ""
    value: Any = None

    def body(self) -> str:
        if self.type == "Required":
            text = "Required value"
        elif self.type == "Forbidden":
            text = "Forbidden"
        elif self.type == "Duplicate":
            text = f"Duplicate value: {_go_value(self.value)}"
        elif self.type == "NotSupported":
            text = f"Unsupported value: {_go_value(self.value)}"
        else:
            text = f"Invalid value: {_go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"

    def cause(self) -> dict[str, str]:
        reasons = {
            "Required": "FieldValueRequired", "Invalid": "FieldValueInvalid",
            "NotSupported": "FieldValueNotSupported", "Forbidden": "FieldValueForbidden",
            "Duplicate": "FieldValueDuplicate",
        }
        return {"reason": reasons[self.type], "message": self.body(), "field": self.field}


def invalid(kind: str, name: str, errors: list[FieldError]) -> StoreError:
    """kube-apiserver's NewInvalid: 422 with the aggregate message and one cause per error."""
    found = by_kind(kind)
    qualified = found.qualified_kind if found else kind
    aggregate = str(errors[0]) if len(errors) == 1 else f"[{', '.join(map(str, errors))}]"
    details: dict[str, Any] = {"name": name, "kind": kind,
                               "causes": [e.cause() for e in errors]}
    if found and found.group:
        details["group"] = found.group
    return StoreError(422, "Invalid", f'{qualified} "{name}" is invalid: {aggregate}', details)


def raise_if(kind: str, obj: KubeObject, errors: list[FieldError]) -> None:
    if errors:
        meta = obj.get("metadata") or {}
        raise invalid(kind, meta.get("name") or meta.get("generateName") or "", errors)


# --- resources ---------------------------------------------------------------------------------


def is_native(name: str) -> bool:
    return "/" not in name or name.startswith("kubernetes.io/") or ".kubernetes.io/" in name


def overcommit_allowed(name: str) -> bool:
    """Native resources but hugepages may overcommit; extended resources may not."""
    return is_native(name) and not name.startswith("hugepages-")


def default_resources(container: dict[str, Any]) -> None:
    """A limit without a request sets the request to the limit (kube-apiserver defaulting)."""
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return
    limits = resources.get("limits") or {}
    if not isinstance(limits, dict) or not limits:
        return
    requests = resources.setdefault("requests", {})
    if isinstance(requests, dict):
        for name, value in limits.items():
            requests.setdefault(name, value)


def validate_resources(resources: Any, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if not isinstance(resources, dict):
        return errors
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    parsed: dict[str, dict[str, Any]] = {"limits": {}, "requests": {}}
    for section, values in (("limits", limits), ("requests", requests)):
        if not isinstance(values, dict):
            errors.append(FieldError("Invalid", f"{path}.{section}", "must be a map", values))
            continue
        for name, raw in values.items():
            where = f"{path}.{section}[{name}]"
            try:
                quantity = parse(raw)
            except QuantityError as exc:
                errors.append(FieldError("Invalid", where, str(exc), str(raw)))
                continue
            if quantity < 0:
                errors.append(FieldError("Invalid", where, "must be greater than or equal to 0",
                                         str(raw)))
            elif not is_native(name) and quantity.denominator != 1:
                errors.append(FieldError("Invalid", where, "must be an integer", str(raw)))
            parsed[section][name] = quantity
    for name, quantity in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        if limit is not None:
            if quantity != limit and not overcommit_allowed(name):
                errors.append(FieldError(
                    "Invalid", f"{path}.requests",
                    f"must be equal to {name} limit of {limits[name]}", str(requests[name]),
                ))
            elif quantity > limit:
                errors.append(FieldError(
                    "Invalid", f"{path}.requests",
                    f"must be less than or equal to {name} limit of {limits[name]}",
                    str(requests[name]),
                ))
        elif name not in limits and not overcommit_allowed(name):
            errors.append(FieldError(
                "Required", f"{path}.limits", "Limit must be set for non overcommitable resources"
            ))
    return errors


# --- pods --------------------------------------------------------------------------------------


def validate_name(meta: dict[str, Any], path: str = "metadata") -> list[FieldError]:
    name = meta.get("name")
    if not name:
        if meta.get("generateName"):
            return []
        return [FieldError("Required", f"{path}.name", "name or generateName is required")]
    if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        return [FieldError("Invalid", f"{path}.name", SUBDOMAIN_HELP, name)]
    return []


def default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    # Wrong shapes are left for validate_pod_spec to refuse with the field named (never a 500).
    sections = [spec.get("initContainers"), spec.get("containers")]
    for container in [c for items in sections if isinstance(items, list) for c in items]:
        if isinstance(container, dict):
            default_resources(container)
            container.setdefault("imagePullPolicy", "IfNotPresent")
            container.setdefault("terminationMessagePath", "/dev/termination-log")


def validate_pod_spec(spec: Any, path: str) -> list[FieldError]:
    if not isinstance(spec, dict):
        return [FieldError("Required", path)]
    errors: list[FieldError] = []
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        errors.append(FieldError("Required", f"{path}.containers"))
        containers = []
    seen: set[str] = set()
    for section, items in (("initContainers", spec.get("initContainers") or []),
                           ("containers", containers)):
        if not isinstance(items, list):
            errors.append(FieldError("Invalid", f"{path}.{section}", "must be a list", items))
            continue
        for index, container in enumerate(items):
            where = f"{path}.{section}[{index}]"
            if not isinstance(container, dict):
                errors.append(FieldError("Invalid", where, "must be an object", container))
                continue
            name = container.get("name")
            if not name:
                errors.append(FieldError("Required", f"{where}.name"))
            elif not DNS1123_LABEL.match(str(name)):
                errors.append(FieldError("Invalid", f"{where}.name", LABEL_HELP, name))
            elif name in seen:
                errors.append(FieldError("Duplicate", f"{where}.name", value=name))
            else:
                seen.add(str(name))
            if not container.get("image"):
                errors.append(FieldError("Required", f"{where}.image"))
            errors += validate_resources(container.get("resources"), f"{where}.resources")
    policy = spec.get("restartPolicy", "Always")
    if policy not in ("Always", "OnFailure", "Never"):
        errors.append(FieldError("NotSupported", f"{path}.restartPolicy",
                                 'supported values: "Always", "OnFailure", "Never"', policy))
    return errors


def prepare_pod(pod: KubeObject) -> None:
    """Defaults, then validation (raises 422) for a pod about to be created."""
    spec = pod.get("spec")
    if isinstance(spec, dict):
        default_pod_spec(spec)
    raise_if("Pod", pod, validate_name(pod.get("metadata") or {}) +
             validate_pod_spec(spec, "spec"))


def validate_pod(pod: KubeObject) -> None:
    """Validation only (after the mutating webhook, as kube-apiserver orders it)."""
    spec = pod.get("spec")
    if isinstance(spec, dict):
        for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            if isinstance(container, dict):
                default_resources(container)
    raise_if("Pod", pod, validate_name(pod.get("metadata") or {}) +
             validate_pod_spec(spec, "spec"))


# --- workloads ---------------------------------------------------------------------------------


def _validate_template(spec: dict[str, Any], require_selector: bool) -> list[FieldError]:
    errors: list[FieldError] = []
    template = spec.get("template")
    if not isinstance(template, dict):
        return [FieldError("Required", "spec.template")]
    labels = (template.get("metadata") or {}).get("labels") or {}
    selector = spec.get("selector")
    if require_selector and not selector:
        errors.append(FieldError("Required", "spec.selector"))
    elif selector:
        try:
            requirements = from_label_selector(selector)
        except SelectorError as exc:
            return [FieldError("Invalid", "spec.selector", str(exc), selector)]
        if not requirements:
            errors.append(FieldError("Invalid", "spec.selector",
                                     "empty selector is invalid for deployment", selector))
        elif not labels_match(requirements, labels):
            errors.append(FieldError("Invalid", "spec.template.metadata.labels",
                                     "`selector` does not match template `labels`", labels))
    template_spec = template.get("spec")
    if isinstance(template_spec, dict):
        default_pod_spec(template_spec)
    errors += validate_pod_spec(template_spec, "spec.template.spec")
    return errors


def _non_negative(spec: dict[str, Any], field: str) -> list[FieldError]:
    value = spec.get(field)
    if value is None:
        return []
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return [FieldError("Invalid", f"spec.{field}", "must be greater than or equal to 0",
                           value)]
    return []


def prepare_workload(kind: str, obj: KubeObject) -> None:
    """Defaults and validation of a Deployment, ReplicaSet or Job (raises 422)."""
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        raise_if(kind, obj, [FieldError("Required", "spec")])
    errors = validate_name(obj.get("metadata") or {})
    if kind in ("Deployment", "ReplicaSet"):
        spec.setdefault("replicas", 1)
        errors += _non_negative(spec, "replicas")
        if kind == "Deployment":
            spec.setdefault("strategy", {"type": "RollingUpdate", "rollingUpdate": {
                "maxUnavailable": "25%", "maxSurge": "25%"}})
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("progressDeadlineSeconds", 600)
        errors += _validate_template(spec, require_selector=True)
    elif kind == "Job":
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
        for field in ("parallelism", "completions", "backoffLimit"):
            errors += _non_negative(spec, field)
        template = spec.get("template")
        if isinstance(template, dict):
            template_spec = template.setdefault("spec", {})
            if isinstance(template_spec, dict):
                policy = template_spec.get("restartPolicy")
                if policy not in ("OnFailure", "Never"):
                    errors.append(FieldError(
                        "NotSupported" if policy else "Required",
                        "spec.template.spec.restartPolicy",
                        'supported values: "OnFailure", "Never"' if policy
                        else 'valid values: "OnFailure", "Never"',
                        policy,
                    ))
        errors += _validate_template(spec, require_selector=False)
    raise_if(kind, obj, errors)
