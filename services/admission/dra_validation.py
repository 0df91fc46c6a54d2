"""Tessera's DRA configuration checked when a claim is written, not when it is prepared.

`resource.k8s.io` leaves a driver's opaque configuration (`DeviceClaimConfiguration.opaque`,
`parameters`: a RawExtension) unchecked: the API reference says validating and versioning it is
the driver's job, and that the `driver` field is what an admission policy the driver provides
reads to decide whether it must validate the parameters. NVIDIA's DRA driver does so with a
validating admission webhook on ResourceClaims and ResourceClaimTemplates (CEL in a
ValidatingAdmissionPolicy is too limited to parse vendor data, as upstream noted). Tessera's
webhook does the same: a claim, a claim template or a DeviceClass whose configuration for
`gpu.tessera.io` is not a valid `GpuConfig` (`tessera.dra_config.parse`, the very check the
driver applies at prepare) is denied with the sentence the driver would have given at prepare,
so the person who wrote it reads it at once instead of a pod that never starts
(`FailedPrepareDynamicResources`, after the allocator placed it). Configuration for other
drivers passes untouched. On UPDATE only a change of this driver's configuration is judged: an
object stored before the webhook was installed (or while `failurePolicy: Ignore` let it
through) must still take a metadata change, above all the removal of its finalizers, or it
could never be deleted. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from tessera import dra_config
from tessera.dra_names import DRIVER_NAME

from .review import Review
from .rules import Admitted, Decision, Denial

PATH = "/validate"  # the validating webhook's path (the chart's ValidatingWebhookConfiguration)
INVALID_CONFIG = "InvalidGpuConfig"
KINDS = {  # kind -> where its configuration entries are
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
    "DeviceClass": ("spec", "config"),
}


def reviews(group: str, kind: str) -> bool:
    return group == "resource.k8s.io" and kind in KINDS


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def driver_entries(kind: str, obj: Any) -> list[Any]:
    """This driver's opaque configuration entries of `obj` (for comparing two versions)."""
    entries = _at(obj, KINDS[kind])
    if not isinstance(entries, list):
        return [entries] if entries is not None else []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("opaque"), dict)
            and e["opaque"].get("driver") == DRIVER_NAME]  # fmt: skip


def config_problems(kind: str, obj: Any) -> list[str]:
    """What is wrong with `obj`'s configuration entries for this driver (none: valid)."""
    path = KINDS[kind]
    entries = _at(obj, path)
    if entries is None:
        return []
    where = ".".join(path)
    if not isinstance(entries, list):
        return [f"{where} is not a list"]
    problems = []
    for i, entry in enumerate(entries):
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if not isinstance(opaque, dict) or opaque.get("driver") != DRIVER_NAME:
            continue  # another driver's (or not opaque): that driver's to check
        try:
            dra_config.parse(opaque.get("parameters"), f"{where}[{i}].opaque.parameters")
        except dra_config.ConfigError as exc:
            problems.append(str(exc))
    return problems


def decide_config(kind: str, obj: Any) -> Decision:
    problems = config_problems(kind, obj)
    if not problems:
        return Admitted(note=f"{kind}: configuration for {DRIVER_NAME} valid")
    name = _at(obj, ("metadata", "name"))
    return Denial(INVALID_CONFIG, f"{kind} {name or ''}: invalid configuration for "
                  f"{DRIVER_NAME}: {'; '.join(problems)}"[:2000])  # fmt: skip


def validate_decision(review: Review) -> Decision:
    """POST /validate: what kube-apiserver's validating webhook call gets. Only DRA objects'
    CREATE and UPDATE are judged; anything else passes (a webhook registered too widely never
    blocks other objects)."""
    if review.operation not in ("CREATE", "UPDATE") or review.sub_resource:
        return Admitted(note=f"operation {review.operation or '?'} is not reviewed")
    if not reviews(review.group, review.kind):
        return Admitted(note=f"{review.group}/{review.kind} is not reviewed here")
    if review.operation == "UPDATE" and (
        driver_entries(review.kind, review.object) == driver_entries(review.kind,
                                                                     review.old_object)):
        return Admitted(note=f"{review.kind}: configuration for {DRIVER_NAME} unchanged")
    return decide_config(review.kind, review.object)
