"""Memory beyond the guarantee: the card-wide rule the lease service applies (pure; no I/O).

A container on a card has a *guarantee* (what the scheduler packed it by) and a *limit* (its
burst limit, never below the guarantee; a hard slice has limit == guarantee). What it holds on
lease (`leased`) above its guarantee is *borrowed*. The card's memory is split as

    reserved(x) = max(guarantee(x), leased(x))        for every container x on the card
    room        = card - sum(reserved)                memory nobody is guaranteed or holds
    free        = card - sum(leased)                  memory nobody holds

A request is granted

* up to its own limit, as for every slice (`limit`);
* beyond its guarantee only out of `room` — never out of a neighbour's guarantee, used or not;
* within its guarantee, while borrowers hold memory on the card, only out of `free`: when that
  is short the borrowers' memory is *reclaimed* (their unused leases recalled, their next
  allocation beyond the guarantee refused, borrowers that opted in evicted) and the request
  waits for it. With no borrower on the card the rule is exactly the hard slice's of before.

Borrowers that do not give the memory back within the node's grace bound are evicted whatever
their own policy when the node enforces guarantees (`ENFORCE_EVICT`, the default).

`offer` answers one request; `reclaim_victims` picks which borrowers an eviction would free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

RECLAIM_FAIL = "fail"  # default: a borrower's allocations beyond its guarantee fail under pressure
RECLAIM_EVICT = "evict"  # opt-in: the node agent evicts the borrowing pod (an event says so)
RECLAIM_POLICIES = (RECLAIM_FAIL, RECLAIM_EVICT)

# The node's say (TESSERA_MEMORY_RECLAIM_ENFORCEMENT): whether a borrower that does not give the
# memory back within the grace bound is evicted whatever its own policy.
ENFORCE_EVICT = "evict"  # default: a guarantee is a guarantee
ENFORCE_BORROWER = "borrower"  # only borrowers that opted in are evicted (the pod's policy alone)
ENFORCEMENTS = (ENFORCE_EVICT, ENFORCE_BORROWER)


@dataclass(frozen=True)
class Holder:
    """One container on one card, as the lease service sees it."""

    key: str  # "<pod uid>/<index>"
    guarantee: int  # bytes
    limit: int  # bytes (>= guarantee)
    leased: int  # bytes held on lease now
    policy: str = RECLAIM_FAIL

    @property
    def borrowed(self) -> int:
        return max(0, self.leased - self.guarantee)

    @property
    def reserved(self) -> int:
        return max(self.guarantee, self.leased)


class Refusal(StrEnum):
    LIMIT = "limit"  # past the container's own (burst) limit
    BORROW = "borrow"  # beyond the guarantee, and the card has no room to lend
    RECLAIM = "reclaim"  # within the guarantee, but borrowers hold the card's free memory


@dataclass(frozen=True)
class Offer:
    grant: int  # bytes (0: refused, see `refusal`)
    refusal: Refusal | None = None
    short: int = 0  # bytes missing on the card (RECLAIM: what borrowers must give back)


def offer(me: Holder, others: Sequence[Holder], card: int, need: int, want: int) -> Offer:
    """What `me` may lease now: need..want bytes, or a refusal saying why. `card` is the card's
    physical memory in bytes (0: unknown — nothing is lent, a guarantee behaves as a hard
    slice)."""
    own = me.limit - me.leased
    if need <= 0 or need > own:
        return Offer(0, Refusal.LIMIT)
    want = max(want, need)
    g_left = max(0, me.guarantee - me.leased)
    borrowers = any(o.borrowed for o in others)
    if card <= 0 or (me.limit <= me.guarantee and not borrowers):
        # unknown card, or a hard slice with nobody borrowing: exactly as before elastic memory
        cap = min(own, g_left) if card <= 0 else own
        return Offer(min(want, cap)) if need <= cap else Offer(0, Refusal.BORROW)
    room = card - me.reserved - sum(o.reserved for o in others)
    free = card - me.leased - sum(o.leased for o in others)
    cap = min(own, g_left + max(0, room))
    if borrowers:
        cap = min(cap, max(0, free))
    if need <= cap:
        return Offer(min(want, cap))
    if need <= g_left:  # the guarantee is due: only borrowers stand in the way
        return Offer(0, Refusal.RECLAIM, short=need - max(0, free))
    return Offer(0, Refusal.BORROW)


def reclaim_victims(others: Sequence[Holder], short: int,
                    policies: Sequence[str] = (RECLAIM_EVICT,)) -> list[Holder]:  # fmt: skip
    """Borrowers whose policy is one of `policies` (by default: those that opted in to
    eviction), most borrowed first, until `short` bytes would come back (all of them if that is
    not enough). The node's enforcement past the grace bound passes every policy."""
    out: list[Holder] = []
    got = 0
    for h in sorted((o for o in others if o.borrowed and o.policy in policies),
                    key=lambda o: (-o.borrowed, o.key)):  # fmt: skip
        if got >= short:
            break
        out.append(h)
        got += h.leased  # evicting a pod frees all it holds, its guarantee too
    return out
