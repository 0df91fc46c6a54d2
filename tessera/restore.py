"""What bound pods say they hold: allocations read back from HAMi's pod annotations.

The cluster is the durable record (DESIGN §4): every GPU pod the scheduler binds carries its grants
in its device family's `hami.io/…-devices-to-allocate` (NVIDIA's `hami.io/vgpu-devices-to-allocate`;
tessera.device_kinds.pod_grants) and `hami.io/vgpu-node`, `hami.io/bind-phase`. When NATS
lost its store, the scheduler rebuilds the ledger and quota rebuilds its charges from these.
Pure code, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from tessera import bus_permissions as bp
from tessera import elastic, hami, signing
from tessera.device_kinds import pod_grants, registry
from tessera.device_kinds.nvidia.mig import instance_charge
from tessera.dra_names import DRA_REASON
from tessera.mig import MigError
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, InFlightClaim
from tessera.settings import TesseraSettings

FINISHED_PHASES = ("Succeeded", "Failed")


def init_containers_succeeded(pod: dict[str, Any]) -> bool:
    """Every init container has terminated with exit code 0."""
    spec = pod.get("spec") or {}
    wanted = len(spec.get("initContainers") or [])
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    if wanted == 0 or len(statuses) < wanted:
        return False
    for status in statuses:
        terminated = ((status or {}).get("state") or {}).get("terminated") or {}
        if terminated.get("exitCode") != 0:
            return False
    return True


@dataclass
class RestoreReport:
    """What one pass over the pods found and did (logged; counted in metrics)."""

    pods_seen: int = 0
    gpu_pods: int = 0
    restored: int = 0
    nodes_written: int = 0
    unreadable: list[str] = field(default_factory=list)  # "ns/name: why"
    unknown_devices: list[str] = field(default_factory=list)  # "ns/name on node: uuid"
    # Issue 34: annotations that are not what the node's agent recorded (cut to the request
    # or refused), and pods not restored because what they claim cannot be true.
    forged: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def allocation_from_pod(
    pod: dict[str, Any], *, quota_held: bool, now: float, claim_ttl_s: float
) -> tuple[Allocation, InFlightClaim | None] | None:
    """The allocation a bound, unfinished pod runs on, from its annotations (None: not a bound
    GPU pod). Raises ValueError when the annotations are present but malformed."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    node = spec.get("nodeName")
    annotations = meta.get("annotations") or {}
    if not node or status.get("phase") in FINISHED_PHASES or not isinstance(annotations, dict):
        return None
    text = pod_grants.pod_grants_text(annotations)  # each family's record (HAMi's keys)
    if not text:
        return None
    granted_on = annotations.get(hami.ANN_VGPU_NODE)
    if granted_on and granted_on != node:
        raise ValueError(f"granted on {granted_on} but bound to {node}")
    containers = hami.decode_pod_devices(str(text))
    containers = elastic.with_burst(containers, annotations.get(elastic.ANN_BURST_ALLOCATED))
    if not any(containers):
        return None
    init = spec.get("initContainers") or []
    app = spec.get("containers") or []
    names = [str((c or {}).get("name", "")) for c in [*init, *app]]
    if len(containers) > len(names):
        raise ValueError(f"{len(containers)} grant lists for {len(names)} containers")
    allocating = annotations.get(hami.ANN_BIND_PHASE) == hami.BIND_PHASE_ALLOCATING
    uid, namespace, name = meta.get("uid") or "", meta.get("namespace") or "default", meta["name"]
    allocation = Allocation(
        pod_uid=uid, namespace=namespace, name=name, node=node, containers=containers,
        init_count=len(init), init_done=init_containers_succeeded(pod),
        state=AllocationState.BOUND if allocating else AllocationState.ALLOCATED,
        created_at=now, updated_at=now, container_names=names, quota_held=quota_held,
        reason="restored from the pod's annotations",
    )  # fmt: skip
    # A pod between bind and its node agent's Allocate needs the node's claim to be served.
    claim = None
    if allocating:
        claim = InFlightClaim(pod_uid=uid, namespace=namespace, name=name, taken_at=now,
                              expires_at=now + claim_ttl_s, holder="rebuild")  # fmt: skip
    return allocation, claim


def allocations_from_pods(
    pods: Iterable[dict[str, Any]], *, quota_held: bool, now: float, claim_ttl_s: float,
    report: RestoreReport,
) -> dict[str, list[tuple[Allocation, InFlightClaim | None]]]:
    """Bound, unfinished GPU pods grouped by node."""
    by_node: dict[str, list[tuple[Allocation, InFlightClaim | None]]] = defaultdict(list)
    for pod in pods:
        report.pods_seen += 1
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not meta.get("uid") or not meta.get("name"):
            continue
        try:
            found = allocation_from_pod(pod, quota_held=quota_held, now=now,
                                        claim_ttl_s=claim_ttl_s)  # fmt: skip
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # hostile shapes too
            why = exc if isinstance(exc, ValueError | TypeError) else f"malformed pod ({exc!r})"
            report.unreadable.append(f"{meta.get('namespace')}/{meta.get('name')}: {why}"[:300])
            continue
        if found is not None:
            report.gpu_pods += 1
            by_node[found[0].node].append(found)
    return by_node


# --- what is restored is checked as a live ledger value is (issue 34) -------------------------


@dataclass
class RestoreRules:
    """What a restored grant is checked against. `node_keys`: the node agents' public keys
    (the trust file): an `-allocated` record the node's agent signed is what it allocated or
    raised with limits.set, and is believed as written; any other annotation is only a claim."""

    settings: TesseraSettings
    node_keys: Mapping[str, Ed25519PublicKey] | None = None


def usage_on(allocation: Allocation, uuid: str) -> tuple[int, int]:
    """(MiB, cores) a pod holds on one GPU: max(init peak, app sum), as HAMi counts it."""

    def on(grants: list[list[DeviceGrant]]) -> tuple[int, int]:
        found = [g for c in grants for g in c if g.uuid == uuid]
        return sum(g.memory_mib for g in found), sum(g.cores for g in found)

    app = on(allocation.app_grants())
    peaks = [on([c]) for c in allocation.init_grants()] if not allocation.init_done else []
    return max([app[0], *(p[0] for p in peaks)]), max([app[1], *(p[1] for p in peaks)])


def _signed_record(pod: dict[str, Any], node: str, rules: RestoreRules) -> bool | None:
    """True: the node's agent signed the pod's -allocated; False: a signature that does not
    verify (a forgery); None: no signature to judge (or no keys)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    signature = annotations.get(signing.RECORD_ANNOTATION)
    value = pod_grants.pod_grants_text(annotations, pod_grants.ALLOCATED)
    if rules.node_keys is None or not signature:
        return None
    return bool(value) and signing.record_verifies(
        str(signature), str(meta.get("uid") or ""), str(value),
        bp.user_name(bp.NODE_AGENT, node), rules.node_keys,
    )


def within_request(
    allocation: Allocation, pod: dict[str, Any], devices: Mapping[str, DeviceInfo] | None,
    settings: TesseraSettings,
) -> tuple[Allocation, list[str]]:
    """The allocation with every grant cut to what the pod's spec asks (GPU count, memory per
    GPU, compute %), and what was cut: what the scheduler could have granted, never more. A
    grant rounded up by its kind holds the rounded amounts (an Ascend template), a dynamic MIG
    grant its profile's (`_as_instance`)."""
    problems: list[str] = []
    try:
        requests = hami.parse_pod_request(pod, settings).all
    except hami.RequestError as exc:
        raise ValueError(f"its GPU request cannot be read: {exc}") from exc
    containers: list[list[DeviceGrant]] = []
    for index, grants in enumerate(allocation.containers):
        request = requests[index] if index < len(requests) else None
        if request is None:
            if grants:
                problems.append(f"container #{index} asks no GPU but is granted {len(grants)}")
            containers.append([])
            continue
        if len(grants) > request.count:
            problems.append(f"container #{index} is granted {len(grants)} GPUs, asks "
                            f"{request.count}")  # fmt: skip
        cut: list[DeviceGrant] = []
        for grant in grants[: request.count]:
            device = devices.get(grant.uuid) if devices else None
            if grant.mig is not None:
                grant = _as_instance(grant, device, request, index, problems)
                if grant.mig is not None:
                    cut.append(grant)
                    continue
            card = device.memory_mib if device is not None else None
            # A kind that rounds a request up (an Ascend template) grants the rounded amounts.
            rounded = registry.rounded_take(device, request, grant.type)
            asked_cores = rounded.cores if rounded is not None else request.cores
            if rounded is not None:
                asked = rounded.memory_mib
            elif request.memory_percentage is not None:
                asked = request.memory_on(card) if card is not None else grant.memory_mib
            else:
                asked = request.memory_mib or grant.memory_mib
            memory = min(grant.memory_mib, asked)
            cores = min(grant.cores, asked_cores) if asked_cores else grant.cores
            if (memory, cores) != (grant.memory_mib, grant.cores):
                problems.append(f"container #{index} is granted {grant.memory_mib} MiB / "
                                f"{grant.cores}% on {grant.uuid}, asks {asked} MiB / "
                                f"{asked_cores}%")  # fmt: skip
            cut.append(grant.model_copy(update={"memory_mib": memory, "cores": cores}))
        containers.append(cut)
    return allocation.model_copy(update={"containers": containers}), problems


def _as_instance(
    grant: DeviceGrant, device: DeviceInfo | None, request: hami.ContainerRequest, index: int,
    problems: list[str],
) -> DeviceGrant:
    """A dynamic-MIG grant holds its profile's size, not the request's: the instance the card
    really holds (the scheduler charges the profile's amounts, any profile that covers the
    request: the smallest may have had no free placement). Its figures are set to the
    profile's (and reported when the record said otherwise, or the profile does not cover the
    request); a profile the card cannot hold loses its instance and is cut as a slice."""
    try:
        profile, memory, cores = instance_charge(grant, device)
    except MigError as exc:
        problems.append(f"container #{index} names MIG {grant.mig.profile if grant.mig else '?'}"
                        f" on {grant.uuid}: {exc}")  # fmt: skip
        return grant.model_copy(update={"mig": None})
    assert grant.mig is not None
    card = device.memory_mib if device is not None else 0
    asked = request.memory_on(card) if request.memory_percentage is not None else (
        request.memory_mib)
    if memory < asked or (request.cores and cores < request.cores):
        problems.append(f"container #{index}: MIG {profile.name} on {grant.uuid} "
                        f"({memory} MiB / {cores}%) does not cover its ask of {asked} MiB / "
                        f"{request.cores}%")  # fmt: skip
    if (grant.memory_mib, grant.cores, grant.mig.size) != (memory, cores, profile.memory_slices):
        problems.append(f"container #{index} is granted {grant.memory_mib} MiB / {grant.cores}% "
                        f"on {grant.uuid} as MIG {profile.name}, which holds {memory} MiB / "
                        f"{cores}%")  # fmt: skip
    instance = grant.mig.model_copy(update={"size": profile.memory_slices})
    return grant.model_copy(update={"memory_mib": memory, "cores": cores, "mig": instance})


def checked_restore(
    node: str,
    found: list[tuple[Allocation, InFlightClaim | None]],
    pods: Mapping[str, dict[str, Any]],
    devices: Mapping[str, DeviceInfo] | None,
    held: Iterable[Allocation],
    rules: RestoreRules,
    report: RestoreReport,
) -> list[tuple[Allocation, InFlightClaim | None]]:
    """What of `found` (read off the pods' annotations) may go back into `node`'s ledger, as
    live ledger values are checked: a grant no larger than the pod's own request (unless the
    node's agent signed it: limits.set), only GPUs the node has, and no card over its capacity
    with what the ledger already holds (`held`). Agent-signed records are restored first; a
    claim that does not fit is not restored and is reported, never an overcommitted card (the
    agent refuses to seal a grant it did not sign above the request either)."""
    used: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for allocation in held:
        if allocation.active:
            for uuid in {g.uuid for c in allocation.containers for g in c}:
                mem, cores = usage_on(allocation, uuid)
                used[uuid][0] += mem
                used[uuid][1] += cores
    ranked = []
    for allocation, claim in found:
        pod = pods.get(allocation.pod_uid) or {}
        signed = _signed_record(pod, node, rules)
        who = f"{allocation.namespace}/{allocation.name} on {node}"
        if signed is False:
            report.forged.append(f"{who}: its {hami.ANN_DEVICES_ALLOCATED} is not what the "
                                 "node's agent signed")  # fmt: skip
        problems: list[str] = []
        # A DRA pod's grant was read from its ResourceClaim's allocation (tessera.dra_restore):
        # the allocator's own accounting of the claim, already checked against the node's
        # devices; the pod's spec asks nothing HAMi's request reader could cut it to.
        believed = signed is True or allocation.reason == DRA_REASON
        if not believed:
            try:
                allocation, problems = within_request(allocation, pod, devices, rules.settings)
            except ValueError as exc:
                report.refused.append(f"{who}: not restored: {exc}")
                continue
            if problems:
                report.forged.append(f"{who}: cut to its request: {'; '.join(problems)}"[:400])
        # Signed records first, then claims within the request, then the cut ones: when a card
        # cannot hold them all, what is least believable is what is not restored.
        ranked.append(((not believed, bool(problems)), allocation, claim, who))
    ranked.sort(key=lambda item: item[0])  # stable: as listed within a rank
    accepted: list[tuple[Allocation, InFlightClaim | None]] = []
    for _rank, allocation, claim, who in ranked:
        if devices is not None:
            unknown = sorted({g.uuid for c in allocation.containers for g in c} - set(devices))
            if unknown:
                report.refused.append(f"{who}: not restored: GPU {unknown[0]} is not on the "
                                      "node")  # fmt: skip
                continue
            over = _over_capacity(allocation, devices, used)
            if over:
                report.refused.append(f"{who}: not restored: {over}")
                continue
            for uuid in {g.uuid for c in allocation.containers for g in c}:
                mem, cores = usage_on(allocation, uuid)
                used[uuid][0] += mem
                used[uuid][1] += cores
        accepted.append((allocation, claim))
    return accepted


def _over_capacity(allocation: Allocation, devices: Mapping[str, DeviceInfo],
                   used: Mapping[str, list[int]]) -> str:  # fmt: skip
    for uuid in sorted({g.uuid for c in allocation.containers for g in c}):
        mem, cores = usage_on(allocation, uuid)
        held = used.get(uuid, [0, 0])
        device = devices[uuid]
        if held[0] + mem > device.memory_mib:
            return (f"GPU {uuid} would hold {held[0] + mem} MiB of {device.memory_mib} MiB "
                    "with the pods already restored")  # fmt: skip
        if held[1] + cores > device.cores:
            return f"GPU {uuid} would hold {held[1] + cores}% of {device.cores}% compute"
    return ""
