"""The grant the agent is about to seal, checked against what the pod asked for.

The ledger is written over the bus; a grant in it is only sealed into a container if the cluster
agrees: it may not exceed the pod's own request (HAMi's reading of its resources, per GPU), nor
drop a limit the pod asked for (0 MiB or 0 % means unlimited). A grant raised since by
`limits.set` is recorded by the agent in the pod's `hami.io/vgpu-devices-allocated`
annotation, signed with the agent's own key in `tessera.io/grants-signature`; a grant equal to
that record is accepted only when the signature verifies (`record_ok`): whoever may write a pod's
annotations or status (admission denies tenants, but not every writer) cannot forge it. Pure: the
caller fetches the pod and checks the signature.
"""

from __future__ import annotations

from typing import Any

from tessera import elastic, hami, signing
from tessera.device_kinds import pod_grants, registry
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo
from tessera.settings import TesseraSettings


class GrantRefused(Exception):
    """The ledger's grant is not what the pod asked for (the message says how)."""


def recorded_text(pod: dict[str, Any]) -> tuple[str, str | None, str]:
    """(the pod's uid, its `hami.io/…-devices-allocated` (each family's, as one text), the
    record's signature)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    try:
        text = pod_grants.pod_grants_text(annotations, pod_grants.ALLOCATED)
    except ValueError:
        text = None  # a malformed record is no record
    return (str(meta.get("uid") or ""), text,
            annotations.get(signing.RECORD_ANNOTATION))  # fmt: skip


def recorded_grants(pod: dict[str, Any], index: int) -> list[DeviceGrant] | None:
    """The container's grants as `limits.set` last recorded them on the pod, if it did."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    try:
        text = pod_grants.pod_grants_text(annotations, pod_grants.ALLOCATED)
        if not text:
            return None
        containers = hami.decode_pod_devices(text)
    except ValueError:
        return None
    return containers[index] if index < len(containers) else None


def check_grant(
    pod: dict[str, Any],
    index: int,
    grants: list[DeviceGrant],
    devices: dict[str, DeviceInfo],
    settings: TesseraSettings,
    record_ok: bool = False,
) -> None:
    """Raise GrantRefused unless `grants` (container `index`, init containers first) stay
    within the pod's request, or equal the record limits.set signed (`record_ok`)."""
    meta = pod.get("metadata") or {}
    who = f"pod {meta.get('namespace')}/{meta.get('name')}"
    if record_ok and recorded_grants(pod, index) == grants:
        return  # exactly what limits.set recorded, and signed, on the pod
    try:
        requests = hami.parse_pod_request(pod, settings).all
    except hami.RequestError as exc:
        raise GrantRefused(f"{who}: its GPU request cannot be read: {exc}") from exc
    request = requests[index] if index < len(requests) else None
    if request is None:
        raise GrantRefused(f"{who} container #{index} asks for no GPU but the ledger grants one")
    if len(grants) > request.count:
        raise GrantRefused(
            f"{who} container #{index}: ledger grants {len(grants)} GPUs, the pod asks "
            f"{request.count}"
        )
    for grant in grants:
        device = devices.get(grant.uuid)
        card = device.memory_mib if device is not None else 0
        asked = request.memory_on(card) if request.memory_percentage is not None else (
            request.memory_mib
        )
        if grant.mig is not None:
            check_mig_grant(grant, device, asked, request.cores, f"{who} container #{index}")
            continue
        # A kind that rounds a request up (an Ascend vNPU template) grants the rounded amounts.
        rounded = registry.rounded_take(device, request, grant.type)
        cores = request.cores
        if rounded is not None:
            asked, cores = rounded.memory_mib, rounded.cores
        if grant.memory_mib > asked or grant.memory_mib <= 0:
            raise GrantRefused(
                f"{who} container #{index}: ledger grants {grant.memory_mib} MiB on "
                f"{grant.uuid}, the pod asks {asked} MiB: refusing to seal a forged grant"
            )
        if cores and not 0 < grant.cores <= cores:
            raise GrantRefused(
                f"{who} container #{index}: ledger grants {grant.cores}% compute on "
                f"{grant.uuid}, the pod asks {cores}%: refusing to seal a forged grant"
            )
        burst = elastic.burst_of_grant(request.burst, grant, card) if request.burst else (0, 0)
        if grant.memory_limit_mib > burst[0] or grant.cores_limit > burst[1]:
            raise GrantRefused(
                f"{who} container #{index}: ledger grants a burst limit of "
                f"{grant.memory_limit_mib} MiB / {grant.cores_limit}% on {grant.uuid}, the pod "
                f"asks {burst[0]} MiB / {burst[1]}%: refusing to seal a forged grant"
            )


def check_mig_grant(
    grant: DeviceGrant, device: DeviceInfo | None, memory: int, cores: int, who: str
) -> None:
    """A dynamic MIG grant is charged its profile's size, more than asked: it must be a profile
    of the card's model that covers the request, charged exactly the profile's amounts."""
    from tessera import mig
    from tessera.device_kinds.nvidia.mig import instance_charge

    assert grant.mig is not None
    if device is None or device.mig is None:
        raise GrantRefused(f"{who}: ledger grants a MIG instance on {grant.uuid}, which does "
                           "not serve dynamic MIG")  # fmt: skip
    try:
        profile, memory_mib, percent = instance_charge(grant, device)
    except mig.MigError as exc:
        raise GrantRefused(f"{who}: {exc}") from exc
    charge = (memory_mib, percent)
    if (grant.memory_mib, grant.cores) != charge or charge[0] < memory or charge[1] < cores:
        raise GrantRefused(
            f"{who}: ledger grants MIG {profile.name} ({grant.memory_mib} MiB / {grant.cores}%) "
            f"on {grant.uuid} for an ask of {memory} MiB / {cores}%: refusing to seal a forged "
            "grant")


# --- what is already sealed on this node's cards (issue 34) ---------------------------------
# The ledger can be wrong about which card a running container uses: after NATS lost its store
# it is rebuilt from the pods' annotations, and an annotation moved to another card of the node
# (within that card's capacity and the pod's request) is restored there. What the agent sealed
# is what the containers really hold; a grant that would put a card over its capacity beside
# what is sealed there is never sealed, and every sealed container the ledger places elsewhere
# is reported.

Sealed = dict[tuple[str, int], dict[str, int]]  # (pod uid, container index) -> uuid -> MiB


def check_sealed_capacity(
    who: str, grants: list[DeviceGrant], sealed: Sealed, devices: dict[str, DeviceInfo],
) -> None:
    """Raise GrantRefused when sealing `grants` would put a card over its memory beside what
    the node's other live containers have sealed on it (`sealed`, this container excluded)."""
    for grant in grants:
        device = devices.get(grant.uuid)
        if device is None or grant.mig is not None:
            continue  # an unknown card or a MIG instance is the other checks' business
        held = sum(limits.get(grant.uuid, 0) for limits in sealed.values())
        if held + grant.memory_mib > device.memory_mib:
            raise GrantRefused(
                f"{who}: sealing {grant.memory_mib} MiB on {grant.uuid} would put it at "
                f"{held + grant.memory_mib} MiB of {device.memory_mib} MiB beside what running "
                "containers have sealed there: the ledger disagrees with the node"
            )


def sealed_disagreements(
    sealed: Sealed, ledger_grants: dict[str, list[list[DeviceGrant]]],
    names: dict[str, str],
) -> list[str]:
    """Each sealed container whose ledger grant names other cards than it sealed (the ledger
    was restored from a forged annotation, or edited): one message each."""
    found = []
    for (uid, index), limits in sorted(sealed.items()):
        containers = ledger_grants.get(uid)
        if containers is None or not limits or index < 0:
            continue
        grants = containers[index] if index < len(containers) else []
        if any(g.mig is not None for g in grants):
            continue  # sealed on the MIG instance's own UUID, not the card's
        granted = {g.uuid for g in grants}
        if granted != set(limits):
            found.append(
                f"pod {names.get(uid, uid)} container #{index} has sealed "
                f"{', '.join(f'{m} MiB on {u}' for u, m in sorted(limits.items()))} but the "
                f"ledger grants it {', '.join(sorted(granted)) or 'nothing'}"
            )
    return found


def counted_sealed(
    sealed: Sealed, allocations: dict[str, Allocation], sealing: tuple[str, int]
) -> Sealed:
    """What of `sealed` holds memory now: init containers of a pod whose app containers have
    started (or are being sealed, `sealing`) have finished; the rest of a pod's init containers
    run one at a time, so they count as their largest per card (HAMi's max(init peak, app))."""
    counted: Sealed = {}
    for uid in {uid for uid, _ in sealed}:
        allocation = allocations.get(uid)
        init = set(range(allocation.init_count)) - set(allocation.sidecars) if allocation else set()
        mine = {index: limits for (u, index), limits in sealed.items() if u == uid}
        app_started = any(i not in init for i in mine) or (
            sealing[0] == uid and sealing[1] not in init)
        for index, limits in mine.items():
            if index not in init:
                counted[(uid, index)] = limits
        if not app_started and not (allocation and allocation.init_done):
            peak: dict[str, int] = {}
            for index in init & set(mine):
                for uuid, mib in mine[index].items():
                    peak[uuid] = max(peak.get(uuid, 0), mib)
            if peak:
                counted[(uid, -1)] = peak
    return counted


def sealed_repair(
    allocations: dict[str, Allocation], sealed: Sealed, devices: dict[str, DeviceInfo],
) -> tuple[dict[str, Allocation], list[str]]:
    """The ledger's allocations put back on the cards their containers sealed, where the ledger
    places an allocated pod's container elsewhere (one GPU per card, no MIG), when that leaves
    no card over its memory in the ledger: (the changed allocations, what could not be put
    back). The node is what runs; the ledger follows it, never the other way."""
    changed: dict[str, Allocation] = {}
    unrepaired: list[str] = []
    for (uid, index), limits in sorted(sealed.items()):
        allocation = changed.get(uid) or allocations.get(uid)
        if allocation is None or index < 0 or index >= len(allocation.containers):
            continue
        grants = allocation.containers[index]
        if ({g.uuid for g in grants} == set(limits) or len(grants) != len(limits)
                or any(g.mig is not None for g in grants)
                or allocation.state != AllocationState.ALLOCATED):
            continue
        put_back = [grant.model_copy(update={"uuid": uuid, "memory_mib": limits[uuid]})
                    for grant, uuid in zip(grants, sorted(limits), strict=True)]
        containers = [*allocation.containers]
        containers[index] = put_back
        candidate = allocation.model_copy(update={"containers": containers})
        if _ledger_over_capacity({**allocations, **changed, uid: candidate}, devices):
            unrepaired.append(f"{allocation.namespace}/{allocation.name} container #{index}")
            continue
        changed[uid] = candidate
    return changed, unrepaired


def _ledger_over_capacity(
    allocations: dict[str, Allocation], devices: dict[str, DeviceInfo]
) -> bool:
    from tessera.restore import usage_on  # HAMi's max(init peak, app sum) per card

    used: dict[str, int] = {}
    for allocation in allocations.values():
        if not allocation.active:
            continue
        for uuid in {g.uuid for grants in allocation.containers for g in grants}:
            used[uuid] = used.get(uuid, 0) + usage_on(allocation, uuid)[0]
    return any(mib > devices[u].memory_mib for u, mib in used.items() if u in devices)
