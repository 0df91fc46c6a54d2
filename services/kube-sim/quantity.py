"""Quantities in kube-sim: read as exact fractions (the grammar is the contract's,
`tessera.quantity`), and written back in canonical form on every object kube-sim stores, as
kube-apiserver's decoding does (a Go `resource.Quantity` field is re-serialised canonically:
`3000` → `3k`, `1.5Gi` → `1536Mi`). Reads, watch events and the AdmissionReview's `object` all
carry what is stored, so they are canonical too.

`QUANTITY_FIELDS` names every Quantity-typed field of the kinds kube-sim serves (the Go types
of k8s.io/api), so nothing else that looks like a number is touched.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any

from tessera.quantity import QuantityError
from tessera.quantity import parse as parse_quantity

__all__ = ["QuantityError", "canonicalise", "parse", "text"]


def parse(value: object) -> Fraction:
    if type(value) is str:
        return _parsed_text(value)
    return parse_quantity(value).value


@functools.lru_cache(maxsize=4096)
def _parsed_text(value: str) -> Fraction:  # (Fractions are immutable: safe to share)
    return parse_quantity(value).value


def text(value: Fraction) -> str:
    """A compact canonical form (integers plain, else milli)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{round(value * 1000)}m"


# Paths inside a PodSpec (`*` = every item of a list, `{}` = every value of a map).
_CONTAINER = ("resources.limits.{}", "resources.requests.{}")
_POD_SPEC = (
    *(f"{section}.*.{path}" for section in ("containers", "initContainers", "ephemeralContainers")
      for path in _CONTAINER),
    "overhead.{}", "resources.limits.{}", "resources.requests.{}",
    "volumes.*.emptyDir.sizeLimit",
    "volumes.*.ephemeral.volumeClaimTemplate.spec.resources.requests.{}",
    "volumes.*.ephemeral.volumeClaimTemplate.spec.resources.limits.{}",
)
_POD_STATUS = tuple(
    f"{section}.*.{path}"
    for section in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses")
    for path in ("allocatedResources.{}", "resources.limits.{}", "resources.requests.{}")
)
_LIMIT = tuple(f"spec.limits.*.{key}.{{}}" for key in (
    "max", "min", "default", "defaultRequest", "maxLimitRequestRatio"))
QUANTITY_FIELDS: dict[str, tuple[str, ...]] = {
    "Pod": (*(f"spec.{p}" for p in _POD_SPEC), *(f"status.{p}" for p in _POD_STATUS)),
    "PodTemplate": tuple(f"template.spec.{p}" for p in _POD_SPEC),
    "ReplicaSet": tuple(f"spec.template.spec.{p}" for p in _POD_SPEC),
    "Deployment": tuple(f"spec.template.spec.{p}" for p in _POD_SPEC),
    "StatefulSet": tuple(f"spec.template.spec.{p}" for p in _POD_SPEC),
    "DaemonSet": tuple(f"spec.template.spec.{p}" for p in _POD_SPEC),
    "Job": tuple(f"spec.template.spec.{p}" for p in _POD_SPEC),
    "CronJob": tuple(f"spec.jobTemplate.spec.template.spec.{p}" for p in _POD_SPEC),
    "ResourceQuota": ("spec.hard.{}", "status.hard.{}", "status.used.{}"),
    "LimitRange": _LIMIT,
    "Node": ("status.capacity.{}", "status.allocatable.{}"),
    "PersistentVolumeClaim": ("spec.resources.requests.{}", "spec.resources.limits.{}",
                              "status.capacity.{}", "status.allocatedResources.{}"),
}
_STEPS = {kind: tuple(p.split(".") for p in paths) for kind, paths in QUANTITY_FIELDS.items()}


def register(kind: str, paths: tuple[str, ...]) -> None:
    """The Quantity fields of a kind served by another module (dra/objects.py)."""
    QUANTITY_FIELDS[kind] = paths
    _STEPS[kind] = tuple(p.split(".") for p in paths)


def canonicalise(kind: str, obj: Any) -> None:
    """Rewrite every quantity of `obj` (a `kind`) in canonical form, in place. A value that is
    no quantity raises QuantityError with Go's message (the caller words the 400)."""
    for steps in _STEPS.get(kind, ()):
        _walk(obj, steps)


@functools.lru_cache(maxsize=4096)
def _canonical_text(value: str) -> str:
    return parse_quantity(value).canonical()


def _canonical(value: object) -> str:
    """`value`'s canonical form; a text seen before is not parsed again (every write of a pod
    re-canonicalises its quantities, and a burst of pods repeats the same few amounts)."""
    if type(value) is str:
        return _canonical_text(value)
    return parse_quantity(value).canonical()


def _walk(node: Any, steps: list[str]) -> None:
    if not steps or node is None:
        return
    step, rest = steps[0], steps[1:]
    if step == "*":
        if isinstance(node, list):
            for index, item in enumerate(node):
                if rest:
                    _walk(item, rest)
                elif item is not None:  # a list of quantities (DRA validValues)
                    node[index] = _canonical(item)
        return
    if not isinstance(node, dict):
        return
    if step == "{}":
        for key, value in list(node.items()):
            if value is None:
                continue
            if rest:  # a map of objects holding quantities (DRA capacities, counters)
                _walk(value, rest)
            else:
                node[key] = _canonical(value)
        return
    if step in node and not rest:  # a single quantity (emptyDir.sizeLimit)
        if node[step] is not None:
            node[step] = _canonical(node[step])
    elif step in node:
        _walk(node[step], rest)
