"""What a prepared claim gives whom: pure reading of a ResourceClaim and its pod.

kubelet's NodePrepareResources names a claim (namespace, name, uid); the claim's
`status.allocation.devices.results` say which of this driver's devices it got and, with
consumable capacity (KEP-5075), how much of each (`consumedCapacity`); `status.reservedFor`
names the pod(s) it is reserved for. The pod's `spec.resourceClaims` (with
`status.resourceClaimStatuses` for claims made from a template) and each container's
`resources.claims` say which containers use it.

Everything read here comes from the API server and is validated as any value from the network:
a result naming a device this node does not offer, more memory than the card has or more than
100 % of its compute, or a configuration the driver cannot apply (`config.py`) is refused with a
sentence, never sealed. A MIG partition (`partitions.py`) becomes a grant of its profile's
memory and compute with the instance to make (`mig`, planned until the driver made it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, Field

from tessera.models import DeviceGrant, DeviceInfo, MigInstanceGrant
from tessera.quantity import QuantityError, parse

from . import config, names, partitions
from .slices import SLICED_MODES, device_name

MIB = 1 << 20


class ClaimError(ValueError):
    """The claim cannot be prepared here; the message is a sentence kubelet shows the user."""


class ClaimDevice(BaseModel):
    """One allocated device of a claim, as sealed: the card and the slice of it."""

    request: str
    device: str = Field(description="the device's name in the ResourceSlice, e.g. gpu-0")
    share_id: str = ""
    sharing: str = Field(config.TIME_SLICING, description="TimeSlicing (libvgpu) or MPS")
    grant: DeviceGrant


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


@dataclass(frozen=True)
class PodUse:
    """Which of the pod's containers use the claim (indices: init containers first)."""

    indices: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def _obj(value: Any) -> dict[str, Any]:
    """A JSON object as read, or {} for anything else (a value of the wrong type is absent)."""
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _mib(value: object, what: str) -> int:
    try:
        amount = parse(value).value
    except QuantityError as exc:
        raise ClaimError(f"{what}: {exc}") from exc
    mib = amount / MIB
    whole = int(mib) if mib == int(mib) else int(mib) + 1  # a byte over a MiB is one more MiB
    if whole < 0:
        raise ClaimError(f"{what}: negative")
    return whole


def _whole(value: object, what: str) -> int:
    try:
        amount: Fraction = parse(value).value
    except QuantityError as exc:
        raise ClaimError(f"{what}: {exc}") from exc
    if amount < 0 or amount != int(amount):
        raise ClaimError(f"{what}: {value!r} is not a whole number ≥ 0")
    return int(amount)


def allocated_devices(
    claim: dict[str, Any], node: str, devices: list[DeviceInfo]
) -> list[ClaimDevice]:
    """This driver's devices in the claim's allocation, with the slice each was given.

    Without `consumedCapacity` (a device allocated whole: no consumable capacity) the grant is
    the whole card: its memory and 100 % of its compute."""
    label = f"ResourceClaim {claim_ref(claim)}"
    allocation = _obj(claim.get("status")).get("allocation")
    if not isinstance(allocation, dict):
        raise ClaimError(f"{label} is not allocated")
    results = _obj(allocation.get("devices")).get("results") or []
    if not isinstance(results, list):
        raise ClaimError(f"{label}: status.allocation.devices.results is not a list")
    by_name = {device_name(d): d for d in devices  # whole cards the pool offers
               if d.mode in SLICED_MODES and partitions.model_of(d) is None}  # fmt: skip
    out: list[ClaimDevice] = []
    for i, result in enumerate(results):
        if not isinstance(result, dict) or result.get("driver") != names.DRIVER_NAME:
            continue  # another driver's device in the same claim: that driver prepares it
        where = f"{label} result {i}"
        if result.get("pool") != node:
            raise ClaimError(f"{where}: pool {result.get('pool')!r} is not this node's ({node})")
        name = result.get("device")
        request = str(result.get("request") or "")
        card = by_name.get(name) if isinstance(name, str) else None
        placed = None if card is not None or not isinstance(name, str) else _partition(
            devices, name)  # fmt: skip
        if card is None and placed is None:
            raise ClaimError(f"{where}: device {name!r} is not one this node offers")
        try:
            strategy = config.strategy_for(allocation, request, label)
            if placed is not None:
                config.check(strategy, "mig", str(name), label)
                out.append(ClaimDevice(request=request, device=str(name), grant=placed))
                continue
            assert card is not None
            sharing = config.check(strategy, card.mode, str(name), label)
        except config.ConfigError as exc:
            raise ClaimError(str(exc)) from exc
        consumed = result.get("consumedCapacity")
        if consumed is None:
            memory, cores = card.memory_mib, min(card.cores, 100)
        elif not isinstance(consumed, dict):
            raise ClaimError(f"{where}: consumedCapacity is not a map")
        else:
            memory = (_mib(consumed[names.CAP_MEMORY], f"{where} memory")
                      if names.CAP_MEMORY in consumed else card.memory_mib)  # fmt: skip
            cores = (_whole(consumed[names.CAP_CORES], f"{where} cores")
                     if names.CAP_CORES in consumed else 0)  # fmt: skip
        if memory > card.memory_mib:
            raise ClaimError(f"{where}: {memory} MiB of {name}, which offers {card.memory_mib} MiB")
        if cores > 100:
            raise ClaimError(f"{where}: {cores} % of {name}'s compute; one allocation takes at "
                             "most 100")  # fmt: skip
        share = result.get("shareID") or ""
        out.append(ClaimDevice(
            request=request, device=name, share_id=str(share), sharing=sharing,
            grant=DeviceGrant(uuid=card.uuid, type=card.type, memory_mib=memory, cores=cores),
        ))  # fmt: skip
    if sum(1 for d in out if d.sharing == config.MPS) > 1:
        raise ClaimError(f"{label}: MPS sharing on {len(out)} cards; an MPS client reaches one "
                         "card's daemon, so an MPS claim holds one card (count: 1)")  # fmt: skip
    if not out:
        raise ClaimError(f"{label} holds no device of {names.DRIVER_NAME} on {node}")
    return out


def _partition(devices: list[DeviceInfo], name: str) -> DeviceGrant | None:
    """The grant of MIG partition `name` (its card, the profile's memory and cores, the
    instance to make: planned), None when no card of this node publishes it."""
    for card in devices:
        placement = partitions.placement_of(card, name)
        model = partitions.model_of(card)
        if placement is None or model is None:
            continue
        profile = model.profile(placement[0])
        return DeviceGrant(
            uuid=card.uuid, type=card.type, memory_mib=model.profile_memory_mib(profile),
            cores=model.profile_cores(profile),
            mig=MigInstanceGrant(profile=profile.name, start=placement[1],
                                 size=profile.memory_slices),
        )  # fmt: skip
    return None


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


def claim_ref(claim: dict[str, Any]) -> str:
    meta = _obj(claim.get("metadata"))
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def reserved_pods(claim: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, uid) of every pod the claim is reserved for, in order."""
    reserved = _items(_obj(claim.get("status")).get("reservedFor"))
    return [
        (str(r.get("name", "")), str(r.get("uid", "")))
        for r in reserved
        if isinstance(r, dict) and r.get("resource", "pods") == "pods" and not r.get("apiGroup")
    ]


def pod_claim_names(pod: dict[str, Any], claim_name: str) -> set[str]:
    """The pod's own names (`spec.resourceClaims[].name`) for the ResourceClaim `claim_name`."""
    spec = _obj(pod.get("spec"))
    status = _obj(pod.get("status"))
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in _items(status.get("resourceClaimStatuses"))
        if isinstance(s, dict)
    }
    found: set[str] = set()
    for entry in _items(spec.get("resourceClaims")):
        if not isinstance(entry, dict):
            continue
        local = entry.get("name")
        if entry.get("resourceClaimName") == claim_name or generated.get(local) == claim_name:
            found.add(str(local))
    return found


def pod_use(pod: dict[str, Any], claim_name: str) -> PodUse:
    """The containers (init first) whose `resources.claims` name the claim."""
    local = pod_claim_names(pod, claim_name)
    spec = _obj(pod.get("spec"))
    use = PodUse()
    index = 0
    for section in ("initContainers", "containers"):
        for container in _items(spec.get(section)):
            refs = (_items(_obj(container.get("resources")).get("claims"))
                    if isinstance(container, dict) else [])  # fmt: skip
            if any(isinstance(r, dict) and r.get("name") in local for r in refs):
                use.indices.append(index)
                use.names.append(str(container.get("name", "")))
            index += 1
    return use


def container_names(pod: dict[str, Any]) -> list[str]:
    spec = _obj(pod.get("spec"))
    return [str(c.get("name", "")) for s in ("initContainers", "containers")
            for c in _items(spec.get(s)) if isinstance(c, dict)]  # fmt: skip


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
