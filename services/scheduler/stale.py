"""Which ledger allocations belong to pods the cluster no longer has (pure: no I/O).

A pod deleted while no scheduler watched (the scheduler or NATS was down, or the whole stack was
stopped and started again on the same NATS store while the cluster was replaced) leaves its
allocation in the ledger: its cards stay held until something notices. Before a (re)started
scheduler serves, and periodically after, the allocations are compared with a listing of the
cluster's pods by uid (`stale_release.py` does the I/O); `stale_allocations` decides.

The grace, so that nothing still being created is freed:
- an allocation written after the listing began (less `skew_s` for clocks and a listing that is
  served from a cache a moment old) is kept: its pod may be too new for the listing;
- an unexpired reservation is kept even when its pod is not listed: it lapses by itself at the end
  of its TTL (the sweeper), and a pod that is only being created is never freed under it;
- everything else whose pod uid the listing lacks (or lists as finished, when phases were read)
  is released, with the reason.

The pass before ready uses no skew (`skew_s=0`): the ledger it judges was read before its listing
began (runtime.py says why), so only the periodic pass, whose ledger moves while it lists, needs it.

A listing of whole pods (the periodic pass) reads phases; the rebuild's slim listing skips
decoding the pods the ledger places, so before ready only pods the cluster lacks are released
(a finished pod goes once the pod watch replays it, right after).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

# A listing is a consistent read, but the allocation's time comes from another clock.
DEFAULT_SKEW_S = 5.0
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
GONE = "pod no longer exists (deleted while no scheduler watched it)"


@dataclass(frozen=True)
class StaleRelease:
    node: str
    pod_uid: str
    namespace: str
    name: str
    why: str


@dataclass(frozen=True)
class Listing:
    """What a listing of the cluster's pods says about the pods the ledger places: those it lacks
    and those it lists as finished (kept small: never every uid of a large cluster)."""

    listed_at: float  # when the listing began (the scheduler's clock)
    unlisted: AbstractSet[str]  # uids of placed pods the listing does not hold
    finished: Mapping[str, str] = field(default_factory=dict)  # placed uid -> Succeeded/Failed

    @classmethod
    def of_pods(cls, pods: Iterable[Any], listed_at: float, placed: Mapping[str, Any]
                ) -> Listing:  # fmt: skip
        """From a listing of whole pods (phases read)."""
        listed: set[str] = set()
        finished: dict[str, str] = {}
        for pod in pods:
            meta = pod.get("metadata") if isinstance(pod, dict) else None
            uid = meta.get("uid") if isinstance(meta, dict) else None
            if type(uid) is not str:
                continue
            listed.add(uid)
            status = pod.get("status")
            phase = status.get("phase") if isinstance(status, dict) else None
            if phase in FINISHED_PHASES and uid in placed:
                finished[uid] = phase
        return cls(listed_at, placed.keys() - listed, finished)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def verdict(allocation: Any, listing: Listing, skew_s: float = DEFAULT_SKEW_S) -> str:
    """Why this allocation is stale ('' when it is kept). Reads `pod_uid`, `state`, `created_at`
    and `expires_at` (a NodeLedger's Allocation, or the index's undecoded view of one)."""
    uid = allocation.pod_uid
    phase = listing.finished.get(uid)
    if phase is None and uid not in listing.unlisted:
        return ""
    created = _number(getattr(allocation, "created_at", None))
    if created is None or created >= listing.listed_at - skew_s:
        return ""  # written while (or after) the cluster was listed: its pod may be too new
    if str(getattr(allocation, "state", "")) == "reserved":
        expires = _number(getattr(allocation, "expires_at", None))
        if expires is None or expires > listing.listed_at:
            return ""  # a reservation still running: it lapses by itself (the sweeper)
    if phase is not None:
        return f"pod {phase.lower()} while no scheduler watched it"
    return GONE


def stale_allocations(
    placed: Mapping[str, str], ledgers: Mapping[str, Any], listing: Listing,
    skew_s: float = DEFAULT_SKEW_S,
) -> list[StaleRelease]:
    """The active allocations that belong to no live pod of the listing, with why. `placed`:
    pod uid -> node of every active allocation (the index keeps it); `ledgers`: node -> its
    ledger or the index's view of it (anything with `allocations`)."""
    found: list[StaleRelease] = []
    for uid in sorted({*listing.unlisted, *listing.finished}):
        node = placed.get(uid)
        allocations = getattr(ledgers.get(node), "allocations", None) or {} if node else {}
        allocation = allocations.get(uid)
        if allocation is None or not allocation.active:
            continue  # released, or placed elsewhere, since the listing
        why = verdict(allocation, listing, skew_s)
        if why:
            found.append(StaleRelease(
                node=str(node), pod_uid=uid, namespace=str(getattr(allocation, "namespace", "")),
                name=str(getattr(allocation, "name", "")), why=why,
            ))  # fmt: skip
    return found


class UnlistedRecorder:
    """Wraps a slim listing's `need` (tessera.cluster.slim_pods): starts from the uids the index
    places and strikes out each one a page lists, read or skipped, so the rebuild's one listing
    serves the stale check too. One set operation per page, in C; what is left is small (the
    pods that are gone), never a copy of every uid listed."""

    def __init__(self, need: Any, placed: Mapping[str, Any]) -> None:
        self.need = need
        self.unlisted: set[Any] = set(placed)

    def __call__(self, uids: list[Any], schedulers: list[Any]) -> list[bool]:
        try:
            self.unlisted.difference_update(uids)
        except TypeError:  # a hostile pod's uid that is a list or an object: not a pod of ours
            self.unlisted.difference_update(u for u in uids if type(u) is str)
        wanted: list[bool] = self.need(uids, schedulers)
        return wanted

    def listing(self, listed_at: float) -> Listing:
        return Listing(listed_at, self.unlisted)
