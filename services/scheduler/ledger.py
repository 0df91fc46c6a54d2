"""Writes to the tessera-ledger KV: every one a compare-and-set of the node's entry.

The mutate functions are pure (current NodeLedger -> new one, or NoChange); the CAS loop in
tessera.bus retries them on conflict. The reservation re-checks the fit against the ledger as it
is at write time, so replicas that raced on a stale index can never overfill a GPU: the loser's
write fails, it re-reads, re-checks and either fits elsewhere on the card or moves on.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tessera import mig
from tessera.bus import LEDGER_BUCKET, CasConflictError, NoChange, Versioned, cas_update
from tessera.hami import PodRequest
from tessera.models import (
    ACTIVE_STATES,
    Allocation,
    AllocationState,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
    allocation_layout,
    allocation_shape,
    exchange_grants,
)

from .acks import JetStreamAcks
from .cards import (
    Card,
    allocation_usage,
    build_cards,
    counts_against_capacity,
    time_sensitive,
)
from .ledger_codec import LedgerCodec
from .placement import PodFit, fit_pod
from .rules import FitContext


class NodeFullError(Exception):
    """The pod no longer fits this node (the ledger moved on since the index looked)."""

    def __init__(self, fit: PodFit) -> None:
        super().__init__(fit.reason_text())
        self.fit = fit


class ReservationGoneError(Exception):
    """Bind found no live reservation for the pod on that node."""


@dataclass(frozen=True)
class ClaimAhead:
    """Put the pod in the node's in-flight set in the reservation's own write, so its bind
    needs no claim write of its own (one ledger round trip per pod fewer). Taken only when the
    bind would take it at once: no pod it competes with is in flight there (`competing_claim`,
    the cap included) and no pod of another shape with the same first device count is reserved
    there waiting to bind (the binder's fairness queue decides between those, in bind order).
    The claim lapses `ttl_s` after the filter as a bind's does after the bind; a bind that finds
    it with less than half of that left takes it afresh."""

    holder: str
    ttl_s: float
    max_in_flight: int = 0


@dataclass(frozen=True)
class ReservationRequest:
    """Everything a reservation needs, so the mutate function stays pure."""

    registration: NodeRegistration
    cordoned: frozenset[str]
    request: PodRequest
    ctx_factory: Callable[[], FitContext]
    template: Allocation  # pod identity, names, policies; containers filled by the fit
    now: float
    ttl_s: float
    # False when the index knew an entry for this node: finding none now means the ledger was
    # lost (NATS lost its store) and not rebuilt yet, so a reservation must not start it afresh.
    may_create: bool = True
    # What HAMi's pods hold on the node (foreign.py): counted, never written to the ledger.
    foreign: tuple[Allocation, ...] = ()
    # The fit the decision made on the index's cards, and the ledger value they were built
    # from: reused when the write starts from that very value and nothing the clock changes
    # is in it (the cards would come out the same), instead of building and fitting again.
    decided: tuple[NodeLedger, PodFit] | None = None
    # Set by the writer (`LedgerWriter.claim_ahead`): claim in the same write when it may.
    claim_ahead: ClaimAhead | None = None


_RESERVED = AllocationState.RESERVED


class LedgerLostError(Exception):
    """The node's ledger entry vanished under us; wait for the rebuild from pods."""


def _replace(
    ledger: NodeLedger,
    allocations: dict[str, Allocation],
    claims: dict[str, InFlightClaim] | None = None,
) -> NodeLedger:
    """A new ledger value; the input is never modified (mutate functions are copy-on-write, so
    they may run on the index's own objects). New `claims` also retire the legacy single claim."""
    update: dict = {"allocations": allocations}
    if claims is not None:
        update |= {"claims": claims, "claim": None}
    return ledger.model_copy(update=update)


def _decided_fit(
    req: ReservationRequest, current: NodeLedger | None, time_sensitive_held: bool
) -> PodFit | None:
    """The decision's fit, when the write starts from the very ledger value it was made on and
    nothing the clock changes is held there (`time_sensitive_held`: by the entry's allocations,
    judged in `reserve_mutate`'s one pass over them)."""
    if req.decided is None or current is None or current is not req.decided[0]:
        return None
    if time_sensitive_held or any(time_sensitive(a, req.now) for a in req.foreign):
        return None
    return req.decided[1]


def reserve_mutate(req: ReservationRequest, current: NodeLedger | None) -> NodeLedger:
    if current is None and not req.may_create:
        raise LedgerLostError(req.template.node)
    ledger = current or NodeLedger(node=req.template.node)
    uid = req.template.pod_uid
    now = req.now
    existing = ledger.allocations.get(uid)
    if existing is not None and counts_against_capacity(existing, now):
        raise NoChange  # already reserved here (a retried filter): keep it
    # One pass over the node's allocations (tens of them; this runs for every pod placed):
    # drop finished entries while writing anyway (the ledger never keeps dead pods), note
    # whether any holds what the clock changes (`time_sensitive`) and which others are
    # reservations (what a claim ahead must look at).
    others: dict[str, Allocation] = {}
    reserved_others: list[tuple[str, Allocation]] = []
    sensitive = False
    for key, a in ledger.allocations.items():
        state = a.state
        if state == _RESERVED:
            if a.expires_at is not None and a.expires_at <= now:
                sensitive = True
            if key != uid:
                reserved_others.append((key, a))
        if a.preempted_by:
            sensitive = True
        if key != uid and state in ACTIVE_STATES:
            others[key] = a
    fit = _decided_fit(req, current, sensitive)
    if fit is None:
        held = [*others.values(), *req.foreign]
        cards = build_cards(req.registration, held, now, req.cordoned)
        fit = fit_pod(cards, req.request, req.ctx_factory())
    if not fit.ok:
        raise NodeFullError(fit)
    others[uid] = req.template.model_copy(
        update={
            "containers": fit.containers,
            "state": AllocationState.RESERVED,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + req.ttl_s,
        }
    )
    reserved = _replace(ledger, others)
    ahead = req.claim_ahead
    if ahead is not None and _may_claim_ahead(reserved, uid, now, ahead, req.registration,
                                              req.foreign, reserved_others):  # fmt: skip
        # The reservation keeps its own expiry: unbound, it lapses as any reservation does.
        return _claimed(reserved, uid, ahead.holder, now, ahead.ttl_s, extend=False)
    return reserved


def _may_claim_ahead(
    ledger: NodeLedger, uid: str, now: float, ahead: ClaimAhead,
    registration: NodeRegistration | None, foreign: tuple[Allocation, ...] = (),
    reserved_others: list[tuple[str, Allocation]] | None = None,
) -> bool:
    """Whether the pod just reserved may go in flight in the same write (see ClaimAhead).
    `reserved_others`: (key, allocation) of `ledger`'s reservations but `uid`'s, when the
    caller has them (else they are looked for)."""
    if competing_claim(ledger, uid, now, ahead.max_in_flight, registration,
                       foreign) is not None:  # fmt: skip
        return False
    if reserved_others is None:
        reserved_others = [(k, a) for k, a in ledger.allocations.items()
                           if k != uid and a.state == _RESERVED]  # fmt: skip
    if not reserved_others:
        return True
    mine = ledger.allocations[uid]
    first, shape = first_request(mine), None
    claims = live_claims(ledger, now)
    for key, other in reserved_others:
        if (key in claims or not counts_against_capacity(other, now)
                or first_request(other) != first):
            continue
        shape = allocation_shape(mine) if shape is None else shape
        if allocation_shape(other) != shape:
            return False  # a bind of another shape may be waiting: it goes first
    return True


def live_claims(ledger: NodeLedger, now: float) -> dict[str, InFlightClaim]:
    """Claims that still count: not lapsed, and their pod still waits for its Allocate."""
    return {
        uid: c for uid, c in ledger.in_flight().items()
        if c.expires_at > now and (a := ledger.allocations.get(uid)) is not None
        and a.state in (AllocationState.RESERVED, AllocationState.BOUND)
    }  # fmt: skip


def first_request(allocation: Allocation) -> int:
    """How many devices kubelet asks the node agent for when it starts admitting the pod: its
    first GPU container's (GetPreferredAllocation and Allocate name a count, never a pod)."""
    return next((len(grants) for grants in allocation.containers if grants), 0)


def exchange_fits(cards: dict[str, Card], a: Allocation, b: Allocation) -> bool:
    """Whether pods a and b (one layout) could trade cards, each keeping its amounts, without
    any card of theirs going over capacity (`cards`: the node's cards with today's usage): the
    repair of a cross between them."""
    new_a, new_b = exchange_grants(a, b)
    delta: dict[str, list[int]] = {}
    for allocation, sign in ((a, -1), (b, -1), (a.model_copy(update={"containers": new_a}), 1),
                             (b.model_copy(update={"containers": new_b}), 1)):  # fmt: skip
        for uuid, use in allocation_usage(allocation).items():
            d = delta.setdefault(uuid, [0, 0, 0])
            d[0] += sign * use.memory_mib
            d[1] += sign * use.cores
            d[2] += sign * use.slots
    for uuid, (mem, cores, slots) in delta.items():
        card = cards.get(uuid)
        if card is None or (mem > 0 and card.used_mem + mem > card.memory_mib) or (
            cores > 0 and card.used_cores + cores > card.cores
        ) or (slots > 0 and card.used_slots + slots > card.split_count):
            return False
    return True


def competes(a: Allocation, b: Allocation, exchangeable: Callable[[], bool] | None = None) -> bool:
    """Whether two pods may not be in flight on one node together.

    kubelet names no pod before PreStart; the node agent reads which pod kubelet is admitting
    off its pod-resources List, and guesses only when that does not settle it. A guess can be
    wrong only between pods whose admissions start with the same device count; PreStart then
    repairs it: pods of one shape swap grants (no capacity moves), pods of one layout with
    other amounts trade cards keeping their amounts (`exchangeable()`: that fits the cards).
    Otherwise a cross could need capacity that is not there: the two compete for it."""
    if first_request(a) != first_request(b) or allocation_shape(a) == allocation_shape(b):
        return False
    if a.mig_grants() or b.mig_grants():
        return True  # a MIG placement belongs to its card: never traded onto another one
    if allocation_layout(a) != allocation_layout(b) or exchangeable is None:
        return True
    return not exchangeable()


def competing_claim(
    ledger: NodeLedger, uid: str, now: float, max_in_flight: int = 0,
    registration: NodeRegistration | None = None, foreign: tuple[Allocation, ...] = (),
) -> InFlightClaim | None:
    """The claim `uid` must wait for, or None when it may go in flight now (see `competes`;
    without the node's `registration` pods of other amounts are not exchanged). A trade is
    judged on the cards with every consumer Tessera knows: the ledger's allocations and
    `foreign`, what HAMi's pods hold there (foreign.py). `max_in_flight` > 0 caps the set
    (1 = the old one-pod-per-node claim)."""
    allocation = ledger.allocations[uid]
    others = {k: c for k, c in live_claims(ledger, now).items() if k != uid}
    if not others:
        return None
    first = min(others.values(), key=lambda c: c.expires_at)
    if max_in_flight and len(others) >= max_in_flight:
        return first

    cards: dict[str, Card] = {}

    def check(k: str) -> Callable[[], bool] | None:
        if registration is None:
            return None

        def fits() -> bool:
            if not cards:  # the node's usage, built once for every pair
                built = build_cards(registration, [*ledger.allocations.values(), *foreign], now)
                cards.update((c.uuid, c) for c in built)
            return exchange_fits(cards, allocation, ledger.allocations[k])

        return fits

    clash = [c for k, c in others.items()
             if competes(allocation, ledger.allocations[k], check(k))]  # fmt: skip
    return min(clash, key=lambda c: c.expires_at) if clash else None


def claim_mutate(
    uid: str, holder: str, now: float, ttl_s: float, current: NodeLedger | None,
    max_in_flight: int = 0, registration: NodeRegistration | None = None,
    foreign: tuple[Allocation, ...] = (),
) -> NodeLedger:
    """Put `uid` in the node's in-flight set (see competing_claim; `foreign`: HAMi's pods on
    the node), or ClaimHeldError."""
    if current is None:
        raise ReservationGoneError("no ledger entry for the node")
    allocation = current.allocations.get(uid)
    if allocation is None or not counts_against_capacity(allocation, now):
        raise ReservationGoneError("the reservation expired or was released")
    if allocation.state != AllocationState.RESERVED:
        raise AlreadyBoundError(uid)
    held = competing_claim(current, uid, now, max_in_flight, registration, foreign)
    if held is not None:
        raise ClaimHeldError(held)
    return _claimed(current, uid, holder, now, ttl_s)


def _claimed(
    current: NodeLedger, uid: str, holder: str, now: float, ttl_s: float, *, extend: bool = True
) -> NodeLedger:
    """`current` with `uid` (reserved there) in the in-flight set; `extend`: its reservation
    lives at least as long as the claim (a bind is in flight)."""
    allocation = current.allocations[uid]
    claims = live_claims(current, now)  # lapsed or finished claims are dropped on the way
    claims[uid] = InFlightClaim(
        pod_uid=uid, namespace=allocation.namespace, name=allocation.name,
        taken_at=now, expires_at=now + ttl_s, holder=holder,
    )  # fmt: skip
    if not extend:
        return _replace(current, current.allocations, claims)
    allocations = dict(current.allocations)
    # Keep the reservation alive while the bind is in flight.
    allocations[uid] = allocation.model_copy(update={
        "expires_at": max(allocation.expires_at or now, now + ttl_s), "updated_at": now,
    })  # fmt: skip
    return _replace(current, allocations, claims)


def claimed_ahead(ledger: NodeLedger, uid: str, now: float, ttl_s: float) -> bool:
    """Whether `uid` is reserved and in flight (its filter claimed ahead, see ClaimAhead) with
    at least half of a claim's time `ttl_s` left on both: its bind then writes no claim. (A
    claim's write would give the reservation that long; the bound mark must find it.)"""
    claim = ledger.in_flight().get(uid)
    allocation = ledger.allocations.get(uid)
    return (
        claim is not None and allocation is not None
        and allocation.state == AllocationState.RESERVED
        and allocation.expires_at is not None and allocation.expires_at - now >= ttl_s / 2
        and claim.expires_at - now >= ttl_s / 2 and counts_against_capacity(allocation, now)
    )  # fmt: skip


class AlreadyBoundError(Exception):
    """Bind was retried after it had succeeded: nothing to claim."""


class ClaimHeldError(Exception):
    def __init__(self, claim: InFlightClaim) -> None:
        super().__init__(f"{claim.namespace}/{claim.name} is in flight until {claim.expires_at}")
        self.claim = claim


class RoomTakenError(Exception):
    """Marking a lapsed reservation bound found its room given to other pods meanwhile: the
    pod must not run on those grants (see `bound_mutate`)."""

    def __init__(self, uid: str, problems: list[str]) -> None:
        super().__init__(
            f"pod {uid}: its reservation lapsed before the bind was recorded and its room was "
            f"given to other pods meanwhile ({'; '.join(problems)})"
        )
        self.uid = uid
        self.problems = problems


def regrant_problems(
    registration: NodeRegistration, ledger: NodeLedger, uid: str, now: float,
    foreign: tuple[Allocation, ...] = (),
) -> list[str]:
    """What would go over capacity if `uid`'s allocation counted again at `now`, beside every
    other consumer of the node's cards that counts then: the ledger's other allocations and
    `foreign`, what HAMi's pods hold there (foreign.py: counted, never in the ledger). Empty: it
    still fits, on exactly the cards it names."""
    allocation = ledger.allocations[uid]
    others = [a for k, a in ledger.allocations.items() if k != uid]
    others.extend(a for a in foreign if a.pod_uid != uid)
    cards = {c.uuid: c for c in build_cards(registration, others, now)}
    problems = []
    for uuid, use in allocation_usage(allocation).items():
        card = cards.get(uuid)
        if card is None:
            problems.append(f"{uuid}: no longer on the node")
            continue
        for what, used, add, cap in (
            ("memory MiB", card.used_mem, use.memory_mib, card.memory_mib),
            ("cores %", card.used_cores, use.cores, card.cores),
            ("slots", card.used_slots, use.slots, card.split_count),
        ):
            if add > 0 and used + add > cap:
                problems.append(f"{uuid}: {what} {used} in use + {add} > {cap}")
    touched = {g.uuid for grants in allocation.containers for g in grants}
    for grants in allocation.containers:  # dynamic MIG: its instances must still fit the card
        for g in grants:
            if (card := cards.get(g.uuid)) is not None:
                card.hold(g)
    for card in (cards[u] for u in sorted(touched) if u in cards):  # e.g. an NPU's AI CPUs
        if getattr(card, "partitions", ()) and (why := card.kind.partitions_problem(card)):
            problems.append(f"{card.uuid}: {why}")
    for card in (cards[u] for u in sorted(touched) if u in cards and cards[u].mig_model):
        if card.mig_instances and card.libvgpu_slices:
            problems.append(f"{card.uuid}: MIG instances and libvgpu slices on one card")
        model = mig.model_for(card.mig_model)
        if model is not None:
            try:
                mig.occupied(model, card.mig_instances)
            except mig.MigError as exc:
                problems.append(f"{card.uuid}: {exc}")
    return problems


def bound_mutate(
    uid: str, now: float, current: NodeLedger | None,
    registration: NodeRegistration | None = None, foreign: tuple[Allocation, ...] = (),
) -> NodeLedger:
    """Mark the pod's reservation bound (the cluster bind happened). A reservation that lapsed
    meanwhile held nothing since: other pods may have been given its room. It is re-checked
    against everything that counts at `now` (with the node's `registration`), and refused with
    RoomTakenError when it no longer fits, so a card is never overfilled (HAMi's pods there,
    `foreign`, count too); without the registration a lapsed reservation cannot be checked and
    is refused too."""
    if current is None or uid not in current.allocations:
        raise ReservationGoneError("the reservation disappeared during bind")
    allocation = current.allocations[uid]
    if allocation.state != AllocationState.RESERVED:
        raise NoChange
    if not counts_against_capacity(allocation, now):
        if registration is None:
            raise RoomTakenError(uid, ["the node's registration is unknown: no re-check"])
        problems = regrant_problems(registration, current, uid, now, foreign)
        if problems:
            raise RoomTakenError(uid, problems)
    allocations = dict(current.allocations)
    allocations[uid] = allocation.model_copy(
        update={"state": AllocationState.BOUND, "expires_at": None, "updated_at": now}
    )
    return _replace(current, allocations)


def release_mutate(uid: str, removed: list[Allocation], current: NodeLedger | None) -> NodeLedger:
    """Remove the pod's allocation (and its claim): nothing is kept for dead pods; victims
    marked for it count again. The removed allocation is reported through `removed` (cleared
    on every attempt)."""
    removed.clear()
    if current is None:
        raise NoChange
    claims = current.in_flight()
    had_claim = uid in claims
    if uid not in current.allocations and not had_claim:
        raise NoChange
    allocations = dict(current.allocations)
    allocation = allocations.pop(uid, None)
    if allocation is not None:
        removed.append(allocation)
        for key, a in current.allocations.items():  # a nominee gone: its marks go with it
            if a.preempted_by == uid and key != uid:
                allocations[key] = a.model_copy(update={"preempted_by": "",
                                                        "preempted_until": None})  # fmt: skip
    return _replace(current, allocations, {k: c for k, c in claims.items() if k != uid})


def init_done_mutate(uid: str, current: NodeLedger | None) -> NodeLedger:
    allocation = current.allocations.get(uid) if current else None
    if current is None or allocation is None or allocation.init_done or not allocation.init_count:
        raise NoChange
    allocations = dict(current.allocations)
    allocations[uid] = allocation.model_copy(update={"init_done": True})
    return _replace(current, allocations)


def sweep_mutate(
    now: float, keep: frozenset[str], removed: list[Allocation], current: NodeLedger | None,
    registration: NodeRegistration | None = None, withdrawn: list[str] | None = None,
    foreign: tuple[Allocation, ...] = (),
) -> NodeLedger:
    """Drop expired reservations (except pods in `keep`, found bound meanwhile) and a lapsed
    claim; mark kept ones bound. Dropped allocations are reported through `removed`.

    A kept reservation lapsed: other pods may have been given its room since. Like
    `bound_mutate`, it is re-checked beside everything that counts at `now` (the node's
    `registration`, HAMi's pods there: `foreign`); one whose room is gone (or that cannot be
    checked) is dropped instead and its pod reported through `withdrawn` too: it is bound in
    the cluster, and must lose its grant, never run on room that is another pod's."""
    removed.clear()
    if withdrawn is not None:
        withdrawn.clear()
    if current is None:
        raise NoChange
    changed = False
    allocations = dict(current.allocations)
    for uid, a in current.allocations.items():
        expired = (
            a.state == AllocationState.RESERVED and a.expires_at is not None and a.expires_at <= now
        )
        if expired and uid in keep:
            room_gone = registration is None or regrant_problems(
                registration, _replace(current, allocations), uid, now, foreign
            )
            if not room_gone:
                allocations[uid] = a.model_copy(
                    update={"state": AllocationState.BOUND, "expires_at": None, "updated_at": now}
                )
            else:
                removed.append(allocations.pop(uid))
                if withdrawn is not None:
                    withdrawn.append(uid)
            changed = True
        elif expired or not a.active:
            removed.append(allocations.pop(uid))
            changed = True
    claims = current.in_flight()
    kept = {k: c for k, c in claims.items() if c.expires_at > now and k in allocations}
    if len(kept) != len(claims) or current.claim is not None:
        changed = True
    if not changed:
        raise NoChange
    return _replace(current, allocations, kept)


def expired_reservations(ledger: NodeLedger, now: float) -> list[Allocation]:
    return [
        a for a in ledger.allocations.values()
        if a.state == AllocationState.RESERVED and a.expires_at is not None and a.expires_at <= now
    ]  # fmt: skip


Hint = Versioned[NodeLedger] | None


class LedgerWriter:
    """The CAS writes, bound to the ledger bucket.

    Each write may take a hint: the entry and revision the index holds. The first attempt then
    writes against that revision without reading (one round trip instead of two); if the hint
    was stale, or the mutate refuses on it, the ordinary read-mutate-write loop decides."""

    def __init__(self, kv: KeyValue, claim_ahead: ClaimAhead | None = None) -> None:
        self.kv = kv
        self.claim_ahead = claim_ahead  # reservations also claim when they may (see ClaimAhead)
        self.acks: JetStreamAcks | None = None  # the hinted write's update, with less work
        # The subject nats-py's KeyValue writes a key to (its own prefix, e.g. a JS domain's).
        self._pre: str = getattr(kv, "_pre", f"$KV.{LEDGER_BUCKET}.")
        self.codec = LedgerCodec()  # encodes and decodes only the allocations that changed
        # Writes in flight: key -> (payload, value). The watch often delivers our own write
        # before its ack returns; matching the bytes spares decoding what we just encoded.
        self.in_flight: dict[str, tuple[bytes, NodeLedger]] = {}

    def own_value(self, key: str, payload: bytes) -> NodeLedger | None:
        pending = self.in_flight.get(key)
        return pending[1] if pending is not None and pending[0] == payload else None

    async def _cas(
        self, key: str, mutate: Callable[[NodeLedger | None], NodeLedger], hint: Hint
    ) -> Versioned[NodeLedger]:
        if hint is not None and hint.revision > 0:
            try:
                new = mutate(hint.value)  # copy-on-write: the hint is not modified
            except Exception:
                new = None  # refused on what may be stale: decide again on a fresh read
            if new is not None:
                payload = self.codec.encode(new)
                self.in_flight[key] = (payload, new)
                try:
                    if self.acks is not None:
                        revision = await self.acks.update(self._pre + key, payload, hint.revision)
                    else:
                        revision = await self.kv.update(key, payload, last=hint.revision)
                    return Versioned(new, revision)
                except KeyWrongLastSequenceError:
                    pass
                finally:
                    if self.in_flight.get(key, (None,))[0] is payload:
                        del self.in_flight[key]
        return await self._cas_read(key, mutate)

    async def _cas_read(
        self, key: str, mutate: Callable[[NodeLedger | None], NodeLedger], attempts: int = 25
    ) -> Versioned[NodeLedger]:
        """`tessera.bus.cas_update` (read, mutate, write at that revision, retry on conflict;
        NoChange returns the current value), the entry decoded and encoded by the incremental
        codec: a node packed by a burst while its agent writes conflicts often, and each retry
        re-reads an entry of tens of allocations of which one or two changed."""
        delay = 0.002
        for _ in range(attempts):
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:  # (nats-py reports a deleted or purged key so too)
                entry = None
            current = None
            if entry is not None and entry.value is not None and entry.operation not in (
                "DEL", "PURGE"
            ):
                current = Versioned(self.codec.decode(key, entry.value), entry.revision)
            try:
                new = mutate(current.value if current is not None else None)
            except NoChange:
                if current is None:
                    raise
                return current
            payload = self.codec.encode(new)
            self.in_flight[key] = (payload, new)
            try:
                if current is None:
                    revision = await self.kv.create(key, payload)
                elif self.acks is not None:
                    revision = await self.acks.update(self._pre + key, payload, current.revision)
                else:
                    revision = await self.kv.update(key, payload, last=current.revision)
            except KeyWrongLastSequenceError:
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(0.1, delay * 2)
                continue
            finally:
                if self.in_flight.get(key, (None,))[0] is payload:
                    del self.in_flight[key]
            return Versioned(new, revision)
        raise CasConflictError(f"{key}: gave up after {attempts} conflicting writes")

    async def reserve(self, req: ReservationRequest, hint: Hint = None) -> Versioned[NodeLedger]:
        if self.claim_ahead is not None and req.claim_ahead is None:
            req = replace(req, claim_ahead=self.claim_ahead)
        return await self._cas(req.template.node, partial(reserve_mutate, req), hint)

    async def claim(
        self, node: str, uid: str, holder: str, now: float, ttl_s: float, hint: Hint = None,
        max_in_flight: int = 0, registration: NodeRegistration | None = None,
        foreign: tuple[Allocation, ...] = (),
    ) -> Versioned[NodeLedger]:
        mutate = partial(claim_mutate, uid, holder, now, ttl_s, max_in_flight=max_in_flight,
                         registration=registration, foreign=foreign)  # fmt: skip
        return await self._cas(node, lambda current: mutate(current), hint)

    async def mark_bound(
        self, node: str, uid: str, now: float, hint: Hint = None,
        registration: NodeRegistration | None = None, foreign: tuple[Allocation, ...] = (),
    ) -> Versioned[NodeLedger]:
        """RoomTakenError when the reservation lapsed and its room is gone (bound_mutate)."""
        return await self._cas(node, partial(bound_mutate, uid, now, registration=registration,
                                             foreign=foreign), hint)  # fmt: skip

    async def release(
        self, node: str, uid: str, hint: Hint = None
    ) -> tuple[Versioned[NodeLedger] | None, Allocation | None]:
        """(the new entry, the allocation removed by this call or None)."""
        removed: list[Allocation] = []
        try:
            result = await self._cas(node, partial(release_mutate, uid, removed), hint)
        except NoChange:
            return None, None
        return result, (removed[0] if removed else None)

    async def set_init_done(self, node: str, uid: str) -> Versioned[NodeLedger] | None:
        try:
            return await cas_update(self.kv, node, NodeLedger, partial(init_done_mutate, uid))
        except NoChange:
            return None

    async def sweep(
        self, node: str, now: float, keep: frozenset[str] = frozenset(),
        registration: NodeRegistration | None = None, withdrawn: list[str] | None = None,
        foreign: tuple[Allocation, ...] = (),
    ) -> tuple[Versioned[NodeLedger] | None, list[Allocation]]:
        """(the new entry, the allocations this call dropped); kept pods whose room was gone
        are dropped too and named in `withdrawn` (see `sweep_mutate`)."""
        removed: list[Allocation] = []
        try:
            result = await cas_update(self.kv, node, NodeLedger, partial(
                sweep_mutate, now, keep, removed, registration=registration, withdrawn=withdrawn,
                foreign=foreign,
            ))  # fmt: skip
        except NoChange:
            return None, []
        return result, list(removed)
