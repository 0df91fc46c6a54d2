"""DeviceTaintRule (`resource.k8s.io/v1beta2`, beta; KEP-5055, feature gate
`DRADeviceTaintRules`), as the "Device Taints and Tolerations" page and the API reference
describe it: an admin taints devices without asking their driver.

- A rule adds one taint (`spec.taint`: `key`, `value`, `effect` `None`|`NoSchedule`|`NoExecute`)
  to every device its `spec.deviceSelector` selects: each of `driver`, `pool`, `device` that is
  set must equal the device's (`slice.spec.driver`, `slice.spec.pool.name`,
  `slice.spec.devices[].name`); an empty selector selects every device, a rule without one none
  (so a forgotten selector evicts nobody).
- The taint acts as if the driver had published it in the ResourceSlice: the allocator skips a
  device with a `NoSchedule`/`NoExecute` taint a request does not tolerate; a `NoExecute` taint
  evicts the pods of claims already allocated that device (eviction.py); `None` has no effect
  (a dry run).
- `timeAdded` is set when the rule is created (if not given) and set again when an update
  changes the effect but keeps the old time (the eviction's clock starts at the effect).

kube-sim serves the kind and applies it; `status.conditions` (`EvictionInProgress`) is not
written. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tessera.kube_sim.store import KubeObject, now_rfc3339
from tessera.kube_sim.validation import FieldError

KIND = "DeviceTaintRule"
# A device taint's effects (KEP-5055), on slices and rules alike: `None` only reports (NVIDIA's
# DRA driver publishes non-critical health events so); the other two act, and only they are
# named by tolerations.
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
BLOCKING = ("NoSchedule", "NoExecute")  # what keeps a device from new claims
SELECTOR_FIELDS = ("driver", "pool", "device")
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_QUALIFIED = re.compile(r"^(?:[a-z0-9]([-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def validate(obj: KubeObject, old: KubeObject | None = None) -> list[FieldError]:
    """The rule's own validation, with `timeAdded` defaulted (`old`: the stored rule)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [FieldError("Required", "spec")]
    errors: list[FieldError] = []
    taint = spec.get("taint")
    if not isinstance(taint, dict):
        return [FieldError("Required", "spec.taint")]
    key = taint.get("key")
    if not key:
        errors.append(FieldError("Required", "spec.taint.key"))
    elif not isinstance(key, str) or len(key.rpartition("/")[2]) > 63 or not _QUALIFIED.match(key):
        errors.append(FieldError("Invalid", "spec.taint.key", "must be a qualified name", key))
    value = taint.get("value", "")
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        errors.append(FieldError("Invalid", "spec.taint.value", "must be a valid label value",
                                 value))  # fmt: skip
    if taint.get("effect") not in TAINT_EFFECTS:
        errors.append(FieldError("NotSupported", "spec.taint.effect",
                                 'supported values: "NoExecute", "NoSchedule", "None"',
                                 taint.get("effect")))  # fmt: skip
    selector = spec.get("deviceSelector")
    if selector is not None:
        if not isinstance(selector, dict):
            errors.append(FieldError("Invalid", "spec.deviceSelector", "must be an object", "..."))
        else:
            for name in SELECTOR_FIELDS:
                if name in selector and not isinstance(selector[name], str):
                    errors.append(FieldError("Invalid", f"spec.deviceSelector.{name}",
                                             "must be a string", selector[name]))  # fmt: skip
    old_taint = ((old or {}).get("spec") or {}).get("taint") or {}
    if not taint.get("timeAdded") or (
            old is not None and taint.get("effect") != old_taint.get("effect")
            and taint.get("timeAdded") == old_taint.get("timeAdded")):  # fmt: skip
        taint["timeAdded"] = now_rfc3339()
    return errors


def selects(rule: KubeObject, driver: str, pool: str, device: str) -> bool:
    selector = (rule.get("spec") or {}).get("deviceSelector")
    if not isinstance(selector, dict):
        return False  # no selector: no device
    wanted = {"driver": driver, "pool": pool, "device": device}
    return all(selector.get(f) in (None, "", wanted[f]) for f in SELECTOR_FIELDS)


def taints_for(rules: Iterable[KubeObject], driver: str, pool: str,
               device: str) -> list[dict[str, Any]]:  # fmt: skip
    """The taints the rules add to one device (in the rules' order)."""
    return [dict((r.get("spec") or {}).get("taint") or {})
            for r in rules if selects(r, driver, pool, device)]  # fmt: skip
