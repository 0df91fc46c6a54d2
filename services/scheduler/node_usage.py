"""One node's GPU usage kept up to date from the change, not recounted from every allocation.

A write changes one allocation of a node that holds tens; the index used to recount them all
(`build_cards`) on every change. `NodeUsage` keeps, per GPU, what the counting allocations hold
and which allocation object each uid was counted from: allocations are copy-on-write, so an
unchanged one is the same object and costs an identity check, and a changed one is taken back
and counted again. Whether an allocation counts depends on the time (a reservation lapses, a
preemption victim's hand-over ends): the usage is valid until the earliest such change, and is
recounted in full after it, or when the clock went back. The result is exactly what
`build_cards` counts at that time (tests/scheduler/test_node_usage.py checks it).

`version` changes whenever the usage may have changed; an update whose changed allocations
charge exactly what they charged before (a claim, a bind, the agent's Allocate: states and
expiries move, grants do not) leaves it as it was, so the index can keep the node's row
(tests/scheduler/test_row_kept.py compares such rows with rows built afresh).
"""

from __future__ import annotations

import math
from typing import Any

from tessera.models import AllocationState

from .cards import add_charges, charges, counts_against_capacity, status_changes_at

# Active states in which an allocation holds its capacity whatever the time (a reservation
# lapses; a preemption mark frees it for a while).
_HOLDING = frozenset({AllocationState.BOUND.value, AllocationState.ALLOCATED.value})


class NodeUsage:
    __slots__ = ("changes", "counted", "counted_at", "reservations", "usage", "version")

    def __init__(self) -> None:
        self.usage: dict[str, list[int]] = {}  # GPU UUID -> [memory, cores, slots]
        # uid -> (the allocation object it was counted from, whether it counts); None: unknown
        # (counted in full without remembering, as at start-up), so the next update recounts.
        self.counted: dict[str, tuple[Any, bool]] | None = None
        self.counted_at = -math.inf
        self.changes: dict[str, float] = {}  # uid -> when whether it counts next changes
        self.reservations: dict[str, float] = {}  # uid -> expiry, every RESERVED one
        self.version = 0  # changes whenever `usage` may have changed (see the module's doc)

    def update(self, allocations: dict[str, Any], now: float, remember: bool = True) -> None:
        """Bring the usage to `allocations` at time `now`. `remember=False` (start-up: most
        nodes never change afterwards) counts without keeping what each uid was counted from."""
        counted = self.counted
        if (
            counted is None or now < self.counted_at
            or (self.changes and now >= min(self.changes.values()))
        ):  # fmt: skip
            self._recount(allocations, now, remember)
            return
        moved = False
        for uid, allocation in allocations.items():
            held = counted.get(uid)
            if held is not None and held[0] is allocation:
                continue
            before = charges(held[0]) if held is not None and held[1] else None
            if held is not None:
                self._drop(uid, held, before)
            after = self._count(uid, allocation, now, counted)
            if not moved and before != after:
                moved = True  # (equal charges: the usage is exactly what it was)
        if len(counted) != len(allocations):
            for uid in [u for u in counted if u not in allocations]:
                held = counted.pop(uid)
                if held[1]:
                    moved = True
                self._drop(uid, held)
        self.counted_at = now
        if moved:
            self.version += 1

    def counted_as(self, usage: dict[str, list[int]], now: float) -> None:
        """`update(allocations, now, remember=False)` where `usage` is what every allocation
        holds and each holds it whatever the time (bound or allocated, unmarked: what
        `wire_fast.slim_all` counts as it reads an entry): taken as it is."""
        self.usage = usage
        self.changes = {}
        self.reservations = {}
        self.counted = None
        self.counted_at = now
        self.version += 1

    def _recount(self, allocations: dict[str, Any], now: float, remember: bool) -> None:
        self.version += 1
        self.usage = {}
        self.changes = {}
        self.reservations = {}
        self.counted_at = now
        if not remember:
            self.counted = None
            self._count_all(allocations, now)
            return
        counted: dict[str, tuple[Any, bool]] = {}
        for uid, allocation in allocations.items():
            self._count(uid, allocation, now, counted)
        self.counted = counted

    def _count_all(self, allocations: dict[str, Any], now: float) -> None:
        """`_count` of every allocation, inlined, keeping nothing per uid (start-up: 5,000
        nodes' worth; the next update of the node recounts anyway)."""
        usage, reservations = self.usage, self.reservations
        reserved = AllocationState.RESERVED.value
        for uid, allocation in allocations.items():
            state = allocation.state
            if state in _HOLDING and not allocation.preempted_by:
                pass  # counts (counts_against_capacity's common case, inlined)
            elif state == reserved and allocation.expires_at is not None:
                reservations[uid] = allocation.expires_at
                if not counts_against_capacity(allocation, now):
                    continue
            elif not counts_against_capacity(allocation, now):
                continue
            if allocation.init_count:
                add_charges(usage, charges(allocation))
                continue
            for grants in allocation.containers:
                for grant in grants:
                    used = usage.get(grant.uuid)
                    if used is None:
                        usage[grant.uuid] = [grant.memory_mib, grant.cores, 1]
                    else:
                        used[0] += grant.memory_mib
                        used[1] += grant.cores
                        used[2] += 1

    def _count(
        self, uid: str, allocation: Any, now: float, counted: dict[str, tuple[Any, bool]]
    ) -> list | None:
        """Count one allocation; what it charges (None when it does not count)."""
        counts = counts_against_capacity(allocation, now)
        held = None
        if counts:
            held = charges(allocation)
            add_charges(self.usage, held)
        counted[uid] = (allocation, counts)
        when = status_changes_at(allocation, now)
        if when is not None:
            self.changes[uid] = when
        if allocation.state == AllocationState.RESERVED and allocation.expires_at is not None:
            self.reservations[uid] = allocation.expires_at
        return held

    def _drop(self, uid: str, held: tuple[Any, bool], charged: list | None = None) -> None:
        allocation, counts = held
        if counts:
            add_charges(self.usage, charged if charged is not None else charges(allocation), -1)
        self.changes.pop(uid, None)
        self.reservations.pop(uid, None)
