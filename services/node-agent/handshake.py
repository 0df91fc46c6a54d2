"""Pure rules of the kubelet handshake: which replicas, which pod and container a call serves.

No I/O here: the plugin server (plugin.py, attribution.py) reads the ledger, kubelet's
pod-resources and the container store and calls these. Every refusal is a `HandshakeError`
with a sentence an operator can act on. Beside them: what a served container gets (env, mounts,
sealed limits: container_setup.py, re-exported here for the plugin and the DRA driver) and the
ledger's CAS bodies the handshake writes (ledger_mutations.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tessera.node_agent.containers import ContainerDir

from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, NodeLedger

from .container_setup import container_env, container_mounts, limits_for

__all__ = [
    "HandshakeError", "admission_restarted", "check_devices", "choose_new_pod", "container_env",
    "container_mounts", "container_name", "describe", "first_size", "gpu_containers", "gpu_of",
    "gpus_of", "in_flight", "kubelet_admitting", "limits_for", "next_container",
    "no_pod_in_flight", "pick_prepared", "preferred_replicas", "replica_id", "replica_ids",
    "reported_containers",
]


class HandshakeError(Exception):
    """A request kubelet made that the agent must refuse (becomes a gRPC error)."""

    def __init__(self, message: str, *, mismatch: bool = False, invalid: bool = False) -> None:
        super().__init__(message)
        self.mismatch = mismatch  # kubelet's devices disagree with the scheduler's grant
        self.invalid = invalid  # the request itself is malformed (not ours, duplicated)


def replica_id(uuid: str, i: int) -> str:
    return f"{uuid}-{i}"


def replica_ids(devices: Iterable[DeviceInfo]) -> list[str]:
    return [replica_id(d.uuid, i) for d in devices for i in range(d.split_count)]


def gpu_of(device_id: str, devices: dict[str, DeviceInfo]) -> str | None:
    """The GPU UUID behind a replica ID, or None when it is not one of ours."""
    base, sep, suffix = device_id.rpartition("-")
    if not sep or not suffix.isdigit():
        return None
    device = devices.get(base)
    if device is None or int(suffix) >= device.split_count:
        return None
    return base


def gpus_of(device_ids: list[str], devices: dict[str, DeviceInfo]) -> list[str]:
    """The GPUs behind replica IDs; refuses unknown IDs and two replicas of one GPU."""
    unknown = [d for d in device_ids if gpu_of(d, devices) is None]
    if unknown:
        shown = f"{unknown[:5]}" + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise HandshakeError(
            f"unknown device IDs {shown}: not replicas of this node's GPUs", invalid=True
        )
    gpus = [gpu_of(d, devices) or "" for d in device_ids]
    if len(set(gpus)) != len(gpus):
        raise HandshakeError(f"device IDs {device_ids} name the same GPU twice", invalid=True)
    return gpus


def gpu_containers(allocation: Allocation) -> list[int]:
    """Indexes of the containers that have GPUs: the ones kubelet calls Allocate for."""
    return [i for i, grants in enumerate(allocation.containers) if grants]


def container_name(allocation: Allocation, index: int) -> str:
    names = allocation.container_names
    return names[index] if index < len(names) else ""


def describe(allocation: Allocation, index: int | None = None) -> str:
    pod = f"pod {allocation.namespace}/{allocation.name}"
    if index is None:
        return pod
    return f"{pod} container {container_name(allocation, index) or f'#{index}'}"


def in_flight(ledger: NodeLedger | None) -> list[Allocation]:
    """The pods kubelet may be admitting on this node: bound (or claimed and about to be) but
    not yet allocated, oldest claim first (kubelet admits pods in about the order they bind)."""
    if ledger is None:
        return []
    claims = ledger.in_flight()

    def waiting(a: Allocation) -> bool:
        return a.state == AllocationState.BOUND or (
            a.state == AllocationState.RESERVED and a.pod_uid in claims
        )

    def order(a: Allocation) -> tuple[float, float]:
        claim = claims.get(a.pod_uid)
        return (claim.taken_at if claim else a.updated_at, a.created_at)

    return sorted((a for a in ledger.allocations.values() if waiting(a)), key=order)


def reported_containers(allocation: Allocation) -> list[int]:
    """GPU containers kubelet's pod-resources List reports: app containers and native sidecars
    (plain init containers are not listed)."""
    sidecars = set(allocation.sidecars)
    return [
        i for i in gpu_containers(allocation) if i >= allocation.init_count or i in sidecars
    ]  # fmt: skip


def kubelet_admitting(
    flying: list[Allocation], listed: dict[tuple[str, str], set[str]]
) -> set[str]:
    """Uids of the in-flight pods kubelet is admitting now, read off its pod-resources List
    (`listed`: (namespace, pod) -> names of its containers that hold our devices).

    kubelet adds a pod to its pod manager (which List reads) just before admitting it, admits
    pods one at a time, and records each container's devices when its Allocate returns. So an
    in-flight pod that kubelet lists with a GPU container still without devices is the one under
    admission; a pod it does not list has not reached kubelet yet. Normally one pod qualifies;
    the caller falls back to its guess when none or several do."""
    out = set()
    for allocation in flying:
        held = listed.get((allocation.namespace, allocation.name))
        if held is None:
            continue
        reported = reported_containers(allocation)
        if not reported or any(container_name(allocation, i) not in held for i in reported):
            out.add(allocation.pod_uid)
    return out


def no_pod_in_flight(node: str) -> HandshakeError:
    return HandshakeError(
        f"no pod is in flight on node {node}: the scheduler has bound none here, so this "
        "Allocate cannot be attributed to a pod"
    )


def first_size(allocation: Allocation) -> int:
    """How many devices kubelet asks for the pod's first GPU container."""
    indexes = gpu_containers(allocation)
    return len(allocation.containers[indexes[0]]) if indexes else 0


def choose_new_pod(
    candidates: list[Allocation], size: int, gpus: set[str] | None, guess: str | None
) -> Allocation | None:
    """The in-flight pod (none of its containers served yet) a new kubelet admission is for.

    `gpus`: the GPUs kubelet chose (Allocate), or None (GetPreferredAllocation: the first pod in
    order whose GPUs kubelet still offers). Only a pod granted exactly those GPUs qualifies for
    an Allocate; the last preference given wins among them, then the oldest claim. A wrong
    choice among pods of one shape is caught and repaired at PreStart."""
    sized = [a for a in candidates if first_size(a) == size]
    if gpus is not None:
        sized = [
            a for a in sized
            if {g.uuid for g in a.containers[gpu_containers(a)[0]]} == gpus
        ]  # fmt: skip
    for a in sized:
        if a.pod_uid == guess:
            return a
    return sized[0] if sized else None


def next_container(allocation: Allocation, prepared: Iterable[int]) -> int:
    """The first GPU container of the pod not yet served (kubelet's order: init first)."""
    done = set(prepared)
    for index in gpu_containers(allocation):
        if index not in done:
            return index
    raise HandshakeError(f"every GPU container of {describe(allocation)} is already allocated")


def admission_restarted(
    allocation: Allocation, prepared: list[ContainerDir], sealed: Callable[[ContainerDir], bool]
) -> bool:
    """An Allocate for a pod whose every GPU container is already prepared, none started, and
    which is still only bound (or reserved: the scheduler leaves the bound mark to the Allocate
    of a pod in flight): kubelet is retrying an admission that failed before its end."""
    done = {c.prepared.index for c in prepared}
    return (
        allocation.state in (AllocationState.BOUND, AllocationState.RESERVED)
        and bool(done)
        and set(gpu_containers(allocation)) <= done
        and not any(sealed(c) for c in prepared)
    )


def preferred_replicas(
    grants: list[DeviceGrant],
    available: list[str],
    must_include: list[str],
    size: int,
    devices: dict[str, DeviceInfo],
    who: str,
) -> list[str]:
    """One replica of each granted GPU, taken from what kubelet offers."""
    wanted = [g.uuid for g in grants]
    if size != len(wanted):
        raise HandshakeError(
            f"kubelet asks for {size} devices but {who} was granted {len(wanted)} GPU(s)",
            mismatch=True,
        )
    chosen: dict[str, str] = {}
    for device_id in must_include:
        gpu = gpu_of(device_id, devices)
        if gpu not in wanted:
            raise HandshakeError(
                f"kubelet must include {device_id}, which is not a replica of a GPU granted to "
                f"{who} ({', '.join(wanted)})",
                mismatch=True,
            )
        chosen.setdefault(gpu, device_id)
    for device_id in available:
        gpu = gpu_of(device_id, devices)
        if gpu in wanted:
            chosen.setdefault(gpu, device_id)
    missing = [g for g in wanted if g not in chosen]
    if missing:
        raise HandshakeError(
            f"no free replica of GPU(s) {', '.join(missing)} among the devices kubelet offers "
            f"for {who}"
        )
    return [chosen[g] for g in wanted]


def check_devices(grants: list[DeviceGrant], gpus: list[str], who: str) -> None:
    """Allocate's check: kubelet's replicas are of exactly the GPUs granted to `who`."""
    wanted = [g.uuid for g in grants]
    if len(gpus) != len(wanted):
        raise HandshakeError(
            f"kubelet allocated {len(gpus)} device(s) but {who} was granted {len(wanted)} GPU(s)",
            mismatch=True,
        )
    if set(gpus) != set(wanted):
        raise HandshakeError(
            f"kubelet chose GPU(s) {', '.join(sorted(gpus))} but {who} was granted "
            f"{', '.join(wanted)}",
            mismatch=True,
        )



def pick_prepared(
    candidates: list[ContainerDir],
    holders: list[tuple[str, str, str]],
    sealed: Callable[[ContainerDir], bool],
) -> tuple[ContainerDir | None, str]:
    """Which preparation a PreStartContainer is for: (directory, "") or (None, why not).

    `candidates` were prepared for these exact replica IDs (several when kubelet reuses an init
    container's devices for a later container, or an old pod's directory is still there);
    `holders` are the (namespace, pod, container) kubelet's pod-resources says hold them. Only a
    preparation for a holding pod qualifies; among those, kubelet starts containers in order, so
    the earliest one not sealed yet (all sealed: a restart of the latest)."""
    held_pods = {(ns, pod) for ns, pod, _ in holders}
    own = sorted(
        (c for c in candidates if (c.prepared.namespace, c.prepared.pod) in held_pods),
        key=lambda c: (c.prepared.prepared_at, c.prepared.index),
    )
    if not own:
        p = candidates[0].prepared
        held = ", ".join(f"{ns}/{pod} container {c}" for ns, pod, c in holders)
        return None, (
            f"devices held by {held}, but they were prepared for {p.namespace}/{p.pod} container "
            f"{p.container or '?'}: refusing to start it with another pod's limits"
        )
    unsealed = [c for c in own if not sealed(c)]
    chosen = unsealed[0] if unsealed else own[-1]
    p = chosen.prepared
    names = {c for ns, pod, c in holders if (ns, pod) == (p.namespace, p.pod)}
    if p.container and p.container not in names:
        return None, (
            f"devices of {p.namespace}/{p.pod} are held by container(s) {sorted(names)}, but "
            f"they were prepared for container {p.container}: refusing to cross limits"
        )
    return chosen, ""
