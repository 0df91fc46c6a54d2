"""Request bodies in `application/vnd.kubernetes.protobuf`, read as kube-apiserver reads them.

kubectl's typed clients send protobuf for built-in kinds (`kubectl create namespace|deployment|
job|quota`, `kubectl run`); client-go falls back to JSON on 415 only for CBOR, never for
protobuf ("generated clients accessing built-in kube resources are forced to protobuf"), so a
server that refuses protobuf makes those commands fail. kube-sim decodes the body into the
object's JSON form and handles it as any JSON write; its replies stay JSON, which kubectl
accepts (it asks `Accept: application/vnd.kubernetes.protobuf, */*`).

The envelope (k8s.io/apimachinery runtime serializer/protobuf): the 4 bytes `k8s\\x00`, then a
`runtime.Unknown` {typeMeta {apiVersion, kind}, raw (the object), contentEncoding,
contentType}. Field numbers: `protobuf_types.MESSAGES`. Scalars that are zero are left out,
as Go's JSON `omitempty` leaves them out, except the pointer fields where 0 means something
(`replicas: 0`). Pure; raises ProtobufError with a sentence.
"""

from __future__ import annotations

import base64
import json
import struct
from datetime import UTC, datetime
from typing import Any

from tessera.kube_sim.protobuf_types import MESSAGES
from tessera.kube_sim.store import StoreError

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"
ROOTS = {
    ("v1", "Namespace"): "core.Namespace", ("v1", "ResourceQuota"): "core.ResourceQuota",
    ("v1", "Pod"): "core.Pod", ("v1", "ConfigMap"): "core.ConfigMap",
    ("v1", "Secret"): "core.Secret", ("apps/v1", "Deployment"): "apps.Deployment",
    ("batch/v1", "Job"): "batch.Job", ("scheduling.k8s.io/v1", "PriorityClass"):
    "scheduling.PriorityClass", ("policy/v1", "PodDisruptionBudget"): "policy.PodDisruptionBudget",
}
# *int32 / *int64 / *bool fields whose zero is a value, not an absence (Go pointers)
KEEP_ZERO = frozenset({
    "replicas", "parallelism", "completions", "backoffLimit", "activeDeadlineSeconds",
    "terminationGracePeriodSeconds", "ttlSecondsAfterFinished", "revisionHistoryLimit",
    "progressDeadlineSeconds", "suspend", "priority", "value", "deletionGracePeriodSeconds",
    "backoffLimitPerIndex", "maxFailedIndexes",
})
MAX_DEPTH = 64


class ProtobufError(ValueError):
    """A malformed body (400)."""


class UnsupportedKind(ProtobufError):
    """A kind kube-sim does not read in protobuf (415: send JSON)."""


def read(raw: bytes) -> dict[str, Any]:
    """`decode_body` with kube-apiserver's answers: 400 for a malformed body, 415 for a kind
    kube-sim cannot read in protobuf."""
    try:
        return decode_body(raw)
    except UnsupportedKind as exc:
        raise StoreError(415, "UnsupportedMediaType", str(exc)) from None
    except (ProtobufError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            struct.error, RecursionError) as exc:  # hostile bytes: a 400, never a 500
        raise StoreError(400, "BadRequest", f"the protobuf body cannot be decoded: {exc}") \
            from None


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON form of a protobuf request body (ProtobufError for anything else)."""
    if not raw.startswith(MAGIC):
        raise ProtobufError("the body is not a Kubernetes protobuf object (no k8s magic prefix)")
    unknown = _message(raw[len(MAGIC):], "runtime.Unknown", 0)
    type_meta = unknown.get("typeMeta") or {}
    api_version, kind = type_meta.get("apiVersion", ""), type_meta.get("kind", "")
    if unknown.get("contentEncoding"):
        raise UnsupportedKind(f"content encoding {unknown['contentEncoding']!r} is not supported")
    root = ROOTS.get((api_version, kind))
    if root is None:
        raise UnsupportedKind(f"kube-sim does not read {kind or 'this kind'} ({api_version}) in "
                            f"protobuf; send it as JSON (kubectl create -f / apply -f)")
    raw_object = base64.b64decode(unknown.get("raw", ""))
    return {"apiVersion": api_version, "kind": kind, **_message(raw_object, root, 0)}


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    """(number, wire type, value) of every field: varints as ints, fixed as bytes."""
    out: list[tuple[int, int, Any]] = []
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > end:
                raise ProtobufError("truncated protobuf body")
            value, pos = data[pos:pos + size], pos + size
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ProtobufError(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise ProtobufError("truncated protobuf body")
        out.append((number, wire, value))
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ProtobufError("malformed protobuf varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _message(data: bytes, name: str, depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise ProtobufError("protobuf body nested too deeply")
    schema = MESSAGES[name]
    obj: dict[str, Any] = {}
    for number, wire, raw in _fields(data):
        field = schema.get(number)
        if field is None or field[1] == "skip":
            continue  # unknown to this table: dropped, as a decoder of an older version would
        json_name, type_name = field[0], field[1]
        label = field[2] if len(field) == 3 else "one"
        if label == "map":
            entry = dict((n, v) for n, _, v in _fields(raw))
            key = entry.get(1, b"").decode()
            value = _value(entry[2], type_name, depth) if 2 in entry else _zero(type_name)
            obj.setdefault(json_name, {})[key] = value
        elif label == "repeated":
            if wire == 2 and type_name in ("int32", "int64", "bool"):  # packed
                values, pos = [], 0
                while pos < len(raw):
                    number_value, pos = _varint(raw, pos)
                    values.append(_scalar(number_value, type_name))
                obj.setdefault(json_name, []).extend(values)
            else:
                obj.setdefault(json_name, []).append(_value(raw, type_name, depth))
        else:
            value = _value(raw, type_name, depth)
            if value in ("", 0, False, None) and json_name not in KEEP_ZERO \
                    and not isinstance(value, dict):
                continue
            obj[json_name] = value
    return obj


def _zero(type_name: str) -> Any:
    return "" if type_name in ("string", "bytes", "resource.Quantity") else 0


def _scalar(value: int, type_name: str) -> Any:
    if type_name == "bool":
        return bool(value)
    if value >= 1 << 63:  # negative int32/int64 are sent as 10-byte two's complement
        value -= 1 << 64
    return value


def _value(raw: Any, type_name: str, depth: int) -> Any:
    if type_name in ("int32", "int64", "uint32", "uint64", "bool"):
        return _scalar(raw, type_name)
    if type_name == "string":
        return raw.decode("utf-8", "replace")
    if type_name == "bytes":
        return base64.b64encode(raw).decode()  # []byte is base64 in JSON
    if type_name == "double":
        return struct.unpack("<d", raw)[0]
    if type_name == "float":
        return struct.unpack("<f", raw)[0]
    inner = {n: v for n, _, v in _fields(raw)}
    if type_name == "resource.Quantity":
        return inner.get(1, b"0").decode()
    if type_name == "intstr.IntOrString":
        return inner.get(3, b"").decode() if inner.get(1) == 1 else _scalar(inner.get(2, 0),
                                                                            "int32")
    if type_name in ("meta.Time", "meta.MicroTime"):
        seconds = _scalar(inner.get(1, 0), "int64")
        if not seconds:
            return None  # Go's zero Time marshals as null
        stamp = datetime.fromtimestamp(seconds, UTC)
        if type_name == "meta.MicroTime":
            micros = _scalar(inner.get(2, 0), "int32") // 1000
            return stamp.replace(microsecond=micros).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
    if type_name == "meta.Duration":
        return f"{_scalar(inner.get(1, 0), 'int64') / 1e9:g}s"
    if type_name in ("meta.FieldsV1", "runtime.RawExtension"):
        try:
            return json.loads(inner.get(1, b"null") or b"null")
        except ValueError as exc:
            raise ProtobufError(f"embedded JSON is malformed: {exc}") from None
    if type_name not in MESSAGES:
        return None
    return _message(raw, type_name, depth + 1)
