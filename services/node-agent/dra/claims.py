"""What a prepared claim gives whom: pure reading of a ResourceClaim and its pod.

kubelet's NodePrepareResources names a claim (namespace, name, uid); the claim's
`status.allocation.devices.results` say which of this driver's devices it got and, with
consumable capacity (KEP-5075), how much of each (`consumedCapacity`); `status.reservedFor`
names the pod(s) it is reserved for. The pod's `spec.resourceClaims` (with
`status.resourceClaimStatuses` for claims made from a template) and each container's
`resources.claims` say which containers use it.

Everything read here comes from the API server and is validated as any value from the network:
a result naming a device this node does not offer, more memory than the card has or more than
100 % of its compute (`tessera.dra_grants`, shared with the ledger's rebuild), or a configuration
the driver cannot apply (`tessera.dra_config`) is refused with a sentence, never sealed. A MIG
partition becomes a grant of its profile's memory and compute with the instance to make
(`mig`, planned until the driver made it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from tessera import dra_config as config
from tessera import elastic
from tessera.dra_grants import (
    ClaimError,
    PodUse,
    allocation_of,
    claim_ref,
    claim_results,
    container_names,
    pod_claim_names,
    pod_use,
    reserved_pods,
)
from tessera.models import DeviceGrant, DeviceInfo

__all__ = [
    "ClaimDevice", "ClaimError", "PodUse", "PreparedClaim", "allocated_devices", "booked",
    "claim_ref",
    "container_names", "handed_on", "mig_devices", "mps_cards", "plan", "pod_claim_names",
    "pod_use", "reserved_pods", "spill_bytes", "task_priority", "with_instances",
]


class ClaimDevice(BaseModel):
    """One allocated device of a claim, as sealed: the card and the slice of it."""

    request: str
    device: str = Field(description="the device's name in the ResourceSlice, e.g. gpu-0")
    share_id: str = ""
    sharing: str = Field(config.TIME_SLICING, description="TimeSlicing (libvgpu) or MPS")
    grant: DeviceGrant
    admin_access: bool = Field(False, description="adminAccess: reached, never booked")


class PreparedClaim(BaseModel):
    """What the driver prepared for one claim (kept on disk, so a restart knows it)."""

    claim_uid: str
    namespace: str
    name: str
    pod_uid: str
    pod: str
    container_index: int = Field(ge=0, description="the first container using it (init first)")
    container: str = ""
    containers: list[int] = Field(default_factory=list, description="every container using it")
    devices: list[ClaimDevice]
    cdi_device: str = ""


def _obj(value: Any) -> dict[str, Any]:
    """A JSON object as read, or {} for anything else (a value of the wrong type is absent)."""
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def allocated_devices(
    claim: dict[str, Any], node: str, devices: list[DeviceInfo]
) -> list[ClaimDevice]:
    """This driver's devices in the claim's allocation, with the slice each was given
    (`tessera.dra_grants.claim_results`, the reading the ledger's rebuild shares) and how each
    is shared (the claim's and its class's opaque configuration, `tessera.dra_config`)."""
    label = f"ResourceClaim {claim_ref(claim)}"
    allocation = allocation_of(claim)
    out: list[ClaimDevice] = []
    for found in claim_results(claim, node, devices):
        try:
            strategy = config.strategy_for(allocation, found.request, label)
            mode = found.card.mode if found.card is not None else "mig"
            sharing = config.check(strategy, mode, found.device, label)
        except config.ConfigError as exc:
            raise ClaimError(str(exc)) from exc
        out.append(ClaimDevice(request=found.request, device=found.device,
                               share_id=found.share_id, sharing=sharing,
                               grant=found.grant, admin_access=found.admin_access))  # fmt: skip
    if sum(1 for d in out if d.sharing == config.MPS) > 1:
        raise ClaimError(f"{label}: MPS sharing on {len(out)} cards; an MPS client reaches one "
                         "card's daemon, so an MPS claim holds one card (count: 1)")  # fmt: skip
    return out


def booked(records: list[PreparedClaim]) -> list[PreparedClaim]:
    """What the ledger and the quota hold of these prepared claims: every device but those
    reached by admin access (they consume nothing); a claim left with none is not booked."""
    out = []
    for record in records:
        devices = [d for d in record.devices if not d.admin_access]
        if devices:
            out.append(record if len(devices) == len(record.devices)
                       else record.model_copy(update={"devices": devices}))  # fmt: skip
    return out


def mig_devices(record: PreparedClaim) -> list[ClaimDevice]:
    return [d for d in record.devices if d.grant.mig is not None]


def mps_cards(record: PreparedClaim) -> set[str]:
    return {d.grant.uuid for d in record.devices if d.sharing == config.MPS}


def with_instances(record: PreparedClaim, grants: list[DeviceGrant]) -> PreparedClaim:
    """The record's MIG grants as the ledger holds them once made (MIG UUID, state)."""
    made = {(g.uuid, g.mig.profile, g.mig.start): g for g in grants if g.mig is not None}
    devices = []
    for d in record.devices:
        mig = d.grant.mig
        found = made.get((d.grant.uuid, mig.profile, mig.start)) if mig is not None else None
        devices.append(d.model_copy(update={"grant": found}) if found is not None else d)
    return record.model_copy(update={"devices": devices})


def plan(claim: dict[str, Any], pod: dict[str, Any], node: str,
         devices: list[DeviceInfo]) -> PreparedClaim:  # fmt: skip
    """The preparation of `claim` for `pod` (the first pod it is reserved for)."""
    meta = _obj(claim.get("metadata"))
    pod_meta = _obj(pod.get("metadata"))
    found = allocated_devices(claim, node, devices)
    use = pod_use(pod, str(meta.get("name", "")))
    first = use.indices[0] if use.indices else 0
    name = use.names[0] if use.names else ""
    return PreparedClaim(
        claim_uid=str(meta.get("uid", "")), namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")), pod_uid=str(pod_meta.get("uid", "")),
        pod=str(pod_meta.get("name", "")), container_index=first, container=name,
        containers=list(use.indices), devices=found,
    )  # fmt: skip


def handed_on(record: PreparedClaim, claim: dict[str, Any], pod: dict[str, Any],
              node: str) -> PreparedClaim | None:  # fmt: skip
    """The prepared claim booked under `pod`, another pod the claim is reserved for (a shared
    claim), when its recorded pod has ended: None unless `pod` is that very pod (uid as
    reserved), runs on `node` and has not finished."""
    meta, pod_meta = _obj(claim.get("metadata")), _obj(pod.get("metadata"))
    if meta.get("uid") != record.claim_uid:
        return None  # deleted and made again: not the claim prepared here
    reserved = dict((uid, name) for name, uid in reserved_pods(claim))
    uid = str(pod_meta.get("uid", ""))
    if (uid == record.pod_uid or reserved.get(uid) != pod_meta.get("name")
            or _obj(pod.get("spec")).get("nodeName") != node
            or _obj(pod.get("status")).get("phase") in ("Succeeded", "Failed")):
        return None
    use = pod_use(pod, record.name)
    return record.model_copy(update={
        "pod_uid": uid, "pod": str(pod_meta.get("name", "")),
        "container_index": use.indices[0] if use.indices else 0,
        "container": use.names[0] if use.names else "", "containers": list(use.indices),
    })  # fmt: skip


def task_priority(pod: dict[str, Any], index: int) -> int:
    """HAMi's task priority of container `index` (init first): the `CUDA_TASK_PRIORITY` env the
    webhook set from `nvidia.com/priority` (0 high, 1 low: the default)."""
    spec = _obj(pod.get("spec"))
    containers = [*_items(spec.get("initContainers")), *_items(spec.get("containers"))]
    if not 0 <= index < len(containers) or not isinstance(containers[index], dict):
        return 1
    for entry in _items(containers[index].get("env")):
        if isinstance(entry, dict) and entry.get("name") == "CUDA_TASK_PRIORITY":
            return 0 if str(entry.get("value", "")).strip() == "0" else 1
    return 1


def spill_bytes(pod: dict[str, Any], record: PreparedClaim) -> int:
    """Host memory (bytes) the claim's containers may spill to: the pod's opt-in
    (`tessera.io/gpumem-spill`, read from the cluster's pod as the extender path reads it;
    admission validated it). One sealed limits file serves every container using the claim, so
    the smallest of theirs: 0 when one of them did not opt in (none gets what it did not ask)."""
    annotations = _obj(pod.get("metadata")).get("annotations")
    if not isinstance(annotations, dict) or elastic.ANN_GPUMEM_SPILL not in annotations:
        return 0
    names = container_names(pod)
    users = [names[i] for i in record.containers if 0 <= i < len(names)] or [record.container]
    return min(elastic.spill_bytes_of(annotations, names, name) for name in users)
