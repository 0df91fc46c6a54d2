"""kube-controller-manager's resource quota controller, for kube-sim: `status.used` of every
ResourceQuota, as the real controller computes it (pkg/controller/resourcequota,
pkg/quota/v1/evaluator/core/pods.go). Pure.

- `status.hard` is `spec.hard`; `status.used` holds exactly the keys of `spec.hard`.
- The pod evaluator charges non-terminal pods (phase not Succeeded/Failed): `pods` and
  `count/pods`; `cpu`/`memory`/`ephemeral-storage` and their `requests.` forms from requests,
  their `limits.` forms from limits (init containers maxed, app containers summed); an extended
  resource (`nvidia.com/gpu`) only in its `requests.` form — "only quota objects specified with
  prefix 'requests.' will be charged as requests".
- The claim evaluator (dra/quota.py) charges every ResourceClaim of the namespace:
  `count/resourceclaims.resource.k8s.io`, `<class>.deviceclass.resource.k8s.io/devices` and the
  class's extended resource names in their `requests.` form (added to the pods' for those).
- A key no evaluator computes (`limits.nvidia.com/gpumem`) keeps the value someone else wrote in
  `status.used` (the controller starts from the current `used` and masks it to the hard keys),
  else is absent (`kubectl describe` shows 0). Tessera's quota service writes those: kube-sim
  must not overwrite them.
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from tessera.kube_sim.dra import quota as dra_quota
from tessera.kube_sim.fit import pod_requests

from tessera.quantity import Format, Quantity, QuantityError
from tessera.quantity import parse as parse_quantity

NATIVE = ("cpu", "memory", "ephemeral-storage")
TERMINAL = ("Succeeded", "Failed")


def _extended(name: str) -> bool:
    return "/" in name and not name.startswith(("kubernetes.io/", "requests.", "limits.",
                                                "count/"))


def _pod_limits(pod: dict[str, Any]) -> dict[str, Fraction]:
    spec = pod.get("spec") or {}

    def of(container: Any) -> dict[str, Fraction]:
        limits = ((container or {}).get("resources") or {}).get("limits") or {}
        found = {}
        for name, value in limits.items():
            try:
                found[str(name)] = parse_quantity(value).value
            except QuantityError:
                continue
        return found

    total: dict[str, Fraction] = {}
    for container in spec.get("containers") or []:
        for name, value in of(container).items():
            total[name] = total.get(name, Fraction(0)) + value
    for container in spec.get("initContainers") or []:
        for name, value in of(container).items():
            total[name] = max(total.get(name, Fraction(0)), value)
    return total


def evaluated(key: str) -> bool:
    """Whether the pod or claim evaluator computes `key` (else its used value is left as
    written)."""
    if key in ("pods", "count/pods", *NATIVE) or dra_quota.counted(key):
        return True
    prefix, _, name = key.partition(".")
    if prefix == "requests" and (name in NATIVE or _extended(name)):
        return True
    return prefix == "limits" and name in NATIVE


def usage(quota: dict[str, Any], pods: list[dict[str, Any]],
          claims: Iterable[dict[str, Any]] = (),
          classes: Iterable[dict[str, Any]] = ()) -> dict[str, str]:
    """The `status.used` the controller writes for `quota` given the namespace's pods and
    ResourceClaims (and the cluster's DeviceClasses, for their extended resource names)."""
    hard = (quota.get("spec") or {}).get("hard") or {}
    current = (quota.get("status") or {}).get("used") or {}
    live = [p for p in pods if (p.get("status") or {}).get("phase") not in TERMINAL]
    sums: dict[str, Fraction] = {}
    binary: set[str] = set()
    for pod in live:
        requests, limits = pod_requests(pod), _pod_limits(pod)
        for source, prefix in ((requests, "requests."), (limits, "limits.")):
            for name, value in source.items():
                for key in ({f"{prefix}{name}", name} if prefix == "requests." and
                            name in NATIVE else {f"{prefix}{name}"}):
                    sums[key] = sums.get(key, Fraction(0)) + value
        for container in (pod.get("spec") or {}).get("containers") or []:
            for values in ((container.get("resources") or {}).values()):
                for name, raw in (values or {}).items() if isinstance(values, dict) else ():
                    if isinstance(raw, str) and raw.endswith("i"):
                        binary.update({name, f"requests.{name}", f"limits.{name}"})
    by_uid = {str((p.get("metadata") or {}).get("uid")): p for p in pods}
    for key, value in dra_quota.claims_usage(
            claims, dra_quota.extended_names(classes), by_uid).items():
        sums[key] = sums.get(key, Fraction(0)) + value
    used: dict[str, str] = {}
    for key in hard:
        if key in ("pods", "count/pods"):
            used[key] = str(len(live))
        elif evaluated(key):
            fmt = Format.BINARY_SI if key in binary else Format.DECIMAL_SI
            used[key] = Quantity(sums.get(key, Fraction(0)), fmt).canonical()
        elif key in current:
            used[key] = str(current[key])
    return used
