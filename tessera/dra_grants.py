"""What an allocated ResourceClaim of Tessera's DRA driver grants: pure reading, one home.

Two readers need exactly the same answer: the node agent's driver when kubelet asks it to
prepare a claim (it seals the grant as the container's limits), and the ledger's rebuild when
NATS lost its store (the claim's `status.allocation` is the cluster's durable record of a DRA
pod's slice, as HAMi's annotations are of an extender pod's). So the devices a node publishes
(`gpu-<index>` for a whole card, `gpu-<index>-mig-<profile>-<start>` for a MIG partition), the
reading of `status.allocation.devices.results` (`consumedCapacity`, KEP-5075) and of which of a
pod's containers use a claim live here.

Everything read comes from the API server and is validated as any value from the network: a
result naming a device the node does not offer, more memory than the card has or more than
100 % of its compute is refused with a sentence (`ClaimError`), never granted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tessera import dra_names as names
from tessera import mig as mig_tables
from tessera.models import DeviceGrant, DeviceInfo, MigInstanceGrant
from tessera.quantity import QuantityError, parse

MIB = 1 << 20
SLICED_MODES = frozenset({"hami-core", "mps"})  # cards published whole, shared by slices


class ClaimError(ValueError):
    """The claim cannot be granted here; the message is a sentence a person can act on."""


# --- the devices a node publishes --------------------------------------------------------------


def device_name(device: DeviceInfo) -> str:
    return f"gpu-{device.index}"


def partition_name(device: DeviceInfo, profile: str, start: int) -> str:
    """A DNS label: the profile's dot becomes a dash (`1g.10gb` → `1g-10gb`)."""
    return f"gpu-{device.index}-mig-{profile.replace('.', '-')}-{start}"


def model_of(device: DeviceInfo) -> mig_tables.MigModel | None:
    """The card's MIG model when it serves dynamic MIG (mode `mig`, capability set)."""
    if device.mode != "mig" or device.mig is None:
        return None
    return mig_tables.model_for(device.mig.model) or mig_tables.model_for(device.type)


def offered_profiles(model: mig_tables.MigModel, device: DeviceInfo
                     ) -> list[mig_tables.MigProfile]:  # fmt: skip
    allowed = {p for g in (device.mig.geometries if device.mig else []) for p in g}
    return [p for p in model.profiles if not allowed or p.name in allowed]


def placement_of(device: DeviceInfo, name: str) -> tuple[str, int] | None:
    """(profile, start) of the partition `name` of this card, None when it names none (or one
    the card does not offer now)."""
    model = model_of(device)
    if model is None:
        return None
    for profile in offered_profiles(model, device):
        for start in profile.starts:
            if partition_name(device, profile.name, start) == name:
                return profile.name, start
    return None


def whole_cards(devices: list[DeviceInfo]) -> dict[str, DeviceInfo]:
    """The cards the pool offers whole, by device name."""
    return {device_name(d): d for d in devices
            if d.mode in SLICED_MODES and model_of(d) is None}  # fmt: skip


def partition_grant(devices: list[DeviceInfo], name: str) -> DeviceGrant | None:
    """The grant of MIG partition `name` (its card, the profile's memory and cores, the
    instance to make: planned), None when no card of this node publishes it."""
    for card in devices:
        placement = placement_of(card, name)
        model = model_of(card)
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


# --- a claim's allocation ---------------------------------------------------------------------


@dataclass(frozen=True)
class ResultGrant:
    """One of this driver's devices in a claim's allocation, and the slice of it granted."""

    request: str
    device: str  # the device's name in the ResourceSlice, e.g. gpu-0
    card: DeviceInfo | None  # the whole card; None for a MIG partition
    grant: DeviceGrant
    share_id: str = ""
    # `adminAccess: true` (monitoring, management): the device is reached, nothing is consumed
    # ("ignore all ordinary claims to the device ... and any resource allocations"), so it is
    # never booked as a slice (ledger, quota)
    admin_access: bool = False


def _obj(value: Any) -> dict[str, Any]:
    """A JSON object as read, or {} for anything else (a value of the wrong type is absent)."""
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def mib(value: object, what: str) -> int:
    """A quantity of bytes in whole MiB, rounded up (a byte over a MiB is one more MiB)."""
    try:
        amount = parse(value).value
    except QuantityError as exc:
        raise ClaimError(f"{what}: {exc}") from exc
    in_mib = amount / MIB
    whole = int(in_mib) if in_mib == int(in_mib) else int(in_mib) + 1
    if whole < 0:
        raise ClaimError(f"{what}: negative")
    return whole


def whole_number(value: object, what: str) -> int:
    try:
        amount: Fraction = parse(value).value
    except QuantityError as exc:
        raise ClaimError(f"{what}: {exc}") from exc
    if amount < 0 or amount != int(amount):
        raise ClaimError(f"{what}: {value!r} is not a whole number ≥ 0")
    return int(amount)


def claim_ref(claim: dict[str, Any]) -> str:
    meta = _obj(claim.get("metadata"))
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def allocation_of(claim: dict[str, Any]) -> dict[str, Any]:
    """The claim's `status.allocation`; ClaimError when it has none."""
    allocation = _obj(claim.get("status")).get("allocation")
    if not isinstance(allocation, dict):
        raise ClaimError(f"ResourceClaim {claim_ref(claim)} is not allocated")
    return allocation


def is_ours(result: Any) -> bool:
    return isinstance(result, dict) and result.get("driver") == names.DRIVER_NAME


def claim_results(claim: dict[str, Any], node: str, devices: list[DeviceInfo]
                  ) -> list[ResultGrant]:  # fmt: skip
    """This driver's devices in the claim's allocation on `node`, with the slice each was given.

    Without `consumedCapacity` (a device allocated whole: no consumable capacity) the grant is
    the whole card: its memory and 100 % of its compute. Another driver's device in the same
    claim is that driver's to prepare, and skipped."""
    label = f"ResourceClaim {claim_ref(claim)}"
    results = _obj(allocation_of(claim).get("devices")).get("results") or []
    if not isinstance(results, list):
        raise ClaimError(f"{label}: status.allocation.devices.results is not a list")
    cards = whole_cards(devices)
    out: list[ResultGrant] = []
    for i, result in enumerate(results):
        if not is_ours(result):
            continue
        where = f"{label} result {i}"
        if result.get("pool") != node:
            raise ClaimError(f"{where}: pool {result.get('pool')!r} is not this node's ({node})")
        name = result.get("device")
        request = str(result.get("request") or "")
        card = cards.get(name) if isinstance(name, str) else None
        if card is None:
            placed = partition_grant(devices, name) if isinstance(name, str) else None
            if placed is None:
                raise ClaimError(f"{where}: device {name!r} is not one this node offers")
            out.append(ResultGrant(request=request, device=str(name), card=None, grant=placed,
                                   admin_access=result.get("adminAccess") is True))
            continue
        out.append(ResultGrant(
            request=request, device=str(name), card=card, share_id=str(result.get("shareID") or ""),
            grant=_card_grant(card, result.get("consumedCapacity"), where),
            admin_access=result.get("adminAccess") is True,
        ))  # fmt: skip
    if not out:
        raise ClaimError(f"{label} holds no device of {names.DRIVER_NAME} on {node}")
    return out


def _card_grant(card: DeviceInfo, consumed: Any, where: str) -> DeviceGrant:
    if consumed is None:
        memory, cores = card.memory_mib, min(card.cores, 100)
    elif not isinstance(consumed, dict):
        raise ClaimError(f"{where}: consumedCapacity is not a map")
    else:
        memory = (mib(consumed[names.CAP_MEMORY], f"{where} memory")
                  if names.CAP_MEMORY in consumed else card.memory_mib)  # fmt: skip
        cores = (whole_number(consumed[names.CAP_CORES], f"{where} cores")
                 if names.CAP_CORES in consumed else 0)  # fmt: skip
    if memory > card.memory_mib:
        raise ClaimError(f"{where}: {memory} MiB of {device_name(card)}, which offers "
                         f"{card.memory_mib} MiB")  # fmt: skip
    if cores > 100:
        raise ClaimError(f"{where}: {cores} % of {device_name(card)}'s compute; one allocation "
                         "takes at most 100")  # fmt: skip
    return DeviceGrant(uuid=card.uuid, type=card.type, memory_mib=memory, cores=cores)


def result_pools(claim: dict[str, Any]) -> set[str]:
    """The pools (nodes) of this driver's devices in the claim's allocation (none: not ours or
    not allocated)."""
    allocation = _obj(_obj(claim.get("status")).get("allocation"))
    results = _items(_obj(allocation.get("devices")).get("results"))
    return {str(r.get("pool")) for r in results if is_ours(r)}


# --- which pods and containers use a claim ------------------------------------------------------


@dataclass(frozen=True)
class PodUse:
    """Which of the pod's containers use the claim (indices: init containers first)."""

    indices: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


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
