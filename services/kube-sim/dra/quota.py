"""ResourceQuota for DRA devices, as kube-apiserver counts and enforces it (the "Quota for DRA
resource claims" section of the Resource Quotas concept page; the claim evaluator of the quota
admission plugin and controller).

What one ResourceClaim counts (every claim stored: claims have no terminal phase):
- `count/resourceclaims.resource.k8s.io`: 1;
- per device class `<class>.deviceclass.resource.k8s.io/devices`: the devices it may get: an
  `exactly` request's `count` (`allocationMode: All`: 32, the most an allocation can hold, as the
  worst case); a `firstAvailable` request the largest of its alternatives, per class;
- the same number under the class's extended resource names (extended-resource allocation by
  DRA): `requests.deviceclass.resource.kubernetes.io/<class>` always, `requests.<name>` when the
  class has `spec.extendedResourceName` (a pod's `requests.<name>` counts there too: the pod
  evaluator's, quota_usage.py). The claim the scheduler makes for a pod that asked an extended
  resource (`resource.kubernetes.io/extended-resource-claim: "true"`, owned by the pod) does not
  count again the name the pod asked for: the pod's own request already counts it.

Enforcement (the ResourceQuota admission plugin, after validating webhooks): a ResourceClaim
CREATE whose counts would take any quota of its namespace above `spec.hard` for a key that quota
names is refused with 403 `resourceclaims.resource.k8s.io "<name>" is forbidden: exceeded quota:
<quota>, requested: <key>=<n>, used: <key>=<n>, limited: <key>=<n>` (only the exceeded keys,
sorted). kube-sim counts "used" from the stored claims at that moment (kube-apiserver reads the
quota's `status.used` and adds the claim to it in the same admission: the same figure once the
controller has caught up). Pure, but `admit_claim`, which reads the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tessera.kube_sim.dra.claims import EXTENDED_CLAIM
from tessera.kube_sim.store import ObjectStore, Selector, StoreError

from tessera.dra_quota import CLAIM_COUNT, IMPLICIT_REQUESTS, PER_CLASS
from tessera.quantity import QuantityError
from tessera.quantity import parse as parse_quantity

REQUESTS = "requests."
ALLOCATION_RESULTS_MAX_SIZE = 32  # resource.k8s.io/v1: the most devices one allocation holds


def devices_key(device_class: str) -> str:
    return f"{device_class}{PER_CLASS}"


def implicit_key(device_class: str) -> str:
    return f"{IMPLICIT_REQUESTS}{device_class}"


def counted(key: str) -> bool:
    """Whether the claim evaluator counts `key` (a quota key it computes)."""
    if key == CLAIM_COUNT or key.endswith(PER_CLASS):
        return True
    name = key.removeprefix(REQUESTS)
    # an extended resource name (cpu, memory, storage have no "/"), as the pod evaluator's
    return name != key and "/" in name and not name.startswith(
        ("kubernetes.io/", "requests.", "limits.", "count/"))


def extended_names(classes: Iterable[dict[str, Any]]) -> dict[str, str]:
    """DeviceClass name -> its `spec.extendedResourceName` (the classes that have one)."""
    return {str(c["metadata"]["name"]): str(c["spec"]["extendedResourceName"])
            for c in classes if (c.get("spec") or {}).get("extendedResourceName")}  # fmt: skip


def _devices(request: Any) -> int:
    if not isinstance(request, dict):
        return 0
    mode = request.get("allocationMode", "ExactCount")
    if mode == "All":
        return ALLOCATION_RESULTS_MAX_SIZE
    count = request.get("count", 1)
    return count if mode == "ExactCount" and isinstance(count, int) else 0  # unknown: none


@dataclass
class _PodAsked:
    """What the owning pod's containers asked by extended resource name: (quota key, count),
    each matched once against the claim's requests (the pod evaluator already counts them)."""

    entries: list[tuple[str, int]]

    def take(self, key: str, count: int) -> bool:
        if (key, count) in self.entries:
            self.entries.remove((key, count))
            return True
        return False


def _pod_asked(claim: dict[str, Any], pods: Mapping[str, dict[str, Any]]) -> _PodAsked | None:
    meta = claim.get("metadata") or {}
    if (meta.get("annotations") or {}).get(EXTENDED_CLAIM) != "true":
        return None
    owner = next((r for r in meta.get("ownerReferences") or []
                  if r.get("controller") and r.get("kind") == "Pod"), None)  # fmt: skip
    pod = pods.get(str(owner.get("uid"))) if owner else None
    if pod is None:
        return None
    entries = []
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        asked = ((container or {}).get("resources") or {}).get("requests") or {}
        for name, value in asked.items():
            try:
                count = int(str(value))
            except ValueError:
                continue
            entries.append((f"{REQUESTS}{name}", count))
    return _PodAsked(entries)


def claim_usage(claim: dict[str, Any], extended: Mapping[str, str],
                pods: Mapping[str, dict[str, Any]] | None = None) -> dict[str, int]:
    """What `claim` counts against quota (`extended`: class -> extendedResourceName; `pods`:
    the namespace's pods by uid, to find the pod an extended-resource claim was made for)."""
    usage: dict[str, int] = {CLAIM_COUNT: 1}
    asked = _pod_asked(claim, pods or {})

    def add(device_class: str, count: int) -> None:
        usage[devices_key(device_class)] = usage.get(devices_key(device_class), 0) + count
        implicit = implicit_key(device_class)
        explicit = f"{REQUESTS}{extended[device_class]}" if device_class in extended else None
        skip = None
        if asked is not None:
            if asked.take(implicit, count):
                skip = implicit
            elif explicit and asked.take(explicit, count):
                skip = explicit
        for key in (implicit, explicit):
            if key and key != skip:
                usage[key] = usage.get(key, 0) + count

    devices = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    for request in devices:
        if not isinstance(request, dict):
            continue
        alternatives = request.get("firstAvailable")
        if alternatives:
            largest: dict[str, int] = {}
            for sub in alternatives:
                if isinstance(sub, dict) and sub.get("deviceClassName"):
                    name = str(sub["deviceClassName"])
                    largest[name] = max(largest.get(name, 0), _devices(sub))
            for name, count in largest.items():
                add(name, count)
        elif isinstance(request.get("exactly"), dict) and request["exactly"].get(
                "deviceClassName"):
            add(str(request["exactly"]["deviceClassName"]), _devices(request["exactly"]))
    return usage


def claims_usage(claims: Iterable[dict[str, Any]], extended: Mapping[str, str],
                 pods: Mapping[str, dict[str, Any]] | None = None) -> dict[str, int]:
    total: dict[str, int] = {}
    for claim in claims:
        for key, value in claim_usage(claim, extended, pods).items():
            total[key] = total.get(key, 0) + value
    return total


def _pretty(values: Mapping[str, Any]) -> str:
    return ",".join(f"{key}={values[key]}" for key in sorted(values))


def exceeded(quota: dict[str, Any], requested: Mapping[str, int],
             used: Mapping[str, Any]) -> str | None:
    """kube-apiserver's sentence when `requested` on top of `used` goes over `quota`'s hard
    limits for a key it names (None: it fits). `used` values: numbers (Fraction/int)."""
    hard = (quota.get("spec") or {}).get("hard") or {}
    over = {}
    for key, amount in requested.items():
        if key not in hard or not counted(key):
            continue
        try:
            limit = parse_quantity(hard[key]).value
        except QuantityError:
            continue
        if used.get(key, 0) + amount > limit:
            over[key] = limit
    if not over:
        return None

    def text(value: Any) -> str:
        return str(int(value)) if value == int(value) else str(value)

    return (f"exceeded quota: {quota['metadata']['name']}, "
            f"requested: {_pretty({k: requested[k] for k in over})}, "
            f"used: {_pretty({k: text(used.get(k, 0)) for k in over})}, "
            f"limited: {_pretty({k: hard[k] for k in over})}")  # fmt: skip


def admit_claim(store: ObjectStore, claim: dict[str, Any]) -> None:
    """The ResourceQuota admission of a ResourceClaim CREATE: StoreError 403 when it would
    exceed a quota of its namespace (every quota is checked; the first, by name, is told)."""
    from tessera.kube_sim import quota_usage  # (it imports this module)

    meta = claim.get("metadata") or {}
    namespace = str(meta.get("namespace") or "default")
    quotas = store.list("ResourceQuota", Selector(namespace=namespace))
    if not quotas:
        return
    classes = store.list("DeviceClass", Selector())
    pods = store.list("Pod", Selector(namespace=namespace))
    by_uid = {str(p["metadata"].get("uid")): p for p in pods}
    requested = claim_usage(claim, extended_names(classes), by_uid)
    claims = store.list("ResourceClaim", Selector(namespace=namespace))
    for quota in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        hard = (quota.get("spec") or {}).get("hard") or {}
        if not any(key in hard for key in requested):
            continue
        used = {key: parse_quantity(value).value for key, value in
                quota_usage.usage(quota, pods, claims, classes).items() if key in requested}
        sentence = exceeded(quota, requested, used)
        if sentence is not None:
            name = meta.get("name")
            resource = "resourceclaims.resource.k8s.io"
            raise StoreError(403, "Forbidden", f'{resource} "{name}" is forbidden: {sentence}'
                             if name else f"{resource} is forbidden: {sentence}")
