"""A claim's requests as the allocator reads them, and the per-device rules that need no search:
which alternative (the request itself, or each `firstAvailable` subrequest in order) asks for
what, whether tolerations tolerate a device taint, and what one share of a device consumes
under its capacities' request policies (KEP-5075). Pure code."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tessera.kube_sim.dra.model import Device, KubeObject, maybe_quantity


@dataclass
class Alternative:
    """One way to satisfy a request: the request itself, or one subrequest of firstAvailable."""

    result_name: str  # "gpu" or "gpu/small"
    class_name: str
    selectors: list[str]
    mode: str = "ExactCount"
    count: int = 1
    capacity: dict[str, Fraction] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    admin_access: bool = False

    @functools.cached_property
    def capacity_key(self) -> tuple[tuple[str, Fraction], ...]:
        return tuple(sorted(self.capacity.items()))

    @functools.cached_property
    def tolerations_key(self) -> str:
        return json.dumps(self.tolerations, sort_keys=True)


@dataclass
class Request:
    name: str
    alternatives: list[Alternative]


def _quantities(raw: Any) -> dict[str, Fraction]:
    found = {}
    for name, value in (raw or {}).items():
        parsed = maybe_quantity(value)
        if parsed is not None:
            found[str(name)] = parsed
    return found


def _alternative(result_name: str, raw: dict[str, Any]) -> Alternative:
    return Alternative(
        result_name=result_name,
        class_name=str(raw.get("deviceClassName", "")),
        selectors=[str((s.get("cel") or {}).get("expression", ""))
                   for s in raw.get("selectors") or [] if isinstance(s, dict)],
        mode=str(raw.get("allocationMode") or "ExactCount"),
        count=int(raw.get("count") or 1),
        capacity=_quantities((raw.get("capacity") or {}).get("requests")),
        tolerations=[t for t in raw.get("tolerations") or [] if isinstance(t, dict)],
        admin_access=bool(raw.get("adminAccess")),
    )


def requests_of(claim: KubeObject) -> list[Request]:
    meta = claim.get("metadata") or {}
    key = (meta.get("uid", ""), meta.get("resourceVersion", ""))
    if all(key) and key in _REQUESTS_CACHE:
        return _REQUESTS_CACHE[key]
    found = _parse_requests(claim)
    if all(key):
        if len(_REQUESTS_CACHE) > 50_000:
            _REQUESTS_CACHE.clear()
        _REQUESTS_CACHE[key] = found
    return found


def _parse_requests(claim: KubeObject) -> list[Request]:
    devices = ((claim.get("spec") or {}).get("devices") or {})
    found = []
    for raw in devices.get("requests") or []:
        name = str(raw.get("name", ""))
        if raw.get("exactly"):
            found.append(Request(name, [_alternative(name, raw["exactly"])]))
        elif raw.get("firstAvailable"):
            found.append(Request(name, [_alternative(f"{name}/{sub.get('name', '')}", sub)
                                        for sub in raw["firstAvailable"]]))
    return found


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        operator = toleration.get("operator") or "Equal"
        if operator == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and (
            (toleration.get("value") or "") == (taint.get("value") or "")
        ):
            return True
    return False


def consumption(device: Device, wanted: dict[str, Fraction],
                wanted_key: tuple[Any, ...] | None = None) -> dict[str, Fraction] | None:
    """What one share of `device` consumes for capacity requests `wanted` (by published name),
    rounded by each capacity's request policy; None: the request violates a policy or asks
    for a capacity the device does not have. Cached per (capacities and policies, request):
    the devices of one model compute it once."""
    key = wanted_key if wanted_key is not None else tuple(sorted(wanted.items()))
    cache = _CONSUMPTION_CACHE.get(device.capacity_key)
    if cache is None:
        cache = _CONSUMPTION_CACHE[device.capacity_key] = {}
    found = cache.get(key, _MISSING)
    if found is _MISSING:
        found = _consumption(device, wanted)
        if len(cache) > 100_000:
            cache.clear()
        cache[key] = found
    return dict(found) if found is not None else None  # type: ignore[arg-type]


def _consumption(device: Device, wanted: dict[str, Fraction]) -> dict[str, Fraction] | None:
    consumed: dict[str, Fraction] = {}
    named = {}
    for key, amount in wanted.items():
        name = device.capacity_named(key)
        if name is None:
            return None
        named[name] = amount
    for name, cap in device.capacity.items():
        policy = cap.policy
        amount = named.get(name)
        if amount is None:
            amount = policy.default if policy and policy.default is not None else cap.value
        elif policy is not None:
            if policy.valid_values:
                fitting = [v for v in policy.valid_values if v >= amount]
                if not fitting:
                    return None
                amount = fitting[0]
            elif policy.has_range:
                if policy.minimum is not None and amount < policy.minimum:
                    amount = policy.minimum
                if policy.step:
                    base = policy.minimum or 0
                    steps = -(-(amount - base) // policy.step)
                    amount = base + steps * policy.step
                if policy.maximum is not None and amount > policy.maximum:
                    return None
        consumed[name] = amount
    return consumed


_REQUESTS_CACHE: dict[tuple[str, str], list[Request]] = {}
_CONSUMPTION_CACHE: dict[int, dict[tuple[Any, ...], dict[str, Fraction] | None]] = {}
_MISSING = object()
