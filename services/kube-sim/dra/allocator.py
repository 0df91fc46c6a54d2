"""The structured allocator, as kube-scheduler's DynamicResources plugin runs it (pure).

For one pod on one node: every claim not yet allocated gets devices from the pools the node
reaches, or none does. The rules are the `resource.k8s.io/v1` API reference's:

- a request is `exactly` one (DeviceClass, selectors, `allocationMode` ExactCount with `count`
  (default 1) or All, `capacity.requests`, `tolerations`, `adminAccess`) or `firstAvailable`: a
  list of subrequests tried in order (the result names `<request>/<subrequest>`);
- a device qualifies when every class selector and request selector (CEL) is true, every taint
  is tolerated (`NoSchedule`/`NoExecute`), and each requested capacity can be met;
- a device without `allowMultipleAllocations` goes to one request of one claim; one with it is
  shared: each allocation consumes capacity (the request, or the policy's `default`, or all of
  it), rounded up by the capacity's `requestPolicy` (`validValues`: the smallest valid value ≥
  the request; `validRange`: at least `min`, up to `min + n·step`, never above `max`), and the
  sum never exceeds the capacity; each share gets a `shareID` and its `consumedCapacity`;
- partitionable devices consume `sharedCounters` of their pool while allocated; the sum of the
  devices in use never exceeds a counter set;
- `matchAttribute` constraints need the same value, `distinctAttribute` distinct values, across
  the devices of the requests they name (all requests when none named).

The search backtracks (the first solution in device order wins, as upstream: no scoring) within
a step budget. A failure carries a reason for logs and tests; kube-scheduler's per-node message
is `cannot allocate all claims`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tessera.kube_sim.dra import cel
from tessera.kube_sim.dra.model import Device, KubeObject, Pool, Usage
from tessera.kube_sim.dra.requests import (
    Alternative,
    Request,
    consumption,
    requests_of,
    tolerates,
)
from tessera.kube_sim.dra.taint_rules import BLOCKING

from tessera.quantity import canonical

UNSCHEDULABLE = "cannot allocate all claims"
MAX_STEPS = 200_000


@dataclass
class Picked:
    claim: int
    request: str  # the main request's name
    alternative: Alternative
    device: Device
    consumed: dict[str, Fraction] | None  # None: the whole device (not shared)


class Outcome:
    """An allocation attempt's result: per claim index its `status.allocation` (built on first
    access: only the chosen node's is ever written out), or None with the reason."""

    def __init__(self, allocations: dict[int, dict[str, Any]] | None, reason: str = "",
                 build: Callable[[], dict[int, dict[str, Any]]] | None = None) -> None:
        self._allocations = allocations
        self.reason = reason
        self._build = build

    @property
    def ok(self) -> bool:
        return self._allocations is not None or self._build is not None

    @property
    def allocations(self) -> dict[int, dict[str, Any]] | None:
        if self._build is not None:
            self._allocations = self._build()
            self._build = None
        return self._allocations

    def results(self) -> dict[int, dict[str, Any]]:
        found = self.allocations
        assert found is not None
        return found


class AllocationError(Exception):
    pass


class Allocator:
    """One allocation attempt: `claims` (those to allocate, in the pod's order) on a node."""

    def __init__(
        self,
        claims: list[KubeObject],
        pools: list[Pool],
        classes: dict[str, KubeObject],
        usage: Usage,
        node_name: str,
        new_share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self.claims = claims
        self.pools = pools
        self.classes = classes
        self.usage = usage
        self.node_name = node_name
        self.new_share_id = new_share_id
        self._counter_limits: dict[tuple[str, str, str], dict[str, Fraction]] | None = None
        self.picked: list[Picked] = []
        self.steps = 0
        self.reason = ""
        self._candidates: dict[tuple[int, str], list[Device]] = {}

    def counter_limits(self) -> dict[tuple[str, str, str], dict[str, Fraction]]:
        if self._counter_limits is None:
            self._counter_limits = {(p.driver, p.name, s): c for p in self.pools
                                    for s, c in p.counter_sets.items()}
        return self._counter_limits

    # --- which devices an alternative may take -----------------------------------------------

    def _selects(self, expression: str, device: Device) -> bool:
        """The selector's result for the device, cached per expression and what of the device it
        reads (a selector reading only the driver and the model is evaluated once per model,
        not once per GPU), or the whole device when that cannot be told from its text."""
        reads = cel.selector_reads(expression)
        key: tuple[Any, ...] = (expression, device.fingerprint if reads is None
                                else _projection(device, reads))
        cached = _SELECTOR_CACHE.get(key)
        if cached is None:
            activation = cel.device_activation(device.driver, device.attributes,
                                               device.capacity_qualified(),
                                               device.allow_multiple)
            cached = cel.evaluate(expression, activation)
            if len(_SELECTOR_CACHE) > 200_000:
                _SELECTOR_CACHE.clear()
            _SELECTOR_CACHE[key] = cached
        return cached

    def candidates(self, claim_index: int, alt: Alternative) -> list[Device]:
        key = (claim_index, alt.result_name)
        if key in self._candidates:
            return self._candidates[key]
        device_class = self.classes.get(alt.class_name)
        if device_class is None:
            raise AllocationError(f'device class "{alt.class_name}" not found')
        class_selectors = tuple(
            str((s.get("cel") or {}).get("expression", ""))
            for s in (device_class.get("spec") or {}).get("selectors") or []
            if isinstance(s, dict)
        )
        found = []
        for pool in self.pools:
            for device in self._admitted(pool, class_selectors, alt):
                if alt.capacity:
                    if device.allow_multiple:
                        if consumption(device, alt.capacity, alt.capacity_key) is None:
                            continue
                    elif any((n := device.capacity_named(k)) is None
                             or device.capacity[n].value < v for k, v in alt.capacity.items()):
                        continue
                found.append(device)
        self._candidates[key] = found
        return found

    def _admitted(self, pool: Pool, class_selectors: tuple[str, ...],
                  alt: Alternative) -> list[Device]:
        """The pool's devices every selector selects and whose taints the request tolerates:
        the same for every pod asking alike, so worked out once per pool."""
        key = (class_selectors, tuple(alt.selectors), alt.tolerations_key)
        cached = pool.candidate_cache.get(key)
        if cached is not None:
            return cached
        found = []
        for device in pool.devices:
            try:
                if not all(self._selects(e, device) for e in (*class_selectors, *alt.selectors)):
                    continue
            except cel.CelError as exc:
                raise AllocationError(f"CEL selector of class {alt.class_name!r} or request "
                                      f"{alt.result_name!r}: {exc}") from None
            if any(t.get("effect") in BLOCKING
                   and not tolerates(alt.tolerations, t) for t in device.taints):
                continue
            found.append(device)
        if len(pool.candidate_cache) > 1_000:
            pool.candidate_cache.clear()
        pool.candidate_cache[key] = found
        return found

    def _fits(self, device: Device, alt: Alternative) -> dict[str, Fraction] | bool | None:
        """False: the device cannot be taken now; else what it consumes (None: all of it)."""
        if alt.admin_access:
            return None
        if device.allow_multiple:
            consumed = consumption(device, alt.capacity, alt.capacity_key)
            if consumed is None or device.id in self.usage.exclusive:
                return False
            held = self.usage.consumed.get(device.id, {})
            for name, amount in consumed.items():
                if held.get(name, 0) + amount > device.capacity[name].value:
                    return False
        else:
            if self.usage.users.get(device.id, 0):
                return False
            consumed = None
        if not self.usage.users.get(device.id, 0):
            for counter_set, counters in device.consumes:
                limits = self.counter_limits().get((device.driver, device.pool, counter_set))
                if limits is None:
                    return False
                used = self.usage.counters.get((device.driver, device.pool, counter_set), {})
                for name, value in counters.items():
                    if used.get(name, 0) + value > limits.get(name, 0):
                        return False
        return consumed

    # --- constraints ---------------------------------------------------------------------------

    def _constraints_hold(self, claim_index: int) -> bool:
        claim = self.claims[claim_index]
        constraints = ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or []
        mine = [p for p in self.picked if p.claim == claim_index]
        for constraint in constraints:
            names = set(constraint.get("requests") or [])
            applies = [p for p in mine if not names or p.request in names
                       or p.alternative.result_name in names]
            for key, distinct in (("matchAttribute", False), ("distinctAttribute", True)):
                attribute = constraint.get(key)
                if not attribute:
                    continue
                values = []
                for p in applies:
                    value = p.device.attributes.get(attribute)
                    if value is None:
                        return False
                    values.append(tuple(sorted(value.items())))
                if distinct and len(set(values)) != len(values):
                    return False
                if not distinct and len(set(values)) > 1:
                    return False
        return True

    # --- the search ---------------------------------------------------------------------------

    def _take(self, pick: Picked) -> None:
        self.picked.append(pick)
        if not pick.alternative.admin_access:
            self.usage.take(pick.device, pick.consumed)

    def _undo(self) -> None:
        pick = self.picked.pop()
        if not pick.alternative.admin_access:
            self.usage.give_back(pick.device, pick.consumed)

    def _step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise AllocationError("the search for devices took too many steps")

    def _claim(self, ci: int) -> bool:
        if ci == len(self.claims):
            return True
        return self._request(ci, requests_of(self.claims[ci]), 0)

    def _request(self, ci: int, requests: list[Request], ri: int) -> bool:
        if ri == len(requests):
            return self._claim(ci + 1)
        request = requests[ri]
        for alt in request.alternatives:
            if alt.mode == "All":
                if self._all(ci, requests, ri, alt):
                    return True
            elif alt.mode == "ExactCount" and self._devices(ci, requests, ri, alt, alt.count, 0):
                return True
        if not self.reason:
            claim_meta = self.claims[ci].get("metadata") or {}
            self.reason = (f"claim {claim_meta.get('namespace', '')}/{claim_meta.get('name', '')}"
                           f", request {request.name}: not enough devices available on node "
                           f"{self.node_name}")
        return False

    def _devices(self, ci: int, requests: list[Request], ri: int, alt: Alternative,
                 remaining: int, start: int) -> bool:
        if remaining == 0:
            return self._request(ci, requests, ri + 1)
        found = self.candidates(ci, alt)
        for index in range(start, len(found)):
            self._step()
            device = found[index]
            fits = self._fits(device, alt)
            if fits is False:
                continue
            self._take(Picked(ci, requests[ri].name, alt, device,
                              fits if isinstance(fits, dict) else None))
            if self._constraints_hold(ci) and self._devices(
                    ci, requests, ri, alt, remaining - 1, index + 1):
                return True
            self._undo()
        return False

    def _all(self, ci: int, requests: list[Request], ri: int, alt: Alternative) -> bool:
        found = self.candidates(ci, alt)
        pools = {(d.driver, d.pool) for d in found}
        if not found or any(not p.complete for p in self.pools if (p.driver, p.name) in pools):
            return False
        taken = 0
        for device in found:
            fits = self._fits(device, alt)
            if fits is False:
                break
            self._take(Picked(ci, requests[ri].name, alt, device,
                              fits if isinstance(fits, dict) else None))
            taken += 1
        if taken == len(found) and self._constraints_hold(ci) and self._request(
                ci, requests, ri + 1):
            return True
        for _ in range(taken):
            self._undo()
        return False

    # --- the result ------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            solved = self._claim(0)
        except AllocationError as exc:
            return Outcome(None, str(exc))
        if not solved:
            return Outcome(None, self.reason or "no devices")
        picked = list(self.picked)
        while self.picked:  # the caller's usage is left as it was (reserve records it)
            self._undo()

        def build() -> dict[int, dict[str, Any]]:
            return {ci: self._allocation(ci, picked) for ci in range(len(self.claims))}

        return Outcome(None, build=build)

    def _allocation(self, ci: int, picked: list[Picked]) -> dict[str, Any]:
        results = []
        used_classes: dict[str, list[str]] = {}
        local = False
        for pick in (p for p in picked if p.claim == ci):
            result: dict[str, Any] = {
                "request": pick.alternative.result_name,
                "driver": pick.device.driver,
                "pool": pick.device.pool,
                "device": pick.device.name,
            }
            if pick.alternative.admin_access:
                result["adminAccess"] = True
            if pick.alternative.tolerations:
                result["tolerations"] = pick.alternative.tolerations
            if pick.device.allow_multiple and pick.consumed is not None:
                result["shareID"] = self.new_share_id()
                result["consumedCapacity"] = {n: quantity_text(v)
                                              for n, v in pick.consumed.items()}
            results.append(result)
            local = local or pick.device.node_local
            names = used_classes.setdefault(pick.alternative.class_name, [])
            if pick.alternative.result_name not in names:
                names.append(pick.alternative.result_name)
        config = []
        for class_name, names in used_classes.items():
            for entry in (self.classes[class_name].get("spec") or {}).get("config") or []:
                config.append({"source": "FromClass", "requests": names, **entry})
        claim_spec = (self.claims[ci].get("spec") or {}).get("devices") or {}
        for entry in claim_spec.get("config") or []:
            config.append({"source": "FromClaim", **entry})
        allocation: dict[str, Any] = {"devices": {"results": results}}
        if config:
            allocation["devices"]["config"] = config
        if local:
            allocation["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [self.node_name]}]}]}
        return allocation


def quantity_text(value: Fraction) -> str:
    """Canonical text: bytes-like amounts (whole KiB multiples) in the binary family, the
    rest decimal, so 4Gi stays `4Gi` and 30 stays `30`."""
    if value.denominator == 1 and value >= 1024 and value.numerator % 1024 == 0:
        return canonical(f"{value.numerator // 1024}Ki")
    if value.denominator == 1:
        return canonical(str(value.numerator))
    return canonical(f"{round(value * 1000)}m")


def _projection(device: Device, reads: tuple[tuple[str, str], ...]) -> tuple[Any, ...]:
    """The parts of the device a selector reads (cel.selector_reads), as a hashable key."""
    values: list[Any] = [device.driver, device.allow_multiple]
    for section, qualified in reads:
        if section == "attributes":
            attribute = device.attributes.get(qualified)
            values.append(None if attribute is None else tuple(sorted(
                (k, repr(v)) for k, v in attribute.items())))
        else:
            name = device.capacity_named(qualified)
            values.append(None if name is None else str(device.capacity[name].value))
    return tuple(values)


_SELECTOR_CACHE: dict[tuple[Any, ...], bool] = {}
