"""ResourceSlices read into what the allocator works on: devices in pools, the nodes that reach
them, and what allocated claims already hold (exclusive devices, consumed capacity, counters).

Facts from the `resource.k8s.io/v1` API reference: a pool may span several slices; only the
slices at the pool's highest `pool.generation` count; a pool is complete when that many slices
(`resourceSliceCount`) are seen. Attribute and capacity names without a domain belong to the
driver's domain (`<driver>/<name>`). A slice reaches a node through exactly one of `nodeName`,
`nodeSelector`, `allNodes` or `perDeviceNodeSelection` (then each device says). Pure code.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tessera.kube_sim.dra.taint_rules import taints_for

from tessera.quantity import QuantityError
from tessera.quantity import parse as parse_quantity

KubeObject = dict[str, Any]
DeviceId = tuple[str, str, str]  # driver, pool, device


@functools.lru_cache(maxsize=65536)
def _parse_text(text: str) -> Fraction:
    value = parse_quantity(text).value
    # whole amounts as ints: the allocator's arithmetic on them is several times faster
    return value.numerator if value.denominator == 1 else value  # type: ignore[return-value]


def quantity(value: Any) -> Fraction:
    """An exact quantity (the texts slices repeat on every device are parsed once)."""
    return _parse_text(str(value)) if isinstance(value, str | int) else parse_quantity(
        value).value


def maybe_quantity(value: Any) -> Fraction | None:
    if value is None:
        return None
    try:
        return quantity(value)
    except QuantityError:
        return None


def qualify(driver: str, name: str) -> str:
    return name if "/" in name else f"{driver}/{name}"


@dataclass(frozen=True)
class RequestPolicy:
    default: Fraction | None = None
    valid_values: tuple[Fraction, ...] = ()
    minimum: Fraction | None = None
    maximum: Fraction | None = None
    step: Fraction | None = None
    has_range: bool = False


@dataclass(frozen=True)
class Capacity:
    value: Fraction
    policy: RequestPolicy | None = None


@dataclass
class Device:
    driver: str
    pool: str
    name: str
    attributes: dict[str, dict[str, Any]]  # qualified name -> DeviceAttribute
    capacity: dict[str, Capacity]  # name as published -> capacity
    allow_multiple: bool = False
    taints: list[dict[str, Any]] = field(default_factory=list)
    consumes: list[tuple[str, dict[str, Fraction]]] = field(default_factory=list)
    node_local: bool = True
    generation: int = 0
    # capacity requests -> what one share consumes (allocator.consumption), per device
    consumption_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def capacity_key(self) -> int:
        """What a share's consumption depends on, as a small number (devices publishing the
        same capacities and request policies share one, and so their consumption results)."""
        shape = (self.driver, tuple(sorted(self.capacity.items())))
        return _CAPACITY_SHAPES.setdefault(shape, len(_CAPACITY_SHAPES))

    @property
    def id(self) -> DeviceId:
        return (self.driver, self.pool, self.name)

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a selector can see of the device (its cached results are keyed by this)."""
        return json.dumps([self.driver, self.attributes, sorted(
            (n, str(c.value)) for n, c in self.capacity.items()), self.allow_multiple],
            sort_keys=True)

    def capacity_qualified(self) -> dict[str, Fraction]:
        return {qualify(self.driver, n): c.value for n, c in self.capacity.items()}

    def capacity_named(self, requested: str) -> str | None:
        """The published capacity name a request's key (qualified or not) refers to."""
        wanted = qualify(self.driver, requested)
        return next((n for n in self.capacity if qualify(self.driver, n) == wanted), None)


_CAPACITY_SHAPES: dict[tuple[Any, ...], int] = {}


@dataclass
class Pool:
    driver: str
    name: str
    generation: int
    slice_count: int
    slices_seen: int = 0
    devices: list[Device] = field(default_factory=list)
    counter_sets: dict[str, dict[str, Fraction]] = field(default_factory=dict)
    # (class selectors, request selectors, tolerations) -> the devices they admit: what needs
    # no search is worked out once per pool (a pool is rebuilt when its slices change)
    candidate_cache: dict[Any, list[Device]] = field(default_factory=dict, repr=False,
                                                     compare=False)

    @property
    def complete(self) -> bool:
        return self.slices_seen >= self.slice_count


def _policy(raw: Any) -> RequestPolicy | None:
    if not isinstance(raw, dict):
        return None
    rng = raw.get("validRange") if isinstance(raw.get("validRange"), dict) else None
    return RequestPolicy(
        default=maybe_quantity(raw.get("default")),
        valid_values=tuple(sorted(v for v in (maybe_quantity(x) for x in raw.get("validValues")
                                               or []) if v is not None)),
        minimum=maybe_quantity(rng.get("min")) if rng else None,
        maximum=maybe_quantity(rng.get("max")) if rng else None,
        step=maybe_quantity(rng.get("step")) if rng else None,
        has_range=rng is not None,
    )


def _counters(raw: Any) -> dict[str, Fraction]:
    found: dict[str, Fraction] = {}
    for name, counter in (raw or {}).items():
        value = maybe_quantity((counter or {}).get("value"))
        if value is not None:
            found[str(name)] = value
    return found


def device_of(driver: str, pool: str, raw: dict[str, Any], node_local: bool,
              generation: int) -> Device:
    capacity = {}
    for name, cap in (raw.get("capacity") or {}).items():
        value = maybe_quantity((cap or {}).get("value"))
        if value is not None:
            capacity[str(name)] = Capacity(value, _policy((cap or {}).get("requestPolicy")))
    return Device(
        driver=driver, pool=pool, name=str(raw.get("name", "")),
        attributes={qualify(driver, str(k)): v for k, v in (raw.get("attributes") or {}).items()
                    if isinstance(v, dict)},
        capacity=capacity,
        allow_multiple=bool(raw.get("allowMultipleAllocations")),
        taints=[t for t in raw.get("taints") or [] if isinstance(t, dict)],
        consumes=[(str(c.get("counterSet", "")), _counters(c.get("counters")))
                  for c in raw.get("consumesCounters") or [] if isinstance(c, dict)],
        node_local=node_local, generation=generation,
    )


def _requirement_matches(value: str | None, requirement: dict[str, Any]) -> bool:
    operator = requirement.get("operator")
    values = requirement.get("values") or []
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and values:
        try:
            a, b = int(value), int(values[0])
        except ValueError:
            return False
        return a > b if operator == "Gt" else a < b
    return False


def node_selector_matches(selector: Any, node: KubeObject) -> bool:
    """A core/v1 NodeSelector: any term matches; in a term, every expression/field matches."""
    if not isinstance(selector, dict):
        return False
    labels = (node.get("metadata") or {}).get("labels") or {}
    fields = {"metadata.name": (node.get("metadata") or {}).get("name")}
    for term in selector.get("nodeSelectorTerms") or []:
        expressions = term.get("matchExpressions") or []
        field_reqs = term.get("matchFields") or []
        if not expressions and not field_reqs:
            continue
        if all(_requirement_matches(labels.get(r.get("key")), r) for r in expressions) and all(
            _requirement_matches(fields.get(r.get("key")), r) for r in field_reqs
        ):
            return True
    return False


def _reaches(spec: dict[str, Any], node: KubeObject) -> bool:
    name = (node.get("metadata") or {}).get("name")
    if spec.get("nodeName"):
        return spec["nodeName"] == name
    if spec.get("allNodes"):
        return True
    if spec.get("nodeSelector"):
        return node_selector_matches(spec["nodeSelector"], node)
    return False


def newest_slices(slices: list[KubeObject]) -> list[KubeObject]:
    """Only the slices at each pool's highest generation."""
    newest: dict[tuple[str, str], int] = {}
    for s in slices:
        spec = s.get("spec") or {}
        key = (spec.get("driver", ""), (spec.get("pool") or {}).get("name", ""))
        newest[key] = max(newest.get(key, -1), int((spec.get("pool") or {}).get("generation")
                                                    or 0))
    return [s for s in slices if int(((s.get("spec") or {}).get("pool") or {}).get(
        "generation") or 0) == newest[((s.get("spec") or {}).get("driver", ""),
                                       ((s.get("spec") or {}).get("pool") or {}).get("name", ""))]]


def pools_for_node(slices: list[KubeObject], node: KubeObject | None,
                   rules: list[KubeObject] | None = None) -> list[Pool]:
    """The pools (newest generation) with the devices `node` reaches (all devices: None);
    each device with the taints DeviceTaintRules add to it (`rules`, taint_rules.py)."""
    pools: dict[tuple[str, str], Pool] = {}
    for s in newest_slices(slices):
        spec = s.get("spec") or {}
        driver = spec.get("driver", "")
        raw_pool = spec.get("pool") or {}
        key = (driver, raw_pool.get("name", ""))
        generation = int(raw_pool.get("generation") or 0)
        pool = pools.get(key)
        if pool is None:
            pool = pools[key] = Pool(driver, key[1], generation,
                                     int(raw_pool.get("resourceSliceCount") or 1))
        pool.slices_seen += 1
        for counter_set in spec.get("sharedCounters") or []:
            if isinstance(counter_set, dict):
                pool.counter_sets[str(counter_set.get("name", ""))] = _counters(
                    counter_set.get("counters"))
        per_device = bool(spec.get("perDeviceNodeSelection"))
        if not per_device and node is not None and not _reaches(spec, node):
            continue
        for raw in spec.get("devices") or []:
            if not isinstance(raw, dict):
                continue
            if per_device and node is not None and not _reaches(raw, node):
                continue
            local = bool(spec.get("nodeName")) or bool(raw.get("nodeName"))
            device = device_of(driver, key[1], raw, local, generation)
            if rules:
                device.taints = [*device.taints,
                                 *taints_for(rules, driver, key[1], device.name)]
            pool.devices.append(device)
    return list(pools.values())


def device_index(slices: list[KubeObject]) -> dict[DeviceId, Device]:
    return {d.id: d for p in pools_for_node(slices, None) for d in p.devices}


@dataclass
class Usage:
    """What allocated claims hold: exclusive devices, consumed capacity of shared ones, how many
    allocations use each device, and the shared counters the devices in use consume."""

    exclusive: set[DeviceId] = field(default_factory=set)
    consumed: dict[DeviceId, dict[str, Fraction]] = field(default_factory=dict)
    users: dict[DeviceId, int] = field(default_factory=dict)
    counters: dict[tuple[str, str, str], dict[str, Fraction]] = field(default_factory=dict)

    def take(self, device: Device, consumed: dict[str, Fraction] | None) -> None:
        if self.users.get(device.id, 0) == 0:
            for counter_set, counters in device.consumes:
                used = self.counters.setdefault((device.driver, device.pool, counter_set), {})
                for name, value in counters.items():
                    used[name] = used.get(name, 0) + value
        self.users[device.id] = self.users.get(device.id, 0) + 1
        if consumed is None:
            self.exclusive.add(device.id)
        else:
            held = self.consumed.setdefault(device.id, {})
            for name, value in consumed.items():
                held[name] = held.get(name, 0) + value

    def give_back(self, device: Device, consumed: dict[str, Fraction] | None) -> None:
        self.users[device.id] -= 1
        if consumed is None:
            self.exclusive.discard(device.id)
        else:
            held = self.consumed.get(device.id, {})
            for name, value in consumed.items():
                held[name] = held.get(name, 0) - value
        if self.users[device.id] == 0:
            del self.users[device.id]
            self.consumed.pop(device.id, None)
            for counter_set, counters in device.consumes:
                used = self.counters.get((device.driver, device.pool, counter_set), {})
                for name, value in counters.items():
                    used[name] = used.get(name, 0) - value


def usage_of(claims: list[KubeObject], devices: dict[DeviceId, Device],
             skip_uids: frozenset[str] = frozenset()) -> Usage:
    """What every allocated claim but `skip_uids` holds (admin access holds nothing)."""
    usage = Usage()
    for claim in claims:
        if (claim.get("metadata") or {}).get("uid") in skip_uids:
            continue
        for device, consumed in holdings(claim, devices):
            usage.take(device, consumed)
    return usage


def holdings(claim: KubeObject | None, devices: dict[DeviceId, Device]
             ) -> list[tuple[Device, dict[str, Fraction] | None]]:
    """What one claim's allocation holds: each device, with what its share consumes (None: the
    whole device); admin access holds nothing."""
    if not claim:
        return []
    allocation = (claim.get("status") or {}).get("allocation") or {}
    held: list[tuple[Device, dict[str, Fraction] | None]] = []
    for result in (allocation.get("devices") or {}).get("results") or []:
        if result.get("adminAccess"):
            continue
        device_id = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
        device = devices.get(device_id) or Device(*device_id, {}, {})
        if device.allow_multiple or result.get("shareID") or result.get("consumedCapacity"):
            held.append((device, {str(k): v for k, v in (
                (k, maybe_quantity(x)) for k, x in (result.get("consumedCapacity")
                                                   or {}).items()) if v is not None}))
        else:
            held.append((device, None))
    return held
