"""ResourceSlice validation as kube-apiserver words it: the pool, exactly one way to reach
nodes, devices (names, typed attributes, capacities with request policies only on devices that
allow multiple allocations, taints, counter consumption) or shared counter sets, never both in
one slice (KEP-4815 as in `resource.k8s.io/v1`: a device consumes a counter set of its *pool*,
published in another slice of it; a set no slice of the pool defines leaves the device
unallocatable, which the allocator judges, not the API server)."""

from __future__ import annotations

from typing import Any

from tessera.kube_sim.dra import cel
from tessera.kube_sim.dra.model import maybe_quantity
from tessera.kube_sim.dra.taint_rules import TAINT_EFFECTS
from tessera.kube_sim.store import KubeObject, now_rfc3339
from tessera.kube_sim.validation import DNS1123_LABEL, DNS1123_SUBDOMAIN, FieldError

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_TAINTS = 4


def dns_label(value: Any, path: str, errors: list[FieldError]) -> None:
    if not isinstance(value, str) or not value:
        errors.append(FieldError("Required", path))
    elif len(value) > 63 or not DNS1123_LABEL.match(value):
        errors.append(FieldError("Invalid", path, "a lowercase RFC 1123 label must consist of "
                                 "lower case alphanumeric characters or '-', and must start and "
                                 "end with an alphanumeric character", value))


def validate_slice(obj: KubeObject) -> list[FieldError]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [FieldError("Required", "spec")]
    errors: list[FieldError] = []
    if not spec.get("driver"):
        errors.append(FieldError("Required", "spec.driver"))
    elif not DNS1123_SUBDOMAIN.match(str(spec["driver"])):
        errors.append(FieldError("Invalid", "spec.driver", "must be a DNS subdomain",
                                 spec["driver"]))
    pool = spec.get("pool") if isinstance(spec.get("pool"), dict) else {}
    if not pool.get("name"):
        errors.append(FieldError("Required", "spec.pool.name"))
    count = pool.get("resourceSliceCount")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        errors.append(FieldError("Invalid", "spec.pool.resourceSliceCount",
                                 "must be greater than zero", count))
    generation = pool.get("generation", 0)
    if not isinstance(generation, int) or generation < 0:
        errors.append(FieldError("Invalid", "spec.pool.generation",
                                 "must be greater than or equal to 0", generation))
    access = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
              if spec.get(k)]
    if len(access) != 1:
        errors.append(FieldError("Required" if not access else "Invalid", "spec",
                                 "exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                                 "`perDeviceNodeSelection` is required",
                                 "{" + ", ".join(access) + "}" if access else None))
    devices = spec.get("devices") or []
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES_PER_SLICE:
        return [*errors, FieldError("Invalid", "spec.devices",
                                    f"must have at most {MAX_DEVICES_PER_SLICE} items", "...")]
    if devices and spec.get("sharedCounters"):
        errors.append(FieldError("Invalid", "spec", "exactly one of `devices`, "
                                 "`sharedCounters` is required, but multiple fields are set",
                                 "{devices, sharedCounters}"))
    limited = [d for d in devices if isinstance(d, dict)
               and (d.get("taints") or d.get("consumesCounters"))]
    if limited and len(devices) > MAX_DEVICES_WITH_TAINTS_OR_COUNTERS:
        errors.append(FieldError("Invalid", "spec.devices",
                                 f"must have at most {MAX_DEVICES_WITH_TAINTS_OR_COUNTERS} items "
                                 "when any device uses taints or consumes counters", "..."))
    errors += _counter_set_errors(spec.get("sharedCounters"))
    seen: set[str] = set()
    for i, device in enumerate(devices):
        where = f"spec.devices[{i}]"
        if not isinstance(device, dict):
            errors.append(FieldError("Invalid", where, "must be an object", device))
            continue
        name = device.get("name")
        dns_label(name, f"{where}.name", errors)
        if isinstance(name, str) and name in seen:
            errors.append(FieldError("Duplicate", f"{where}.name", value=name))
        seen.add(str(name))
        for key, attribute in (device.get("attributes") or {}).items():
            kinds = [k for k in ("int", "bool", "string", "version")
                     if isinstance(attribute, dict) and k in attribute]
            if len(kinds) != 1:
                errors.append(FieldError("Invalid", f"{where}.attributes[{key}]",
                                         "exactly one value must be specified", attribute))
            elif kinds == ["version"] and cel._SEMVER.match(str(attribute["version"])) is None:
                errors.append(FieldError("Invalid", f"{where}.attributes[{key}].version",
                                         "must be a string compatible with semver.org spec "
                                         "2.0.0", attribute["version"]))
        for key, capacity in (device.get("capacity") or {}).items():
            cap_where = f"{where}.capacity[{key}]"
            value = maybe_quantity((capacity or {}).get("value"))
            if value is None:
                errors.append(FieldError("Required", f"{cap_where}.value"))
                continue
            policy = (capacity or {}).get("requestPolicy")
            if policy is not None and not device.get("allowMultipleAllocations"):
                errors.append(FieldError("Forbidden", f"{cap_where}.requestPolicy",
                                         "allowMultipleAllocations must be true"))
            elif isinstance(policy, dict):
                errors += _policy_errors(policy, value, f"{cap_where}.requestPolicy")
        taints = device.get("taints") or []
        if len(taints) > MAX_TAINTS:
            errors.append(FieldError("Invalid", f"{where}.taints",
                                     f"must have at most {MAX_TAINTS} items", "..."))
        for j, taint in enumerate(taints):
            if not isinstance(taint, dict) or not taint.get("key"):
                errors.append(FieldError("Required", f"{where}.taints[{j}].key"))
                continue
            if taint.get("effect") not in TAINT_EFFECTS:
                errors.append(FieldError("NotSupported", f"{where}.taints[{j}].effect",
                                         'supported values: "NoExecute", "NoSchedule", "None"',
                                         taint.get("effect")))
            taint.setdefault("timeAdded", now_rfc3339())
        consumptions = device.get("consumesCounters") or []
        if len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
            errors.append(FieldError("Invalid", f"{where}.consumesCounters",
                                     f"must have at most {MAX_CONSUMPTIONS_PER_DEVICE} items",
                                     len(consumptions)))
        sets_named: set[str] = set()
        for j, consumption in enumerate(consumptions):
            path = f"{where}.consumesCounters[{j}]"
            counter_set = (consumption or {}).get("counterSet") if isinstance(
                consumption, dict) else None
            if not counter_set:
                errors.append(FieldError("Required", f"{path}.counterSet"))
                continue
            if counter_set in sets_named:
                errors.append(FieldError("Duplicate", f"{path}.counterSet", value=counter_set))
            sets_named.add(str(counter_set))
            errors += _counters_errors(consumption.get("counters"), f"{path}.counters")
    return errors


def _counters_errors(counters: Any, path: str) -> list[FieldError]:
    if not isinstance(counters, dict) or not counters:
        return [FieldError("Required", path)]
    errors: list[FieldError] = []
    if len(counters) > MAX_COUNTERS_PER_SET:
        errors.append(FieldError("Invalid", path, f"must have at most {MAX_COUNTERS_PER_SET} "
                                 "items", len(counters)))
    for name, counter in counters.items():
        dns_label(name, f"{path}[{name}]", errors)
        if maybe_quantity((counter or {}).get("value") if isinstance(counter, dict)
                          else None) is None:
            errors.append(FieldError("Required", f"{path}[{name}].value"))
    return errors


def _counter_set_errors(counter_sets: Any) -> list[FieldError]:
    if counter_sets is None:
        return []
    if not isinstance(counter_sets, list):
        return [FieldError("Invalid", "spec.sharedCounters", "must be a list", "...")]
    errors: list[FieldError] = []
    if len(counter_sets) > MAX_COUNTER_SETS:
        errors.append(FieldError("Invalid", "spec.sharedCounters",
                                 f"must have at most {MAX_COUNTER_SETS} items",
                                 len(counter_sets)))
    names: set[str] = set()
    for i, counter_set in enumerate(counter_sets):
        path = f"spec.sharedCounters[{i}]"
        if not isinstance(counter_set, dict):
            errors.append(FieldError("Invalid", path, "must be an object", counter_set))
            continue
        name = counter_set.get("name")
        dns_label(name, f"{path}.name", errors)
        if isinstance(name, str) and name in names:
            errors.append(FieldError("Duplicate", f"{path}.name", value=name))
        names.add(str(name))
        errors += _counters_errors(counter_set.get("counters"), f"{path}.counters")
    return errors


def _policy_errors(policy: dict[str, Any], value: Any, path: str) -> list[FieldError]:
    errors = []
    default = maybe_quantity(policy.get("default"))
    valid_values = [maybe_quantity(v) for v in policy.get("validValues") or []]
    valid_range = policy.get("validRange")
    if valid_values and valid_range:
        errors.append(FieldError("Forbidden", path, "exactly one policy can be specified"))
    if (valid_values or valid_range) and default is None:
        errors.append(FieldError("Required", f"{path}.default",
                                 "required when validValues or validRange is set"))
    if valid_values:
        if any(v is None for v in valid_values) or valid_values != sorted(
                v for v in valid_values if v is not None):
            errors.append(FieldError("Invalid", f"{path}.validValues",
                                     "must be sorted in ascending order", "..."))
        elif default is not None and default not in valid_values:
            errors.append(FieldError("Invalid", f"{path}.default",
                                     "must be one of validValues", policy.get("default")))
    if isinstance(valid_range, dict):
        low = maybe_quantity(valid_range.get("min"))
        high = maybe_quantity(valid_range.get("max"))
        if low is None:
            errors.append(FieldError("Required", f"{path}.validRange.min"))
        elif low > value:
            errors.append(FieldError("Invalid", f"{path}.validRange.min",
                                     "must be less than or equal to the capacity value",
                                     valid_range.get("min")))
        if high is not None and high > value:
            errors.append(FieldError("Invalid", f"{path}.validRange.max",
                                     "must be less than or equal to the capacity value",
                                     valid_range.get("max")))
        if default is not None and low is not None and (default < low or (
                high is not None and default > high)):
            errors.append(FieldError("Invalid", f"{path}.default",
                                     "must be within validRange", policy.get("default")))
    return errors
