"""The ledger's compare-and-set bodies the kubelet handshake writes (for `bus.cas_update`):
a pod finished (allocated, its in-flight claim dropped), a wrongly finished pod given back its
claim, two crossed pods exchanging their cards, kubelet's reuse of init containers' devices
followed. Pure: each takes the entry as read and returns the new one, copying first."""

from __future__ import annotations

from collections.abc import Callable

from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger

from .handshake import HandshakeError, describe


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
