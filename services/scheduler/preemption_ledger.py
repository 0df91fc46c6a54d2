"""The nominated reservation in the ledger: CAS mutate functions of preemption. Pure functions
plus the two writes that run them.

Nominating pod P on a node with victims V is one compare-and-set of the node's entry:
- P gets a `reserved` allocation with the grants it will have once V are gone, expiring at the
  nomination's deadline (the victims' grace period + a margin);
- each victim is marked `preempted_by = P`, `preempted_until = deadline`: until then it no longer
  counts against capacity (`cards.counts_against_capacity`); P's reservation holds that capacity.
So from the write on, no other pod (of lower priority or any other) can take what V will free,
and a second preemptor computing on the same entry sees P's reservation and cannot pick V again:
two preemptors never count the same freed capacity (the CAS makes the loser re-read and re-fit).
The ledger never shows a card above capacity: it holds P's promise, not V's and P's together.

The node agent keeps seeing V as active (its usage reports keep covering them), and the scheduler
keeps V's allocations until their pods are gone *and* the agent reports their GPU memory
returned; only then are they released (preemption_run.py). P's reservation is not handed to
kube-scheduler while any victim is still marked, so P is never bound onto memory still in use.
If the deadline passes, the reservation lapses like any other (the sweeper drops it) and the marks
stop counting: the victims' capacity is theirs again until they are released, and P is
re-evaluated from scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from nats.js.kv import KeyValue

from tessera.bus import NoChange, Versioned, cas_update
from tessera.hami import PodRequest
from tessera.models import Allocation, AllocationState, NodeLedger, NodeRegistration

from .cards import build_cards, counts_against_capacity
from .ledger import NodeFullError
from .placement import fit_pod
from .rules import FitContext


class VictimGoneError(Exception):
    """A chosen victim is no longer there to evict (or is already another pod's victim)."""


@dataclass(frozen=True)
class NominationRequest:
    registration: NodeRegistration
    cordoned: frozenset[str]
    request: PodRequest
    ctx_factory: Callable[[], FitContext]
    template: Allocation  # the nominee's identity; containers filled by the fit
    victims: frozenset[str]
    now: float
    deadline: float


def nominate_mutate(req: NominationRequest, current: NodeLedger | None) -> NodeLedger:
    if current is None:
        raise VictimGoneError("the node has no ledger entry")
    uid = req.template.pod_uid
    existing = current.allocations.get(uid)
    if existing is not None and counts_against_capacity(existing, req.now):
        raise NoChange  # already nominated or reserved here
    allocations = {k: a for k, a in current.allocations.items() if k != uid and a.active}
    for victim in req.victims:
        held = allocations.get(victim)
        if held is None or not counts_against_capacity(held, req.now):
            raise VictimGoneError(victim)
    kept = [a for k, a in allocations.items() if k not in req.victims]
    fit = fit_pod(build_cards(req.registration, kept, req.now, req.cordoned), req.request,
                  req.ctx_factory())  # fmt: skip
    if not fit.ok:
        raise NodeFullError(fit)
    for victim in req.victims:
        allocations[victim] = allocations[victim].model_copy(
            update={"preempted_by": uid, "preempted_until": req.deadline, "updated_at": req.now}
        )
    allocations[uid] = req.template.model_copy(update={
        "containers": fit.containers, "state": AllocationState.RESERVED, "created_at": req.now,
        "updated_at": req.now, "expires_at": req.deadline,
    })  # fmt: skip
    return current.model_copy(update={"allocations": allocations})


def abandon_mutate(uid: str, now: float, current: NodeLedger | None) -> NodeLedger:
    """Give up a nomination: the nominee's unbound reservation goes, its victims' marks are
    cleared (they count again until released)."""
    if current is None:
        raise NoChange
    allocations = dict(current.allocations)
    changed = False
    held = allocations.get(uid)
    if held is not None and held.state == AllocationState.RESERVED:
        del allocations[uid]
        changed = True
    for key, a in current.allocations.items():
        if a.preempted_by == uid and a.preempted_until is not None:
            allocations[key] = a.model_copy(
                update={"preempted_by": "", "preempted_until": None, "updated_at": now}
            )
            changed = True
    if not changed:
        raise NoChange
    return current.model_copy(update={"allocations": allocations})


def hand_over_mutate(uid: str, now: float, ttl_s: float, current: NodeLedger | None) -> NodeLedger:
    """No victim left: the nominee's reservation gets the ordinary time to be bound from now."""
    held = current.allocations.get(uid) if current else None
    if current is None or held is None or held.state != AllocationState.RESERVED:
        raise NoChange
    expires = held.expires_at if held.expires_at is not None else now + ttl_s
    if marked_victims(current, uid, now) or expires <= now or expires >= now + ttl_s:
        raise NoChange
    allocations = dict(current.allocations)
    allocations[uid] = held.model_copy(update={"expires_at": now + ttl_s, "updated_at": now})
    return current.model_copy(update={"allocations": allocations})


def marked_victims(ledger: NodeLedger | None, uid: str, now: float) -> list[Allocation]:
    """The victims still being evicted for `uid` on this node (marks not yet lapsed)."""
    if ledger is None:
        return []
    return [
        a for a in ledger.allocations.values()
        if a.preempted_by == uid and a.preempted_until is not None and now < a.preempted_until
        and a.active
    ]  # fmt: skip


async def nominate(kv: KeyValue, req: NominationRequest) -> Versioned[NodeLedger]:
    """Raises NodeFullError / VictimGoneError / NoChange as the mutate does."""
    return await cas_update(kv, req.template.node, NodeLedger, partial(nominate_mutate, req))


async def abandon(kv: KeyValue, node: str, uid: str, now: float) -> Versioned[NodeLedger] | None:
    try:
        return await cas_update(kv, node, NodeLedger, partial(abandon_mutate, uid, now))
    except NoChange:
        return None


async def hand_over(
    kv: KeyValue, node: str, uid: str, now: float, ttl_s: float
) -> Versioned[NodeLedger] | None:
    try:
        return await cas_update(kv, node, NodeLedger, partial(hand_over_mutate, uid, now, ttl_s))
    except NoChange:
        return None
