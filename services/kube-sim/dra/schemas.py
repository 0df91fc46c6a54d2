"""The fields of the resource.k8s.io/v1 kinds, for kube-apiserver's strict decoding
(`fieldValidation=Strict`, kubectl's default): a typo such as `exact:` or
`capacity: {request: ...}` is refused with `strict decoding error: unknown field "..."`. From the
API reference of k8s.io/api/resource/v1; opaque driver parameters and node selectors are open."""

from __future__ import annotations

from typing import Any

from tessera.kube_sim.schema import LEAF, MAP, OBJECT_META, OPEN, SCHEMAS, _fields

SELECTOR = _fields(cel=_fields("expression"))
TOLERATION = _fields("key", "operator", "value", "effect", "tolerationSeconds")
CAPACITY_REQUIREMENTS = _fields(requests=MAP)
_REQUEST_FIELDS = ("deviceClassName", "allocationMode", "count")
EXACT = _fields(*_REQUEST_FIELDS, "adminAccess", selectors=[SELECTOR],
                tolerations=[TOLERATION], capacity=CAPACITY_REQUIREMENTS)
SUBREQUEST = _fields("name", *_REQUEST_FIELDS, selectors=[SELECTOR], tolerations=[TOLERATION],
                     capacity=CAPACITY_REQUIREMENTS)
OPAQUE = _fields(opaque=_fields("driver", parameters=OPEN))
CLAIM_SPEC = _fields(devices=_fields(
    requests=[_fields("name", exactly=EXACT, firstAvailable=[SUBREQUEST])],
    constraints=[_fields("requests", "matchAttribute", "distinctAttribute")],
    config=[_fields("requests", opaque=OPAQUE["opaque"])],
))
DEVICE = _fields(
    "name", "allowMultipleAllocations", "nodeName", "allNodes", "bindsToNode",
    "bindingConditions", "bindingFailureConditions",
    attributes=MAP, capacity=MAP, nodeSelector=OPEN,
    consumesCounters=[_fields("counterSet", counters=MAP)],
    taints=[_fields("key", "value", "effect", "timeAdded")],
)
SLICE_SPEC = _fields(
    "driver", "nodeName", "allNodes", "perDeviceNodeSelection",
    pool=_fields("name", "generation", "resourceSliceCount"), nodeSelector=OPEN,
    devices=[DEVICE], sharedCounters=[_fields("name", counters=MAP)],
)
CLASS_SPEC = _fields("extendedResourceName", selectors=[SELECTOR],
                     config=[_fields(opaque=OPAQUE["opaque"])])


def _kind(spec: object) -> dict[str, object]:
    return _fields("apiVersion", "kind", metadata=OBJECT_META, spec=spec, status=OPEN)


SCHEMAS.update({
    "DeviceClass": _kind(CLASS_SPEC),
    "ResourceClaim": _kind(CLAIM_SPEC),
    "ResourceClaimTemplate": _kind(_fields(metadata=OBJECT_META, spec=CLAIM_SPEC)),
    "ResourceSlice": _kind(SLICE_SPEC),
})


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def type_problem(kind: str, obj: Any) -> str | None:
    """The first value whose JSON type cannot decode into the Go type (an object where a list
    belongs, a string where an object belongs...), worded as Go's decoder: None if all fit."""
    schema = SCHEMAS.get(kind)
    return _check(schema, obj, kind) if schema is not None else None


def _check(schema: Any, value: Any, path: str) -> str | None:
    if value is None or schema is OPEN:
        return None
    if schema is LEAF:
        if isinstance(value, dict) or (isinstance(value, list) and any(
                isinstance(v, dict | list) for v in value)):
            return f"json: cannot unmarshal {_json_type(value)} into Go struct field {path}"
        return None
    if schema is MAP or isinstance(schema, dict):
        if not isinstance(value, dict):
            return (f"json: cannot unmarshal {_json_type(value)} into Go struct field {path} "
                    "of type object")
        if schema is MAP:
            return None
        for key, item in value.items():
            if key in schema:
                found = _check(schema[key], item, f"{path}.{key}")
                if found:
                    return found
        return None
    if isinstance(schema, list):
        if not isinstance(value, list):
            return (f"json: cannot unmarshal {_json_type(value)} into Go struct field {path} "
                    "of type array")
        for item in value:
            found = _check(schema[0], item, path)
            if found:
                return found
    return None
