"""Pure decisions of the kubelet handshake: which replicas, which container, which env.

No I/O here: the plugin server (plugin.py) reads the ledger and the container store and calls
these. Every refusal is a `HandshakeError` with a sentence an operator can act on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tessera.node_agent.containers import (
    LIBVGPU_CONTAINER_PATH,
    PRELOAD_CONTAINER_PATH,
    REGION_CONTAINER_DIR,
    REGION_CONTAINER_PATH,
    ContainerDir,
    sealed_device_limit,
)

from tessera.device_kinds.nvidia.slices import slice_env
from tessera.device_kinds.types import GrantContext
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, NodeLedger
from tessera.region import SEALED_LIMITS_DIR, ContainerLimits
from tessera.settings import TesseraSettings


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


def container_env(
    allocation: Allocation, grants: list[DeviceGrant], settings: TesseraSettings
) -> dict[str, str]:
    """HAMi's env for libvgpu slices (a fallback: libvgpu obeys the sealed limits file when
    there is one): the slices kind's, for callers holding an allocation (the DRA driver)."""
    ctx = GrantContext(devices={}, settings=settings, priority=allocation.priority,
                       core_policy=allocation.core_policy or settings.core_policy)
    return slice_env(grants, ctx)


def container_mounts(
    cdir: ContainerDir, settings: TesseraSettings, preload_host_path: str
) -> list[tuple[str, str, bool]]:
    """(container path, host path, read-only) of every mount, parents before what they hold
    (container runtimes mount in order of path depth)."""
    return [
        (LIBVGPU_CONTAINER_PATH, settings.libvgpu_host_path, True),
        (PRELOAD_CONTAINER_PATH, preload_host_path, True),
        # The region's directory read-only and the file itself read-write on top: the tenant can
        # write its counters but neither rename, unlink nor replace the file (a mount point
        # cannot be renamed over: EBUSY; the directory takes no new file: EROFS). Nothing it
        # writes there is the account anyway: that is the agent's lease service (leases.py).
        (REGION_CONTAINER_DIR, str(cdir.region_dir), True),
        (REGION_CONTAINER_PATH, str(cdir.region_file), False),
        # The directory, never the file: the agent replaces the limits file by rename (a
        # bind-mounted file would keep the old inode); the lease socket lives there too.
        (SEALED_LIMITS_DIR, str(cdir.limits_dir), True),
    ]


def limits_for(
    allocation: Allocation, index: int, settings: TesseraSettings
) -> ContainerLimits:
    """What PreStartContainer seals for container `index` of `allocation`."""
    grants = allocation.containers[index]
    return ContainerLimits(
        devices=tuple(
            sealed_device_limit(g.uuid, memory_mib=g.memory_mib, cores=g.cores,
                                memory_burst_mib=g.memory_limit_mib or None,
                                cores_burst=g.cores_limit or None)  # elastic (docs/elastic.md)
            for g in grants
        ),
        priority=allocation.priority,
        core_policy=allocation.core_policy or settings.core_policy,
        oversubscribe=settings.device_memory_scaling > 1,
        scrub_on_free=allocation.scrub_on_free or settings.scrub_on_free,
        region_path=REGION_CONTAINER_PATH,
        lease=settings.memory_leases,  # the agent's lease service is the account (leases.py)
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


def finish_mutation(pod_uid: str, ledger: NodeLedger | None) -> NodeLedger:
    """Ledger CAS body once every GPU container of the pod is served: allocated, claim dropped.

    Raises bus.NoChange when there is nothing to do (a retry, or the claim moved on)."""
    from tessera.bus import NoChange
    from tessera.models import now

    if ledger is None:
        raise NoChange
    # Copy on write: only the pod's allocation and the claims are new objects (a deep copy of
    # an entry of tens of allocations cost more than the rest of the Allocate together).
    update: dict = {}
    allocation = ledger.allocations.get(pod_uid)
    if allocation is not None and allocation.state in (
        AllocationState.RESERVED, AllocationState.BOUND
    ):
        allocations = dict(ledger.allocations)
        allocations[pod_uid] = allocation.model_copy(update={
            "state": AllocationState.ALLOCATED,
            "expires_at": None,  # allocated: a reservation's expiry no longer applies
            "updated_at": now(),
        })  # fmt: skip
        update["allocations"] = allocations
    if pod_uid in ledger.claims:
        update["claims"] = {k: c for k, c in ledger.claims.items() if k != pod_uid}
    if ledger.claim is not None and ledger.claim.pod_uid == pod_uid:
        update["claim"] = None
    if not update:
        raise NoChange
    return ledger.model_copy(update=update)


def finish_pending(pod_uid: str, ledger: NodeLedger | None) -> bool:
    """Whether `finish_mutation` would change `ledger` (the pod not yet allocated there, or
    still in its in-flight set): PreStart then repeats the finish an Allocate may not have
    written (the agent crashed in between); otherwise it spares the read."""
    if ledger is None:
        return False
    allocation = ledger.allocations.get(pod_uid)
    return (
        (allocation is not None
         and allocation.state in (AllocationState.RESERVED, AllocationState.BOUND))
        or pod_uid in ledger.claims
        or (ledger.claim is not None and ledger.claim.pod_uid == pod_uid)
    )  # fmt: skip


class Finish:
    """`finish_mutation` for `bus.cas_update`, remembering whether the attempt that ended the
    update wrote (cas_update returns the entry as it is when there was nothing to do, so the
    caller could not tell a finish from a repeat: every PreStart announced the pod allocated
    again, one more event and pod patch each)."""

    def __init__(self, pod_uid: str) -> None:
        self.pod_uid = pod_uid
        self.wrote = False

    def mutate(self, ledger: NodeLedger | None) -> NodeLedger:
        self.wrote = False
        new = finish_mutation(self.pod_uid, ledger)
        self.wrote = True
        return new


def reclaim_mutation(
    pod_uid: str, ledger: NodeLedger | None, holder: str, ttl_s: float,
    clock: Callable[[], float] | None = None,
) -> NodeLedger:
    """Ledger CAS body after a mis-attributed Allocate: the pod it was wrongly counted for is
    in flight again, so its own Allocate can still come.

    Raises bus.NoChange when the pod is not in the wrongly-finished state.
    """
    from tessera.bus import NoChange
    from tessera.models import InFlightClaim, now

    allocation = ledger.allocations.get(pod_uid) if ledger else None
    if ledger is None or allocation is None or allocation.state != AllocationState.ALLOCATED:
        raise NoChange
    at = (clock or now)()  # the scheduler judges this claim's expiry on the server's clock
    new = ledger.model_copy(deep=True)
    new.allocations[pod_uid].state = AllocationState.BOUND
    new.allocations[pod_uid].updated_at = at
    new.claims[pod_uid] = InFlightClaim(
        pod_uid=pod_uid, namespace=allocation.namespace, name=allocation.name,
        taken_at=at, expires_at=at + ttl_s, holder=holder,
    )
    return new


def swap_mutation(
    a_uid: str, b_uid: str, ledger: NodeLedger | None,
    capacity: dict[str, tuple[int, int]] | None = None,
) -> NodeLedger:
    """Ledger CAS body of a crossed-guess repair: pods `a` and `b` exchange their cards and
    their progress (state, expiry, in-flight claim), so each pod's grants are the GPUs kubelet
    really gave it. One shape: they swap grants and every card holds the same amounts as before.
    One layout, other amounts: each keeps its amounts on the other's cards, refused unless every
    card still fits (`capacity`: uuid -> (MiB, cores)). HandshakeError when they cannot."""
    from tessera.models import allocation_layout, allocation_shape, exchange_grants

    a = ledger.allocations.get(a_uid) if ledger else None
    b = ledger.allocations.get(b_uid) if ledger else None
    if ledger is None or a is None or b is None or not (a.active and b.active):
        raise HandshakeError("a crossed pod's allocation is gone: cannot repair", mismatch=True)
    same_shape = allocation_shape(a) == allocation_shape(b)
    if not same_shape and (allocation_layout(a) != allocation_layout(b) or capacity is None):
        raise HandshakeError(
            f"{describe(a)} and {describe(b)} differ in layout: their cards cannot be exchanged",
            mismatch=True,
        )
    new = ledger.model_copy(deep=True)
    a_grants, b_grants = (b.containers, a.containers) if same_shape else exchange_grants(a, b)

    def progress(x: Allocation, grants: list[list[DeviceGrant]]) -> dict:
        return {"containers": grants, "state": x.state, "expires_at": x.expires_at}

    new.allocations[a_uid] = a.model_copy(update=progress(b, a_grants))
    new.allocations[b_uid] = b.model_copy(update=progress(a, b_grants))
    if not same_shape:
        check_capacity(new, {g.uuid for c in (*a_grants, *b_grants) for g in c}, capacity or {})
    claims = ledger.in_flight()
    new.claim = None
    new.claims = {k: c for k, c in claims.items() if k not in (a_uid, b_uid)}
    for old, pod in ((a_uid, b), (b_uid, a)):
        if old in claims:
            new.claims[pod.pod_uid] = claims[old].model_copy(
                update={"pod_uid": pod.pod_uid, "namespace": pod.namespace, "name": pod.name}
            )
    return new


def check_capacity(
    ledger: NodeLedger, uuids: set[str], capacity: dict[str, tuple[int, int]]
) -> None:
    """HandshakeError when any of these cards holds more than its (MiB, cores) capacity."""
    from tessera.node_agent.limits import pod_usage_on

    for uuid in sorted(uuids):
        used = [pod_usage_on(x, uuid) for x in ledger.allocations.values() if x.active]
        cap_mem, cap_cores = capacity.get(uuid, (0, 0))
        if sum(m for m, _ in used) > cap_mem or sum(c for _, c in used) > cap_cores:
            raise HandshakeError(
                f"exchanging the crossed pods' cards would overfill GPU {uuid}", mismatch=True
            )


def reuse_pool(allocation: Allocation, index: int) -> set[str]:
    """GPUs kubelet may hand container `index` from the pod's init containers before it (its
    device reuse, container by container in order): a plain init container's GPUs join the
    pool; a native sidecar (restartable init container) and every app container keep theirs,
    so those leave it."""
    pool: set[str] = set()
    sidecars = set(allocation.sidecars)
    for i in range(min(index, len(allocation.containers))):
        cards = {g.uuid for g in allocation.containers[i]}
        if i < allocation.init_count and i not in sidecars:
            pool |= cards
        else:
            pool -= cards
    return pool


def follow_reuse_mutation(
    pod_uid: str, index: int, gpus: list[str], capacity: dict[str, tuple[int, int]],
    ledger: NodeLedger | None,
) -> NodeLedger:
    """Ledger CAS body: kubelet gave container `index` other devices of the pod's reuse pool
    than the grant names (it picks any of them when the pool holds more than asked): move those
    grants onto kubelet's GPUs, same amounts, if every card still fits. HandshakeError if not."""
    from tessera.node_agent.limits import pod_usage_on

    allocation = ledger.allocations.get(pod_uid) if ledger else None
    if ledger is None or allocation is None or index >= len(allocation.containers):
        raise HandshakeError("the pod's allocation is gone", mismatch=True)
    grants = allocation.containers[index]
    wanted = {g.uuid for g in grants}
    extra = [g for g in gpus if g not in wanted]
    if len(gpus) != len(grants) or not set(extra) <= reuse_pool(allocation, index):
        raise HandshakeError("kubelet's devices are not the pod's reusable ones", mismatch=True)
    moving = iter(extra)
    new_grants = [
        g if g.uuid in gpus else g.model_copy(update={"uuid": next(moving)}) for g in grants
    ]
    new = ledger.model_copy(deep=True)
    new.allocations[pod_uid].containers[index] = new_grants
    for uuid in extra:
        used = [pod_usage_on(a, uuid) for a in new.allocations.values() if a.active]
        cap_mem, cap_cores = capacity.get(uuid, (0, 0))
        if sum(m for m, _ in used) > cap_mem or sum(c for _, c in used) > cap_cores:
            raise HandshakeError(
                f"kubelet gave {describe(allocation, index)} GPU {uuid} (its init container's), "
                "which has no room left for it",
                mismatch=True,
            )
    return new
