"""DRA claims in Tessera's ledger: pure compare-and-set bodies.

A prepared claim is recorded as the allocation of the pod it is reserved for, exactly as an
extender allocation is once Allocate has served it (state `allocated`): so the scheduler's
index, quota, metrics (HAMi's names), the event stream and `tessera describe` see DRA pods as
they see the others. The pod's allocation is rebuilt from every claim of that pod prepared on
this node (a pod may hold several claims): container `i`'s grants are the devices of the claims
whose first user is container `i` (a claim shared by two containers is one slice, counted once).
"""

from __future__ import annotations

from collections.abc import Iterable

from tessera.bus import NoChange
from tessera.dra_names import DRA_REASON
from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger, now

from .claims import PreparedClaim


def pod_allocation(
    node: str,
    claims: Iterable[PreparedClaim],
    *,
    container_names: list[str],
    init_count: int,
    priority: int = 1,
    core_policy: str = "default",
    at: float | None = None,
    quota_held: bool = False,
) -> Allocation | None:
    """The pod's allocation from its prepared claims (None when it holds none)."""
    held = list(claims)
    if not held:
        return None
    first = held[0]
    count = max(len(container_names), 1 + max(c.container_index for c in held))
    containers: list[list[DeviceGrant]] = [[] for _ in range(count)]
    for claim in sorted(held, key=lambda c: c.claim_uid):
        containers[claim.container_index].extend(d.grant for d in claim.devices)
    stamp = now() if at is None else at
    return Allocation(
        pod_uid=first.pod_uid, namespace=first.namespace, name=first.pod, node=node,
        containers=containers, init_count=min(init_count, count),
        state=AllocationState.ALLOCATED, created_at=stamp, updated_at=stamp,
        priority=priority, core_policy=core_policy, reason=DRA_REASON, quota_held=quota_held,
        container_names=list(container_names) + [""] * (count - len(container_names)),
    )  # fmt: skip


def put_mutation(node: str, allocation: Allocation):
    """CAS body: the pod's allocation is `allocation` (kept as is when it already says so)."""

    def mutate(current: NodeLedger | None) -> NodeLedger:
        ledger = current or NodeLedger(node=node)
        existing = ledger.allocations.get(allocation.pod_uid)
        same = existing is not None and existing.containers == allocation.containers
        if same and existing.active:
            raise NoChange
        if existing is not None and existing.reason != DRA_REASON and existing.active:
            raise ValueError(
                f"pod {allocation.namespace}/{allocation.name} already holds an extender "
                "allocation on this node; a pod is placed by one allocator only"
            )
        keep = allocation
        if existing is not None:
            keep = allocation.model_copy(update={"created_at": existing.created_at})
        allocations = dict(ledger.allocations)
        allocations[allocation.pod_uid] = keep
        return ledger.model_copy(update={"allocations": allocations})

    return mutate


def drop_mutation(pod_uid: str):
    """CAS body: the pod's DRA allocation leaves the ledger (nothing kept for a freed claim)."""

    def mutate(current: NodeLedger | None) -> NodeLedger:
        if current is None or pod_uid not in current.allocations:
            raise NoChange
        if current.allocations[pod_uid].reason != DRA_REASON:
            raise NoChange  # not ours to remove
        allocations = {k: v for k, v in current.allocations.items() if k != pod_uid}
        return current.model_copy(update={"allocations": allocations})

    return mutate


def emptied_mutation(pod_uid: str):
    """CAS body: the pod's DRA allocation holds nothing any more (its last claim, of MIG
    instances, was unprepared and the instances are destroyed; or its last claim was handed on
    to another pod sharing it) but stays, for the scheduler's release of the ended pod (its
    quota charge and `released` event)."""

    def mutate(current: NodeLedger | None) -> NodeLedger:
        existing = current.allocations.get(pod_uid) if current else None
        if current is None or existing is None or existing.reason != DRA_REASON:
            raise NoChange
        if not any(existing.containers):
            raise NoChange
        allocations = dict(current.allocations)
        allocations[pod_uid] = existing.model_copy(update={
            "containers": [[] for _ in existing.containers], "updated_at": now(),
        })  # fmt: skip
        return current.model_copy(update={"allocations": allocations})

    return mutate


def in_turn(*bodies):
    """CAS body: each body applied in turn, in one write (one that changes nothing is skipped;
    NoChange only when none changes anything)."""

    def mutate(current: NodeLedger | None) -> NodeLedger:
        changed = False
        for body in bodies:
            try:
                current = body(current)
            except NoChange:
                continue
            changed = True
        if not changed or current is None:
            raise NoChange
        return current

    return mutate
