"""The ResourceQuota keys of DRA devices, as kube-apiserver names them (the Resource Quotas
concept page, "Quota for DRA resource claims"): kube-apiserver counts them and refuses a
ResourceClaim that would exceed one (kube-sim does it as documented: services/kube-sim/dra/
quota.py); Tessera's quota service only shows them beside its own limits (`device_quotas`).

- `count/resourceclaims.resource.k8s.io`: ResourceClaim objects in the namespace;
- `<class>.deviceclass.resource.k8s.io/devices`: devices its claims may get from that class;
- `requests.deviceclass.resource.kubernetes.io/<class>`: the same devices under the class's
  implicit extended resource name (a class's explicit `extendedResourceName` counts in its
  `requests.<name>` form too, which Tessera's quota also reads as its GPU limit: not repeated
  here). Pure.
"""

from __future__ import annotations

from typing import Any

from tessera.models import DeviceQuota

CLAIM_COUNT = "count/resourceclaims.resource.k8s.io"
PER_CLASS = ".deviceclass.resource.k8s.io/devices"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"  # a class's implicit resource name
IMPLICIT_REQUESTS = f"requests.{IMPLICIT_PREFIX}"


def is_device_key(key: str) -> bool:
    """Whether `key` is one of DRA's own quota keys (above)."""
    return key == CLAIM_COUNT or key.endswith(PER_CLASS) or key.startswith(IMPLICIT_REQUESTS)


def device_quotas(obj: Any) -> list[DeviceQuota]:
    """A ResourceQuota's DRA device keys with their hard limit and used figure, by key."""
    if not isinstance(obj, dict):
        return []
    meta = obj.get("metadata") or {}
    hard = (obj.get("spec") or {}).get("hard") or {}
    used = (obj.get("status") or {}).get("used") or {}
    if not isinstance(hard, dict) or not isinstance(used, dict):
        return []
    return [DeviceQuota(namespace=str(meta.get("namespace") or "default"),
                        quota=str(meta.get("name") or ""), key=str(key), hard=str(hard[key]),
                        used=str(used.get(key, "")))
            for key in sorted(hard) if is_device_key(str(key))]  # fmt: skip
