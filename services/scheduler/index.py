"""The in-memory index: per node, per GPU free capacity, kept current by the KV watches.

Each node has a slot in a few numpy arrays that summarise it (how many cards still take a pod,
the largest free memory, ...). A filter call resolves its candidate names to slots (cached while
kube-scheduler keeps sending the same list), prunes with vectorised comparisons and orders the
survivors by the node policy; only then does the per-GPU fit run, node by node, stopping at the
first that fits. The cost is O(candidate nodes) with a tiny constant, never O(pods in cluster).
No I/O here: the watch loops feed it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from tessera.models import ACTIVE_STATES, AllocationState, NodeLedger, NodeRegistration

from .bulk_rows import rows_of
from .candidate_order import (
    PolicyOrder,
    fresh_order,
    fresh_walk,
    full_order,
    policy_sign,
    walk,
)
from .card_summaries import Cards, Need, joint_mask, row_holds, row_joint, summary_mask
from .cards import (
    Card,
    add_charges,
    cards_with_usage,
    charges,
    counts_against_capacity,
    hold_grants,
    holds_partitions,
    node_score,
    recharged,
)
from .name_table import NameTable
from .native_walk import Addresses, NativePlan, native_layout
from .node_names import NodeNames
from .node_usage import NodeUsage
from .refusal_memo import RefusalMemo, RefusalMemos
from .refusal_shapes import UNSHAREABLE, CardClasses
from .refusal_states import RowStates
from .request_facts import RequestFacts
from .wire_fast import LedgerWire, RegistrationWire

_GROW = 1024
_RESERVED = AllocationState.RESERVED.value  # (a str compares faster with a str)
_WIDTH = 8  # cards per row; widened when a node has more GPUs
_CANDIDATE_CACHE = 8
# Rungs of free cores at which a node's most free memory and % are kept (`bound_mem_at`,
# `bound_pct_at`): rung 0 = the cards that still compute, rung r >= 1 = the cards with at
# least 10 * r cores free.
_RUNGS = 11
# How many cards the k-th most free memory among a node's computing cards is kept for
# (`bound_mem_kth`, a row per k): a container asking for n >= k cards needs k of them with its
# memory, which the most free memory of any one card (`bound_mem_at`) does not rule out.
_KTH = (2, 4, 8)


def cores_rung(cores: int) -> int:
    """The rung whose cards include every card with `cores` free cores (0: still computing)."""
    return min(cores // 10, _RUNGS - 1) if cores >= 10 else 0


def kth_most_memory(memory: list[int], computing: list[bool]) -> list[int]:
    """Per k of `_KTH`, the k-th most free memory among a row's computing cards (-1: fewer
    cards, and any value below -1: no request's memory is negative)."""
    ranked = sorted((free for free, computes in zip(memory, computing, strict=True)
                     if computes), reverse=True)  # fmt: skip
    return [max(ranked[k - 1], -1) if len(ranked) >= k else -1 for k in _KTH]


def rungs_of(
    memory: list[int], percentage: list[int], cores: list[int], computing: list[bool]
) -> tuple[list[int], list[int]]:
    """Per rung, the most free memory and the most free % among a row's cards on that rung
    (-1: none). A card with c >= 1 cores free still computes, so each rung's cards include the
    next rung's."""
    most_memory, most_percentage = [-1] * _RUNGS, [-1] * _RUNGS
    for free, share, left, computes in zip(memory, percentage, cores, computing, strict=True):
        if computes:  # on its own top rung first, then carried down to the lower ones
            top = cores_rung(left)
            if free > most_memory[top]:
                most_memory[top] = free
            if share > most_percentage[top]:
                most_percentage[top] = share
    for rung in range(_RUNGS - 2, -1, -1):
        if most_memory[rung + 1] > most_memory[rung]:
            most_memory[rung] = most_memory[rung + 1]
        if most_percentage[rung + 1] > most_percentage[rung]:
            most_percentage[rung] = most_percentage[rung + 1]
    return most_memory, most_percentage


@dataclass
class NodeEntry:
    """What the index knows of one node: its registration, ledger entry, row and cards."""

    name: str
    slot: int
    # The node's registration: a NodeRegistration, or a RegistrationWire (checked, not built
    # yet: wire_fast.py) that `registration` builds on first use. The index reads either.
    registered: NodeRegistration | RegistrationWire | None = None
    # The node's ledger entry: a NodeLedger, or a LedgerWire (checked, not built yet: see
    # wire_fast.py) that `ledger` builds on first use. `view` reads either without building.
    view: NodeLedger | LedgerWire | None = None
    ledger_revision: int = 0
    cordoned: frozenset[str] = frozenset()
    score: float = 0.0
    reserved_until: float | None = None  # earliest expiry of a reservation here
    blocked: str = ""  # why nothing may be placed here (HAMi's holdings unknown: foreign.py)
    usage: NodeUsage = field(default_factory=NodeUsage)  # what its ledger's pods hold, per GPU
    # The node's cards with usage, built when first read (`cards`): most nodes' rows change
    # many times (start-up, writes) between two fits that look at their cards.
    _cards: list[Card] | None = field(default=None, repr=False)
    _card_usage: tuple[Sequence[dict[str, list[int]]], frozenset[str]] = field(
        default=((), frozenset()), repr=False
    )
    # (devices, cordon, cards) of the last cards `cards` built: the next are copied from them
    # (`recharged`) while the devices list and the cordon are the same.
    _built: tuple[Any, frozenset[str], list[Card]] | None = field(default=None, repr=False)
    # The devices list of the RegistrationWire `registered` was built from: its heartbeats
    # (which carry that list) re-date the built model instead of replacing it.
    _built_from: list[Any] | None = field(default=None, repr=False)
    # (devices, cordon, usage version, row) of the last row `_summarise` built from the devices
    # and usage map: a write that changes none of them keeps the row (see `_kept_row`).
    _row: tuple | None = field(default=None, repr=False)
    # (classes of the cards that take pods, in row order; signature of the others) of the row
    # last built (`refusal_shapes.CardClasses.shape`; written with the row)
    _shape: tuple[list[int], int, list[int]] | None = field(default=None, repr=False)

    @property
    def schedulable(self) -> bool:
        return self.registered is not None

    @property
    def registration(self) -> NodeRegistration | None:
        registered = self.registered
        if type(registered) is RegistrationWire:
            self._built_from = registered.devices
            registered = self.registered = registered.materialize()
        return registered  # type: ignore[return-value]

    @property
    def ledger(self) -> NodeLedger | None:
        view = self.view
        if type(view) is LedgerWire:
            view = self.view = view.materialize()
        return view  # type: ignore[return-value]

    @property
    def cards(self) -> list[Card]:
        """The GPUs with what the ledger's pods and HAMi's pods hold (as of the row)."""
        cards = self._cards
        if cards is None:
            registered = self.registered
            if registered is None:
                cards = []
            else:
                usages, cordon = self._card_usage
                devices, built = registered.devices, self._built
                if built is not None and built[0] is devices and built[1] == cordon:
                    cards = recharged(built[2], usages)
                else:
                    cards = cards_with_usage(registered, usages, cordon)  # type: ignore[arg-type]
                self._built = (devices, cordon, cards)
            self._cards = cards
        return cards

    @cards.setter
    def cards(self, cards: list[Card]) -> None:
        self._cards = cards


def free_percentage(free: int, memory: int) -> int:
    """The largest `gpumem-percentage` a card with `free` of `memory` MiB can take: the largest
    p with memory * p // 100 <= free (`ContainerRequest.memory_on`, rules.check_memory), so a
    node whose card takes the request is never pruned (free * 100 // memory rounds down, and
    refused 1 % = 819 MiB of an 80 GiB card with exactly 819 MiB free)."""
    if memory <= 0:
        return -1 if free < 0 else 32767
    return min((100 * (free + 1) - 1) // memory, 32767)


def _summed(usages: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """GPU UUID -> [memory, cores, slots] of several usage maps added up."""
    total: dict[str, list[int]] = {}
    for usage in usages:
        for uuid, (memory, cores, slots) in usage.items():
            held = total.get(uuid)
            if held is None:
                total[uuid] = [memory, cores, slots]
            else:
                held[0] += memory
                held[1] += cores
                held[2] += slots
    return total


def bound_conditions(needs: list[Need]) -> list[tuple[str, int | None, int]]:
    """What `_possible` asks of a candidate, as (bound, rung or None, minimum): its bound (at
    that rung of free cores) must be at least the minimum. The memory bound is read per
    container at its cores (`bound_mem_at`: the most free memory among the cards that also
    have those cores), and so is its %; the others are taken at their largest over the
    containers. (Also read in C: `native_walk.py`.)"""
    gpus = max((n.gpus for n in needs), default=0)
    conditions: list[tuple[str, int | None, int]] = [("free_gpus", None, max(gpus, 0))]
    carded = [n for n in needs if n.gpus >= 1]  # a card must pass all of the need at once
    for need in carded:
        rung = cores_rung(need.cores)
        conditions.append(("bound_mem_at", rung, need.memory_mib))
        if need.gpus >= _KTH[0] and need.memory_mib > 0:  # (k of its cards with the memory)
            kth = max(at for at, k in enumerate(_KTH) if k <= need.gpus)
            conditions.append(("bound_mem_kth", kth, need.memory_mib))
        if need.memory_percentage > 0:
            conditions.append(("bound_pct_at", rung, need.memory_percentage))
    cores = max((n.cores for n in carded), default=0)
    if cores > 0:
        conditions.append(("bound_cores", None, cores))
    computing = max((n.gpus for n in carded if not n.cores), default=0)
    if computing > 0:
        conditions.append(("bound_computing", None, computing))
    idle = max((n.gpus for n in carded if n.cores >= 100), default=0)
    if idle > 0:
        conditions.append(("bound_idle", None, idle))
    return conditions


def _possible(
    columns: dict[str, np.ndarray], needs: list[Need], at: np.ndarray | None = None
) -> np.ndarray:
    """Candidates whose bounds (`ClusterIndex._write_bounds`) reach every container's demand
    (`bound_conditions`): a necessary condition of `ClusterIndex._mask` (a node it refuses,
    `_mask` refuses too), so the order of those `_mask` passes is unchanged. `at`: only these
    positions (in that order); None: every candidate."""
    possible: np.ndarray | None = None
    for name, rung, minimum in bound_conditions(needs):
        values = columns[name] if rung is None else columns[name][rung]
        reaches = (values if at is None else values[at]) >= minimum
        if possible is None:
            possible = reaches
        else:
            possible &= reaches
    assert possible is not None  # (free_gpus is always asked)
    return possible


def _possible_at(
    bounds: dict[str, np.ndarray], needs: list[Need], slots: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """`_possible` of the candidates at `positions` of a list of `slots`, read from the
    index's own arrays (`bounds`, by slot)."""
    return _possible(bounds, needs, slots[positions])


class _Columns:
    """The per-node values a decision orders by (score, busy), gathered in one candidate list's
    order and kept current from the index's log of written rows, and the list's order under
    each node policy (`candidate_order.PolicyOrder`), told which positions' scores changed.
    kube-scheduler sends the same list call after call and a call changes a few nodes: a
    decision then patches the rows written since the last one, instead of gathering and
    sorting every candidate again (O(changed rows), not O(candidates))."""

    NAMES = ("scores", "busy", "free_gpus", "bound_mem_at", "bound_pct_at", "bound_cores",
             "bound_computing", "bound_idle", "bound_mem_kth")  # fmt: skip

    def __init__(self, slots: np.ndarray) -> None:
        self.slots = slots
        # slot -> position, built when first patched (a list used once never needs it); False:
        # a slot listed twice, so the values are gathered again instead of patched.
        self.where: dict[int, int] | bool | None = None
        self.arrays: dict[str, np.ndarray] = {}
        self.orders: dict[str, PolicyOrder] = {}
        self.seen = -1  # the log position these values are current at (-1: never gathered)

    def current(self, index: ClusterIndex, log: list[int], base: int) -> _Columns:
        fresh = base + len(log)
        if fresh == self.seen:
            return self
        few = self.seen >= base and (fresh - self.seen) * 16 <= len(self.slots)
        if few and self.where is None:
            self.where = {slot: position for position, slot in enumerate(self.slots.tolist())}
            if len(self.where) != len(self.slots):
                self.where = False
        where = self.where
        if not few or not where:
            before = self.arrays.get("scores")
            slots = self.slots
            # (a 2-D bound is gathered node-minor, as the index keeps it: one rung's row is
            # compared over every candidate at once)
            self.arrays = {name: np.ascontiguousarray(getattr(index, name)[..., slots])
                           for name in self.NAMES}  # fmt: skip
            if before is None:
                self.orders.clear()
            else:
                self._changed(np.flatnonzero(before != self.arrays["scores"]).tolist())
        else:
            assert isinstance(where, dict)
            arrays = self.arrays
            scores, index_scores = arrays["scores"], index.scores
            changed = []
            for slot in set(log[self.seen - base :]):
                position = where.get(slot)
                if position is not None:
                    score = index_scores[slot]
                    if score != scores[position]:
                        changed.append(position)
                    for name, column in arrays.items():
                        column[..., position] = getattr(index, name)[..., slot]
            self._changed(changed)
        self.seen = fresh
        return self

    def _changed(self, positions: list[int]) -> None:
        if positions:
            for order in self.orders.values():
                order.changed(positions)

    def tidy(self) -> int:
        """Merge the policy orders that have many changed positions (`PolicyOrder.tidy`), as of
        the values last gathered: how many were merged."""
        scores = self.arrays.get("scores")
        return 0 if scores is None else sum(order.tidy(scores) for order in self.orders.values())

    def order(self, policy: str) -> PolicyOrder:
        """The list in the node policy's order (built at its first use)."""
        order = self.orders.get(policy)
        if order is None:
            order = self.orders[policy] = PolicyOrder(policy_sign(policy), self.arrays["scores"])
        return order


class _ColumnCache:
    """`_Columns` of the recent candidate lists, and the log of the rows written since."""

    KEEP = 1 << 15  # log entries kept (a list further behind is gathered again)
    LISTS = 8

    def __init__(self) -> None:
        self.written: list[int] = []  # slots whose row was written, in order
        self.base = 0  # the log position of written[0]
        self.kept: dict[int, _Columns] = {}

    def log(self, slots: list[int]) -> None:
        self.written.extend(slots)
        if len(self.written) > 2 * self.KEEP:
            drop = len(self.written) - self.KEEP
            del self.written[:drop]
            self.base += drop

    def columns(self, index: ClusterIndex, slots: np.ndarray) -> _Columns:
        columns = self.kept.get(id(slots))
        if columns is None or columns.slots is not slots:
            columns = _Columns(slots)
            if len(self.kept) >= self.LISTS:
                self.kept.pop(next(iter(self.kept)))
            self.kept[id(slots)] = columns
        return columns.current(index, self.written, self.base)


_DISTINCT_CHUNK = 1024  # candidates of a chunk from which each distinct row is checked once


class _FreshPlans:
    """What a fresh list's walk is given, kept by the index: per set of bound columns read
    (`bound_conditions` without its minimums; a handful) the bound columns by name
    (`_possible`'s) and the arrays' `NativeLayout`, checked and addressed once; per request
    shape (needs, busy avoided) the bound conditions and the `NativePlan` with its minimums.
    Either is used only while the index's arrays it was made of are its arrays (a node added
    replaces them). A varied stream of shapes (every pod its own memory) builds a plan from its
    layout per call: a list of minimums, not the checks and addresses."""

    SHAPES = 1024  # request shapes kept (then started over)

    def __init__(self) -> None:
        self._layouts: dict[tuple, tuple] = {}
        self._shapes: dict[tuple, tuple] = {}

    def of(
        self, index: ClusterIndex, needs: list[Need], avoid_busy: bool
    ) -> tuple[dict[str, np.ndarray], NativePlan | None]:
        """(the bound columns by name, the walk's plan or None: C does not take it)."""
        index._grow_bounds()
        key = (tuple(needs), avoid_busy)
        kept = self._shapes.get(key)
        if kept is not None and _current(index, kept[0]):
            return kept[1], kept[2]
        conditions = bound_conditions(needs)
        read = tuple((name, rung) for name, rung, _least in conditions)
        layout = self._layouts.get((read, avoid_busy))
        if layout is None or not _current(index, layout[0]):
            bounds = {name: getattr(index, name) for name in _Columns.NAMES}
            busy = index.busy if avoid_busy else None
            native = native_layout(index.scores, busy,
                                   [(bounds[name], rung) for name, rung in read],
                                   index.native_addresses)  # fmt: skip
            used = {name for name, _rung in read} | {"scores", "busy"}
            layout = ((tuple((name, bounds[name]) for name in sorted(used))), bounds, native)
            self._layouts[(read, avoid_busy)] = layout
        arrays, bounds, native = layout
        plan = native.plan([least for _name, _rung, least in conditions]) if native else None
        if len(self._shapes) >= self.SHAPES:
            self._shapes.clear()
        self._shapes[key] = (arrays, bounds, plan)
        return bounds, plan


def _current(index: ClusterIndex, arrays: tuple[tuple[str, np.ndarray], ...]) -> bool:
    """Whether these (name, array) are still the index's arrays."""
    return all(getattr(index, name) is array for name, array in arrays)


class _Ordering:
    """The candidates in policy order (non-busy first, then the policy's key, ties in the
    caller's order), walked from the list's kept policy order (`candidate_order.walk`).
    Candidates that the per-node bounds already rule out (`_possible`) are never walked nor
    checked: they are pruned. The others are checked as they are reached against the per-card
    summaries: the first few one by one in Python (`row_holds`), then a chunk at a time
    (`ClusterIndex._mask`)."""

    def __init__(
        self, index: ClusterIndex, slots: np.ndarray, needs: list[Need], node_policy: str,
        avoid_busy: bool, together: tuple[Need, ...] = (),
    ) -> None:
        self.index = index
        self.slots = slots
        self.needs = needs
        self.together = together
        self.survivors: list[int] = []
        self.checked = 0  # candidates checked against the per-card summaries so far
        # positions of the survivors (ints and arrays, as checked): a mask only when the pruned
        # are asked for (`_passed_mask`), not 20,000 flags zeroed per call
        self._passed: list[int | np.ndarray] = []
        self._head: list[int] = []  # positions of a walked head not checked yet
        self._keys: np.ndarray | None = None  # (a fresh list's: sign × score by position)
        kept = index._column_cache.kept.get(id(slots))
        if kept is None or kept.slots is not slots or node_policy not in kept.orders:
            # A list seen for the first time (kube-scheduler's rotating window): its values
            # read straight from the index where the walk gets to, nothing kept for it. A
            # list seen again gets its kept order built between calls (`tidy_orders`: ~1-2 ms
            # at 10,000 candidates, no decision's), and walked fresh until then.
            if index.repeated(slots):
                index.want_order(slots, node_policy)
            self.snapshot: tuple[np.ndarray, ...] = ()
            bounds, plan = index.fresh_plans.of(index, needs, avoid_busy)
            possible = partial(_possible_at, bounds, needs, slots)
            sign = policy_sign(node_policy)
            # (in C where built: one pass over the list for the first candidates)
            native = plan.walk(slots, sign, possible) if plan is not None else None
            if native is not None:
                self._keys, self.busy = native.keys, native.busy
                self._pending = native
                return
            self._keys = sign * index.scores[slots]
            self.busy: np.ndarray | None = index.busy[slots] if avoid_busy else None
            self._pending = fresh_walk(self._keys, self.busy, possible)
            return
        columns = index._columns(slots)
        self.snapshot = columns.order(node_policy).snapshot(columns.arrays["scores"])
        # as it was when ordered (the policy order's)
        self.busy = columns.arrays["busy"].copy() if avoid_busy else None
        # (the bounds are read where the walk gets to, when it gets there: the head's first)
        self._pending = walk(self.snapshot, self.busy, partial(_possible, columns.arrays, needs))

    def advance(self) -> bool:
        """Check the next candidate of a head, or the next chunk; False when every candidate
        was checked."""
        if not self._head:
            positions = next(self._pending, None)
            if positions is None:
                return False
            if not isinstance(positions, list):
                self._check_chunk(np.asarray(positions, dtype=np.int64))
                return True
            self._head = positions[::-1]
        position = self._head.pop()
        slot = int(self.slots[position])
        if self.index.row_holds(slot, self.needs, self.together):
            self.survivors.append(slot)
            self._passed.append(position)
        self.checked += 1
        return True

    def _check_chunk(self, positions: np.ndarray) -> None:
        chunk = self.slots[positions]
        mask = self.index._mask(chunk, self.needs, self.together)
        if mask.any():
            self.survivors.extend(chunk[mask].tolist())
            self._passed.append(positions[mask])
        self.checked += len(positions)

    def pruned(self) -> np.ndarray:
        """Every candidate that is not a survivor, in policy order (ordered here, in full: only
        a refusal or the side-effect-free path asks, and they fit every one of them anyway)."""
        while self.advance():
            pass
        busy = self.busy if self.busy is not None and self.busy.any() else None
        if self._keys is not None:  # (no busy candidate: one stable sort, not a lexsort)
            order = fresh_order(self._keys, busy)
        else:
            order = full_order(self.snapshot, busy)
        return self.slots[order[~self._passed_mask()[order]]]

    def _passed_mask(self) -> np.ndarray:
        """By position: whether it is a survivor."""
        passed = np.zeros(len(self.slots), dtype=bool)
        for positions in self._passed:
            passed[positions] = True
        return passed

    def views(self) -> tuple[Ordered, Pruned]:
        return Ordered(self), Pruned(self)


class Ordered:
    """The surviving slots, best first (iterable more than once; checked as iterated)."""

    def __init__(self, ordering: _Ordering) -> None:
        self._ordering = ordering

    def __iter__(self) -> Iterator[int]:
        ordering, i = self._ordering, 0
        survivors = ordering.survivors
        while True:
            while i < len(survivors):
                yield survivors[i]
                i += 1
            if not ordering.advance():
                return

    def __len__(self) -> int:
        while self._ordering.advance():
            pass
        return len(self._ordering.survivors)


class Pruned:
    """The slots the summaries refused, in policy order (known once every chunk was checked)."""

    def __init__(self, ordering: _Ordering) -> None:
        self._ordering = ordering
        self._slots: np.ndarray | None = None

    def array(self) -> np.ndarray:
        """The slots, as an array (int64)."""
        if self._slots is None:
            self._slots = self._ordering.pruned()
        return self._slots

    def unordered(self) -> np.ndarray:
        """The same slots in the caller's order (no policy sort: a refusal words them all and
        kube-scheduler reads failedNodes as a map)."""
        if self._slots is not None:
            return self._slots
        ordering = self._ordering
        while ordering.advance():
            pass
        return ordering.slots[~ordering._passed_mask()]

    _all = array

    def __iter__(self) -> Iterator[int]:
        return iter(self.array().tolist())

    def __len__(self) -> int:
        return len(self._all())


class ClusterIndex:
    """Nodes, their cards with usage, and which node holds each pod's allocation."""

    def __init__(self, global_cordon: frozenset[str] = frozenset()) -> None:
        self.entries: dict[str, NodeEntry] = {}
        self.by_slot: list[NodeEntry | None] = []
        self.free_slots: list[int] = []
        self.pod_nodes: dict[str, str] = {}  # pod uid -> node, for every active allocation
        self.pod_uids: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid, the same pods
        self.sweepable: set[str] = set()  # nodes with a reservation or a claim in their ledger
        self._deferred: set[str] | None = None  # nodes to rebuild at flush_rebuilds
        self.global_cordon = global_cordon
        # node -> foreign.ForeignNode: what HAMi's pods hold there (kept by foreign.py).
        self.foreign: dict[str, Any] = {}
        # node -> foreign.ForeignNode with only HAMi's registrations to say (nothing held or
        # blocked, not worded on its own: ForeignNode.special), for `foreign_note`
        self.hami_registered: dict[str, Any] = {}
        self.topology_version = 0
        self._candidates: dict[object, tuple[int, np.ndarray, list[str]]] = {}
        # id of a cached candidate array -> how many calls resolved to it (`repeated`)
        self._resolved: dict[int, int] = {}
        self.native_addresses = Addresses()  # (of the arrays a walk in C reads: native_walk.py)
        self.fresh_plans = _FreshPlans()  # (what a fresh list's walk is given, per shape)
        # name -> slot of every registered node (what `resolve` looks names up in), kept as
        # nodes register, go and are forgotten (never rebuilt per call)
        self.slot_of: dict[str, int] = {}
        self._name_table: tuple[int, NameTable] | None = None  # (topology version, table)
        # (candidate slots, node policy) seen again: kept orders to build between calls
        self._wanted: list[tuple[np.ndarray, str]] = []
        self._changed: dict[str, asyncio.Event] = {}
        # One row per node, one column per card: what each card can still give (-1 = a card
        # that takes no pod: unhealthy, cordoned, out of slots, MIG, or no card at all).
        capacity = _GROW
        self.free_gpus = np.full(capacity, -1, dtype=np.int32)
        self.card_mem = np.full((capacity, _WIDTH), -1, dtype=np.int64)
        self.card_pct = np.full((capacity, _WIDTH), -1, dtype=np.int16)
        self.card_cores = np.full((capacity, _WIDTH), -1, dtype=np.int32)
        self.card_computing = np.zeros((capacity, _WIDTH), dtype=bool)
        self.card_idle = np.zeros((capacity, _WIDTH), dtype=bool)
        self.scores = np.zeros(capacity, dtype=np.float64)
        # A bind is in flight on the node (claim held or a reservation not yet bound).
        self.busy = np.zeros(capacity, dtype=bool)
        # Per card that takes pods, its static class (`refusal_shapes`; -1 past the row's
        # cards), and per node the signature of its cards that take none (-1: a node whose
        # refusals are never grouped): what a refusal is grouped by.
        self.card_classes = CardClasses()
        self.card_class = np.full((capacity, _WIDTH), -1, dtype=np.int32)
        self.unusable_sig = np.full(capacity, UNSHAREABLE, dtype=np.int64)
        # each row's cards and signature numbered (equal rows, one number): a refusal reads
        # each distinct row once (`refusal_states`)
        self.row_states = RowStates()
        # and its used slots (a pod of several containers: the first's pick, `refusal_shapes`)
        self.card_slots = np.full((capacity, _WIDTH), -1, dtype=np.int32)
        # The decision's copies of those values per recent candidate list (index order).
        self._column_cache = _ColumnCache()
        # slot -> (cards, request key, reason text, reason names) of the last refusal found
        # there (decide.Decision.explain_rest); valid while the node's cards are the same list
        # Per distinct request, the reason each node refused it for, valid while the node's row
        # is the one it was found on (`row_version`: advanced by every write of the row).
        self.refusal_memos = RefusalMemos()
        self.request_facts = RequestFacts()  # (what decisions derive from a request alone)
        self.row_version = np.zeros(capacity, dtype=np.int64)
        self._version_clock = 0
        # the row version at which some request's refusal was last remembered there (a slot
        # where it is not the current version has nothing to look up: `Decision.fits`)
        self.refused_at = np.full(capacity, -1, dtype=np.int64)
        self.names_at = np.full(capacity, None, dtype=object)  # slot -> node name

    # --- updates from the watches -----------------------------------------------------------
    def _entry(self, node: str) -> NodeEntry:
        entry = self.entries.get(node)
        if entry is None:
            slot = self.free_slots.pop() if self.free_slots else len(self.by_slot)
            if slot == len(self.by_slot):
                self.by_slot.append(None)
            if slot >= len(self.free_gpus):
                self._grow()
            entry = NodeEntry(node, slot)
            self.entries[node] = entry
            self.by_slot[slot] = entry
            self.names_at[slot] = node
        return entry

    _ARRAYS = ("free_gpus", "card_mem", "card_pct", "card_cores", "card_computing", "card_idle",
               "scores", "busy")  # fmt: skip

    def _rows_written(self, slots: list[int]) -> None:
        """These nodes' rows (and so their cards) were just written: the decision's kept
        columns patch them, and what was remembered of them (`refusal_memo`) no longer holds."""
        self._column_cache.log(slots)
        self._version_clock += 1
        self.row_version[slots] = self._version_clock

    def refusal_memo(self, key: str) -> RefusalMemo:
        """Reasons by slot for one request (`Decision.memo_key`), valid at `row_version`."""
        return self.refusal_memos.of(key, len(self.row_version))

    def _grow(self, rows: int = _GROW, columns: int = 0) -> None:
        for name in ("card_class", "unusable_sig", "card_slots"):
            old = getattr(self, name)
            shape = (len(old) + rows, *(s + columns for s in old.shape[1:]))
            new = np.full(shape, -1, dtype=old.dtype)
            new[tuple(slice(0, n) for n in old.shape)] = old
            setattr(self, name, new)
        if rows:
            for name in ("row_version", "names_at", "refused_at"):
                old = getattr(self, name)
                new = np.full(len(old) + rows, None if old.dtype == object else -1,
                              dtype=old.dtype)  # fmt: skip
                new[: len(old)] = old
                setattr(self, name, new)
        for name in self._ARRAYS:
            old = getattr(self, name)
            shape = (len(old) + rows, *(s + columns for s in old.shape[1:]))
            fill = False if old.dtype == bool else (0 if name == "scores" else -1)
            new = np.full(shape, fill, dtype=old.dtype)
            new[tuple(slice(0, n) for n in old.shape)] = old
            setattr(self, name, new)

    def set_registration(
        self, node: str, registration: NodeRegistration | RegistrationWire | None, now: float
    ) -> None:
        entry = self._entry(node)
        was = entry.schedulable
        before, entry.registered = entry.registered, registration
        if was != entry.schedulable:
            self.topology_version += 1
            if entry.schedulable:
                self.slot_of[node] = entry.slot
            else:
                self.slot_of.pop(node, None)
        if registration is not None and before is not None:
            if registration.devices is before.devices:
                return  # a heartbeat of the same registration: nothing to rebuild
            if registration.devices is entry._built_from:  # a heartbeat of the one built
                entry.registered = before.model_copy(  # type: ignore[union-attr]
                    update={"heartbeat_at": registration.heartbeat_at}
                )
                return
        entry._built_from = None
        self._rebuild(entry, now)

    def set_ledger(
        self, node: str, ledger: NodeLedger | LedgerWire | None, revision: int, now: float
    ) -> bool:
        """Apply a ledger value; older revisions than the one known are ignored."""
        entry = self._entry(node)
        if revision and revision <= entry.ledger_revision:
            return False
        old_allocations = entry.view.allocations if entry.view is not None else {}
        entry.view = ledger
        entry.ledger_revision = revision
        holding = type(ledger) is LedgerWire and ledger.holding  # all active, none reserved
        self._map_pods(node, old_allocations, ledger.allocations if ledger else {}, holding)
        if ledger is not None and (ledger.claims or ledger.claim is not None or (
            not holding and any(a.state == _RESERVED for a in ledger.allocations.values())
        )):  # fmt: skip
            self.sweepable.add(node)
        else:
            self.sweepable.discard(node)
        # Usage is kept per change (node_usage.py), so a claim, a bind or the agent's Allocate
        # that moves no capacity costs a recount of the changed allocations only.
        self._rebuild(entry, now)
        event = self._changed.pop(node, None)
        if event is not None:
            event.set()
        return True

    def _map_pods(
        self, node: str, old: dict[str, Any], new: dict[str, Any], all_active: bool = False
    ) -> None:
        """Keep pod uid -> node and (namespace, name) -> uid current. Allocations are
        copy-on-write, so one that is the same object as before changed nothing: a write that
        changes one pod costs O(pods on the node) identity checks, not dictionary updates.
        `all_active`: every allocation of `new` is known to be active."""
        if not old:  # a node's first value (start-up: every node): nothing to take back
            if all_active:
                self.pod_nodes.update(dict.fromkeys(new, node))
                self.pod_uids.update({(a.namespace, a.name): uid for uid, a in new.items()})
                return
            active = [(uid, a) for uid, a in new.items() if a.state in ACTIVE_STATES]
            self.pod_nodes.update(dict.fromkeys([uid for uid, _a in active], node))
            self.pod_uids.update({(a.namespace, a.name): uid for uid, a in active})
            return
        for uid, gone in old.items():
            now_there = new.get(uid)
            if now_there is gone or (now_there is not None and now_there.active):
                continue
            if self.pod_nodes.get(uid) == node:
                del self.pod_nodes[uid]
                if self.pod_uids.get((gone.namespace, gone.name)) == uid:
                    del self.pod_uids[(gone.namespace, gone.name)]
        for uid, allocation in new.items():
            if old.get(uid) is allocation or not allocation.active:
                continue
            self.pod_nodes[uid] = node
            self.pod_uids[(allocation.namespace, allocation.name)] = uid

    def sweep_candidates(self) -> list[NodeEntry]:
        """Nodes whose ledger holds a reservation or a claim: the only ones a sweep can change
        (the sweeper visits these, not every node, every second)."""
        return [self.entries[n] for n in self.sweepable if n in self.entries]

    def set_cordon(self, node: str, uuids: frozenset[str], now: float) -> None:
        entry = self._entry(node)
        if entry.cordoned != uuids:
            entry.cordoned = uuids
            self._rebuild(entry, now)

    def refresh(self, node: str, now: float) -> None:
        entry = self.entries.get(node)
        if entry is not None:
            self._rebuild(entry, now)

    def cordon_of(self, entry: NodeEntry) -> frozenset[str]:
        return entry.cordoned | self.global_cordon if self.global_cordon else entry.cordoned

    def defer_rebuilds(self) -> None:
        """Until `flush_rebuilds`, node rows are rebuilt once at the end instead of on every
        update (start-up: a node's registration and its ledger arrive separately, and the
        summaries are not read before the scheduler is ready)."""
        if self._deferred is None:
            self._deferred = set()

    def flush_rebuilds(self, now: float) -> None:
        deferred, self._deferred = self._deferred, None
        rows: list[tuple] = []
        batch: list[tuple] = []  # rows built together (bulk_rows.py)
        for name in deferred or ():
            entry = self.entries.get(name)
            if entry is not None:
                row = self._summarise(entry, now, remember=False, batch=batch)
                if row is not None:
                    rows.append(row)
        if rows:
            self._write_rows(rows)  # one assignment per array for every node
        if batch:
            self._write_batch(batch)

    def _write_batch(self, batch: list[tuple]) -> None:
        """The rows of (entry, devices, usage map, busy) nodes, built together."""
        entries, devices, usages, busy = zip(*batch, strict=True)
        built = rows_of(list(devices), list(usages))
        widest = int(built.free_gpus.max())
        if widest > self.card_mem.shape[1]:
            self._grow(0, widest - self.card_mem.shape[1])
        slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
        for name in ("card_mem", "card_pct", "card_cores"):
            getattr(self, name)[slots] = -1
        self.card_computing[slots] = False
        self.card_idle[slots] = False
        at = (slots[built.node], built.column)
        self.card_mem[at] = built.memory
        self.card_pct[at] = built.percentage
        self.card_cores[at] = built.cores
        self.card_computing[at] = built.computing
        self.card_idle[at] = built.idle
        self.free_gpus[slots] = built.free_gpus
        self.scores[slots] = built.scores
        self.busy[slots] = busy
        for entry, score in zip(entries, built.scores.tolist(), strict=True):
            entry.score = score
        shape = self.card_classes.shape
        no_cordon: frozenset[str] = frozenset()
        for entry, device_list, usage in zip(entries, devices, usages, strict=True):
            entry._shape = shape(device_list, usage, no_cordon, bool(entry.blocked))
        self._write_shapes(slots.tolist())
        self._grow_bounds()
        self._rows_written(slots.tolist())
        self._bounds_of(slots, built.free_gpus)

    def _rebuild(self, entry: NodeEntry, now: float) -> None:
        if self._deferred is not None and (entry.registered is not None or entry.view):
            self._deferred.add(entry.name)
            return
        row = self._summarise(entry, now)
        if row is not None:
            self._write_rows([row])

    def _summarise(
        self, entry: NodeEntry, now: float, remember: bool = True, batch: list | None = None
    ) -> tuple | None:
        """The node's score and expiries set on the entry (its cards to be built when read),
        and its row of the arrays (slot, free GPUs, then per usable card: free memory, free %,
        free cores, computing, idle; score, busy); None when the node has no registration (its
        row is cleared). With `batch`, a node without cordoned or dynamic MIG cards nor HAMi's
        pods is appended to it as (entry, devices, usage map, busy) instead, its row and score
        to be built with the others' (`_write_batch`), and None is returned."""
        slot = entry.slot
        registered = entry.registered
        if registered is None:
            entry.cards = []
            self.free_gpus[slot] = -1
            self.unusable_sig[slot] = UNSHAREABLE
            self._rows_written([slot])  # cached candidate columns see the row go
            entry.reserved_until = None
            if entry.view is None:
                self._forget(entry)
            return None
        view = entry.view
        usages = self._usages(entry, now, remember)
        cordon = self.cordon_of(entry)
        devices = registered.devices
        if batch is None and self._kept_row(entry, devices, usages, cordon, now):
            return None
        entry._row = None
        # (a RegistrationWire's cards have no MIG capability: wire_fast keeps only those)
        if (type(registered) is not RegistrationWire and any(
            d.mig is not None and d.mig.model for d in devices
        )) or (devices and holds_partitions(devices[0].mode)):  # a node's devices share a kind
            # Dynamic MIG fits need the instances and libvgpu slices each card holds, not only
            # the amounts: counted from the models (MIG nodes are few; others skip this).
            entry._shape = None  # (MIG cards: refusals fitted node by node)
            row = self._row_of_cards(entry, self._mig_cards(entry, usages, cordon, now))
        else:
            entry._cards, entry._card_usage = None, (usages, cordon)
            if batch is not None and len(usages) == 1 and not cordon:
                row = None  # built with the batch's
            else:
                row = self._row_of_devices(entry, devices, usages, cordon)
                if len(usages) == 1:
                    entry._row = (devices, cordon, entry.usage.version, row)
        expiries = entry.usage.reservations.values()
        entry.reserved_until = min(expiries, default=None)
        claims = view.in_flight().values() if view is not None else ()
        busy = any(c.expires_at > now for c in claims) or any(e > now for e in expiries)
        if row is None:
            assert batch is not None
            batch.append((entry, devices, usages[0], busy))
            return None
        return (slot, *row, busy)

    def _kept_row(
        self, entry: NodeEntry, devices: Any, usages: list[dict[str, list[int]]],
        cordon: frozenset[str], now: float,
    ) -> bool:
        """Whether the node's row can stay as it is: built by `_row_of_devices` from these very
        devices, this cordon and the usage as it still is (`NodeUsage.version`: a claim, a bind
        or the agent's Allocate charge what they charged), and no HAMi pod on the node. Then
        only the expiries and whether a bind is in flight are brought up to date."""
        kept = entry._row
        if kept is None or kept[0] is not devices or kept[1] != cordon or (
            kept[2] != entry.usage.version or len(usages) != 1
        ):  # fmt: skip
            return False
        expiries = entry.usage.reservations.values()
        entry.reserved_until = min(expiries, default=None)
        view = entry.view
        claims = view.in_flight().values() if view is not None else ()
        busy = any(c.expires_at > now for c in claims) or any(e > now for e in expiries)
        slot = entry.slot
        if bool(self.busy[slot]) != busy:
            self.busy[slot] = busy
            self._column_cache.log([slot])
        return True

    def _row_of_devices(
        self, entry: NodeEntry, devices: list[Any], usages: list[dict[str, list[int]]],
        cordon: frozenset[str],
    ) -> tuple:
        """The row of a node without dynamic MIG cards, read off its devices and usage maps:
        exactly what `_row_of_cards` reads off the cards `cards_with_usage` builds from them
        (the cards themselves are built only when something reads them)."""
        usage = usages[0] if len(usages) == 1 else _summed(usages)
        split = cores = memory = used_slots = used_cores = used_mem = 0
        mem: list[int] = []
        pct: list[int] = []
        free_cores: list[int] = []
        computing: list[bool] = []
        idle: list[bool] = []
        for d in devices:
            used = usage.get(d.uuid)
            if used is None:
                u_mem = u_cores = u_slots = 0
            else:
                u_mem, u_cores, u_slots = used
            split += d.split_count
            cores += d.cores
            memory += d.memory_mib
            used_slots += u_slots
            used_cores += u_cores
            used_mem += u_mem
            if d.healthy and u_slots < d.split_count and d.mode.lower() != "mig" and (
                not cordon or d.uuid not in cordon
            ):
                total = d.memory_mib
                free = total - u_mem
                mem.append(free)
                if total > 0:  # free_percentage, inlined
                    pct.append(min((100 * (free + 1) - 1) // total, 32767))
                else:
                    pct.append(-1 if free < 0 else 32767)
                free_cores.append(d.cores - u_cores)
                computing.append(d.cores == 0 or d.cores > u_cores)
                idle.append(u_slots == 0)
        score = 0.0
        if devices:  # node_score, term for term
            if split:
                score += used_slots / split
            if cores:
                score += used_cores / cores
            if memory:
                score += used_mem / memory
            score *= 10.0
        entry.score = score
        entry._shape = self.card_classes.shape(
            devices, usage, cordon, bool(entry.blocked) or entry.name in self.foreign
        )
        return (-1 if entry.blocked else len(mem), mem, pct, free_cores, computing, idle, score)

    @staticmethod
    def _row_of_cards(entry: NodeEntry, cards: list[Card]) -> tuple:
        entry.cards = cards
        entry.score = node_score(cards)
        usable = [
            c for c in cards
            if c.healthy and not c.cordoned and c.used_slots < c.split_count
            and (c.mode.lower() != "mig" or bool(c.mig_model))  # dynamic MIG cards take pods
        ]  # fmt: skip
        return (
            -1 if entry.blocked else len(usable),
            [c.memory_mib - c.used_mem for c in usable],
            [free_percentage(c.memory_mib - c.used_mem, c.memory_mib) for c in usable],
            [c.cores - c.used_cores for c in usable],
            [c.cores == 0 or c.cores > c.used_cores for c in usable],
            [c.used_slots == 0 for c in usable],
            entry.score,
        )  # fmt: skip

    def _write_rows(self, rows: list[tuple]) -> None:
        widest = max(len(row[2]) for row in rows)
        if widest > self.card_mem.shape[1]:
            self._grow(0, widest - self.card_mem.shape[1])
        width = self.card_mem.shape[1]
        padded = []
        for slot, free, mem, pct, cores, computing, idle, score, busy in rows:
            pad = width - len(mem)
            padded.append((
                slot, free, mem + [-1] * pad, pct + [-1] * pad, cores + [-1] * pad,
                computing + [False] * pad, idle + [False] * pad, score, busy,
            ))  # fmt: skip
        if len(padded) == 1:
            slot, free, mem, pct, cores, computing, idle, score, busy = padded[0]
            self.free_gpus[slot] = free
            self.card_mem[slot] = mem
            self.card_pct[slot] = pct
            self.card_cores[slot] = cores
            self.card_computing[slot] = computing
            self.card_idle[slot] = idle
            self.scores[slot] = score
            self.busy[slot] = busy
            self._write_shapes([slot])
            self._write_bounds(rows)
            return
        columns = list(zip(*padded, strict=True))
        slots = np.asarray(columns[0], dtype=np.int64)
        for name, values in zip(self._ARRAYS, columns[1:], strict=True):
            array = getattr(self, name)
            array[slots] = np.asarray(values, dtype=array.dtype)
        self._write_shapes(columns[0])
        self._write_bounds(rows)

    def _write_shapes(self, slots: Sequence[int]) -> None:
        """The card classes and signature (`NodeEntry._shape`) of rows just written."""
        width = self.card_class.shape[1]
        by_slot, card_class, signature = self.by_slot, self.card_class, self.unusable_sig
        card_slots = self.card_slots
        for slot in slots:
            entry = by_slot[slot]
            shape = entry._shape if entry is not None else None
            if shape is None:
                card_class[slot] = -1
                signature[slot] = UNSHAREABLE
                continue
            classes, sig, used = shape
            pad = [-1] * (width - len(classes))
            card_class[slot] = classes + pad
            card_slots[slot] = used + pad
            signature[slot] = sig

    def _usages(self, entry: NodeEntry, now: float, remember: bool) -> list[dict[str, list[int]]]:
        """What the node's ledger holds per GPU (kept up to date from each change:
        node_usage.py), plus what HAMi's pods hold there; sets `entry.blocked`."""
        view = entry.view
        counted = view.take_usage() if type(view) is LedgerWire else None
        if counted is not None and not remember:  # counted as it was read (start-up)
            entry.usage.counted_as(counted, now)
        else:
            entry.usage.update(view.allocations if view is not None else {}, now, remember)
        usages = [entry.usage.usage]
        foreign = self.foreign.get(entry.name)
        entry.blocked = ""
        if foreign is not None:
            held: dict[str, list[int]] = {}
            for allocation in foreign.held(entry.registered):
                if counts_against_capacity(allocation, now):
                    add_charges(held, charges(allocation))
            usages.append(held)
            entry.blocked = foreign.blocking(entry.registered)
        return usages

    def _mig_cards(
        self, entry: NodeEntry, usages: list[dict[str, list[int]]], cordon: frozenset[str],
        now: float,
    ) -> list[Card]:
        assert entry.registered is not None
        cards = cards_with_usage(entry.registered, usages, cordon)  # type: ignore[arg-type]
        held = list(entry.ledger.allocations.values()) if entry.ledger is not None else []
        foreign = self.foreign.get(entry.name)
        if foreign is not None:
            held.extend(foreign.held(entry.registered))
        hold_grants(cards, held, now)
        return cards

    def foreign_allocations(self, node: str) -> tuple[Any, ...]:
        foreign = self.foreign.get(node)
        if foreign is None:
            return ()
        entry = self.entries.get(node)
        return foreign.held(entry.registered if entry is not None else None)

    def foreign_note(self, node: str) -> str:
        """What a refusal of `node` adds about HAMi's registration and pods there."""
        foreign = self.foreign.get(node) or self.hami_registered.get(node)
        if foreign is None:
            return ""
        entry = self.entries.get(node)
        return foreign.note(entry.registration if entry is not None else None)

    def _forget(self, entry: NodeEntry) -> None:
        del self.entries[entry.name]
        self.slot_of.pop(entry.name, None)
        self.refusal_memos.forget(entry.slot)
        self.row_states.forget(entry.slot)
        self.names_at[entry.slot] = None
        self.by_slot[entry.slot] = None
        self.free_slots.append(entry.slot)
        self.topology_version += 1

    # --- queries ------------------------------------------------------------------------------
    def node(self, name: str) -> NodeEntry | None:
        entry = self.entries.get(name)
        return entry if entry is not None and entry.schedulable else None

    def resolve(self, names: list[str]) -> tuple[np.ndarray, list[str]]:
        """Slots of the registered candidates (cached per list) and the unknown names.

        A list not seen before (kube-scheduler's windows rotate every cycle) is looked up in
        `slot_of` name by name at C speed (`map`), O(names) with no other per-name work."""
        token = getattr(names, "token", 0)  # api.NodeNames: a list whose content is known
        key: object = ("token", token) if token else tuple(names)
        cached = self._candidates.get(key)
        if cached is not None and cached[0] == self.topology_version:
            array = cached[1]
            self._resolved[id(array)] = self._resolved.get(id(array), 0) + 1
            return array, cached[2]
        slot_of = self.slot_of
        unknown: list[str] = []
        resolved = getattr(names, "resolved", None)  # read from the body's bytes (NameTable)
        if resolved is not None and resolved[0] == self.topology_version:
            array = resolved[1]
        else:
            array = None
        try:
            if array is None:
                array = np.fromiter(map(slot_of.__getitem__, names), dtype=np.int64,
                                    count=len(names))  # fmt: skip
        except KeyError:  # some names are not registered nodes: the slow way
            slots: list[int] = []
            for name in names:
                slot = slot_of.get(name)
                if slot is None:
                    unknown.append(name)
                else:
                    slots.append(slot)
            array = np.asarray(slots, dtype=np.int64)
        stale = self._candidates.pop(key, None)
        if stale is not None:
            self._resolved.pop(id(stale[1]), None)
        if len(self._candidates) >= _CANDIDATE_CACHE:
            evicted = self._candidates.pop(next(iter(self._candidates)))
            self._resolved.pop(id(evicted[1]), None)
        self._candidates[key] = (self.topology_version, array, unknown)
        self._resolved[id(array)] = 1
        return array, unknown

    def names_from_bytes(self, array: bytes) -> tuple[NodeNames, tuple[int, np.ndarray]] | None:
        """A `nodenames` JSON array resolved from its bytes (`name_table.NameTable`): the names
        (the index's own strings) and (topology version, slots); None when it cannot be."""
        version, table = self.name_table()
        # (a run of the node order, or a few runs: its order with some nodes left out)
        order = table.order
        run = order.runs(array) if order is not None and not order.resting() else None
        if order is not None:
            order.looked(run is not None)
        if run is not None:
            return NodeNames.of_rows(table.names, run[0]), (version, run[1])
        found = table.rows_and_slots(array)  # (native where built: one pass in C)
        if found is None:
            return None
        # (the names are gathered from the table's snapshot when first read: a placed pod's
        # call reads only the slots)
        return NodeNames.of_rows(table.names, found[0]), (version, found[1])

    def names_in_body(self, body: bytes, start: int
                      ) -> tuple[NodeNames, tuple[int, np.ndarray], int] | None:  # fmt: skip
        """`names_from_bytes` for the array at `body[start]`, read in place by the native
        resolver (`NameTable.slots_in`: no copy, no search for its end; its slots only, the
        names gathered when first read): (names, (topology version, slots), where the array
        ends). None while every list is looked at as runs of the node order (`NameOrder.eager`:
        `names_from_bytes` then looks first) and where the resolver cannot read it. A list due
        a look (one in `RUN_TRIES`, `NameOrder.resting`) is looked at once read (its first names,
        `NameOrder.starts_with_runs`): runs, the next lists are looked at first again (the cheap
        path of lists in the node order)."""
        version, table = self.name_table()
        order = table.order
        if order is not None and order.eager():
            return None
        found = table.slots_in(body, start)
        if found is None:
            return None
        slots, end = found
        if order is not None:
            order.looked(not order.resting() and order.starts_with_runs(body, start, end))
        return NodeNames.of_slots(table.names, table.row_of_slot, slots), (version, slots), end

    def names_of_run(self, array: bytes) -> tuple[NodeNames, tuple[int, np.ndarray]] | None:
        """`names_from_bytes` for an array that is a run of kube-scheduler's node order as the
        name table guesses it (`name_table.NameOrder`: one memcmp); None for any other."""
        version, table = self.name_table()
        order = table.order
        run = order.run(array) if order is not None and not order.resting() else None
        if run is None:  # (`names_from_bytes` then counts the look)
            return None
        order.looked(True)  # type: ignore[union-attr]
        return NodeNames.of_rows(table.names, run[0]), (version, run[1])

    def name_table(self) -> tuple[int, NameTable]:
        """The current topology's name table (topology version, table), built when first
        needed after a change."""
        table = self._name_table
        if table is None or table[0] != self.topology_version:
            names = list(self.slot_of)
            table = self._name_table = (
                self.topology_version, NameTable(names, [self.slot_of[n] for n in names])
            )
        return table

    def name_rows(self, slots: np.ndarray) -> tuple[NameTable, np.ndarray] | None:
        """These slots' rows in the current topology's name table (its names as JSON object
        keys, `NameTable.keys`, for a refusal's reply); None when the table is not that
        topology's (never built here: a refusal does not pay for it)."""
        table = self._name_table
        if table is None or table[0] != self.topology_version or table[1].keys is None:
            return None
        of_slot = table[1].row_of_slot
        if len(slots) and int(slots.max()) >= len(of_slot):
            return None
        rows = of_slot[slots]
        if len(rows) and int(rows.min()) < 0:
            return None
        return table[1], rows

    def repeated(self, slots: np.ndarray) -> bool:
        """Whether this candidate array was resolved for more than one call (a list
        kube-scheduler sends again: worth keeping its order between calls, `_Columns`)."""
        return self._resolved.get(id(slots), 0) > 1 or id(slots) in self._column_cache.kept

    def order(
        self, slots: np.ndarray, needs: list[Need], node_policy: str, avoid_busy: bool = True,
        together: tuple[Need, ...] = (),
    ) -> tuple[Ordered, Pruned]:
        """(survivors in policy order, pruned slots): cheap necessary conditions only.

        Per container, count the cards that could take it on memory, %, cores and exclusivity
        together (vectorised over candidates × cards); a node needs as many as the container
        asks. `together` (`Need.together`): the app containers placed at once, which must also
        fit the cards together (`card_summaries.joint_mask`). Type, UUID, NUMA and quota rules
        are left to the per-GPU fit.

        With `avoid_busy`, nodes with a bind in flight go after the others (the node policy
        orders each group), so a burst is not serialised on one node's claim.

        Lazy: a call usually stops at the first node that fits, so the candidates are walked
        and checked a chunk at a time, best first, from the list's kept order
        (candidate_order.py), and the pruned ones are only known once every chunk was checked."""
        return _Ordering(self, slots, needs, node_policy, avoid_busy, together).views()

    def row_holds(self, slot: int, needs: list[Need], together: tuple[Need, ...] = ()) -> bool:
        """`_mask` for one node, read in Python (cheaper than a dozen numpy calls on one row)."""
        free = int(self.free_gpus[slot])
        if free < 0:
            return False
        row = (self.card_mem[slot].tolist(), self.card_pct[slot].tolist(),
               self.card_cores[slot].tolist(), self.card_computing[slot].tolist(),
               self.card_idle[slot].tolist())  # fmt: skip
        return row_holds(*row, needs) and (not together or row_joint(*row, together))

    def _mask(
        self, slots: np.ndarray, needs: list[Need], together: tuple[Need, ...] = (),
        distinct: bool = True,
    ) -> np.ndarray:
        """The candidates whose per-card summaries can hold the pod (card_summaries.py); a
        large chunk reads each distinct row once (`refusal_states`: a refusal's walk checks
        every candidate)."""
        if distinct and len(slots) >= _DISTINCT_CHUNK:
            found = self.row_states.distinct(self, slots)
            if found is not None:
                rows, of_row = found
                return self._mask(slots[rows], needs, together, False)[of_row]
        cards = Cards(self, slots)
        mask = summary_mask(cards, self.free_gpus[slots], needs)
        if together and mask.any():
            mask &= joint_mask(cards, together)
        return mask

    # --- per-node bounds: the decision's pre-filter ------------------------------------------
    # One value per node, derived from its row of the per-card arrays whenever the row is
    # written (`_write_rows` calls `_write_bounds`): the most free memory, %, cores any usable
    # card has, and how many usable cards still compute / are idle. Every container's demand
    # implies bounds a node must reach (`_possible`): a cheap gather over every candidate
    # rules out the nodes that are full for this pod before anything is ordered or checked
    # card by card (binpack puts the fullest nodes first, and most of them are full).
    _BOUNDS = (("bound_cores", np.int32), ("bound_computing", np.int16),
               ("bound_idle", np.int16))  # fmt: skip
    bound_cores = bound_computing = bound_idle = np.zeros(0, np.int16)
    # Per rung of free cores (`cores_rung`) and node: the most free memory (and %) among the
    # node's usable cards on that rung. A card with much memory but no cores left and one with cores
    # but little memory no longer make a node look like it could take a container asking both.
    # (Rung-major: a decision compares one rung's row over every candidate.)
    bound_mem_at = np.zeros((_RUNGS, 0), np.int64)
    bound_pct_at = np.zeros((_RUNGS, 0), np.int16)
    # Per k of `_KTH` and node: the k-th most free memory among its computing cards (rung 0's).
    bound_mem_kth = np.zeros((len(_KTH), 0), np.int64)

    def _grow_bounds(self) -> None:
        """As many rows as the other arrays (a row never written: -1, as its other arrays)."""
        capacity = len(self.free_gpus)
        if self.bound_mem_at.shape[1] < capacity or self.bound_mem_kth.shape[1] < capacity:
            for name, dtype in self._BOUNDS:
                old = getattr(self, name)
                new = np.full(capacity, -1, dtype=dtype)
                new[: len(old)] = old
                setattr(self, name, new)
            for name in ("bound_mem_at", "bound_pct_at", "bound_mem_kth"):
                old = getattr(self, name)
                new = np.full((old.shape[0], capacity), -1, dtype=old.dtype)
                new[:, : old.shape[1]] = old
                setattr(self, name, new)

    def want_order(self, slots: np.ndarray, policy: str) -> None:
        """Build this list's kept order under the policy at the next `tidy_orders`."""
        if len(self._wanted) < _CANDIDATE_CACHE:
            self._wanted.append((slots, policy))

    def tidy_orders(self) -> int:
        """Between calls: merge the recent lists' kept policy orders that need it (more than
        `PolicyOrder.REBUILD` changed positions), so that the next decision does not (a merge is
        ~0.2 ms at 5,000 candidates, a decision's p99 otherwise). The service calls it once a
        decision has answered (`filtering`); a decision still merges if these fell behind.
        How many orders were merged."""
        wanted, self._wanted = self._wanted, []
        for slots, policy in wanted:
            if self._resolved.get(id(slots)):  # (still a list of the candidate cache)
                self._columns(slots).order(policy)
        return sum(columns.tidy() for columns in self._column_cache.kept.values())

    def _columns(self, slots: np.ndarray) -> _Columns:
        """The decision's values of these candidates (`_Columns`, one per recent list)."""
        self._grow_bounds()
        return self._column_cache.columns(self, slots)

    def mark_busy(self, slot: int) -> None:
        """A bind is in flight on the node at `slot` (filters look elsewhere first)."""
        self.busy[slot] = True
        self._column_cache.log([int(slot)])

    def _write_bounds(self, rows: list[tuple]) -> None:
        """The bounds of the rows `_write_rows` just wrote (its unpadded row tuples)."""
        self._grow_bounds()
        self._rows_written([row[0] for row in rows])
        if len(rows) == 1:
            slot, _free, mem, pct, cores, computing, idle, _score, _busy = rows[0]
            self.bound_mem_at[:, slot], self.bound_pct_at[:, slot] = rungs_of(
                mem, pct, cores, computing
            )
            self.bound_mem_kth[:, slot] = kth_most_memory(mem, computing)
            self.bound_cores[slot] = max(cores, default=-1)
            self.bound_computing[slot] = sum(computing)
            self.bound_idle[slot] = sum(idle)
            return
        slots = np.asarray([row[0] for row in rows], dtype=np.int64)
        self._bounds_of(slots, np.asarray([len(row[2]) for row in rows], dtype=np.int64))

    def _bounds_of(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        """The bounds of rows just written, each `lengths` usable cards long."""
        # The largest over the row's own cards, as above (a card given more than it has is
        # negative; the padding's -1 is not one of its cards), -1 for a row without cards.
        cards = np.arange(self.card_mem.shape[1]) < lengths[:, None]
        empty = lengths == 0
        for name, values in (("bound_cores", self.card_cores),):
            values = values[slots]
            bound = np.where(cards, values, np.iinfo(values.dtype).min).max(axis=1)
            bound[empty] = -1
            getattr(self, name)[slots] = bound
        computing = self.card_computing[slots] & cards
        self.bound_computing[slots] = np.count_nonzero(computing, axis=1)
        self.bound_idle[slots] = np.count_nonzero(self.card_idle[slots], axis=1)
        # rungs_of, vectorised: a card is on the rungs up to its own (none if it no
        # longer computes); -1 where no card is.
        memory, percentage = self.card_mem[slots], self.card_pct[slots]
        # kth_most_memory, vectorised (the padding's -1 sorts below every computing card's
        # value clamped at -1)
        ranked = -np.sort(-np.where(computing, np.maximum(memory, -1), -1), axis=1)
        for at, k in enumerate(_KTH):
            self.bound_mem_kth[at, slots] = ranked[:, k - 1] if k <= ranked.shape[1] else -1
        top = np.where(computing, np.clip(self.card_cores[slots] // 10, 0, _RUNGS - 1), -1)
        for rung in range(_RUNGS):
            on = top >= rung
            self.bound_mem_at[rung, slots] = np.where(on, memory, -1).max(axis=1, initial=-1)
            self.bound_pct_at[rung, slots] = np.where(on, percentage, -1).max(axis=1, initial=-1)

    def pod_uid(self, namespace: str, name: str) -> str | None:
        """The uid of the pod with an active allocation under that name, if any."""
        return self.pod_uids.get((namespace, name))

    def entry_at(self, slot: int) -> NodeEntry:
        entry = self.by_slot[int(slot)]
        assert entry is not None
        return entry

    def claims_held(self, now: float) -> int:
        return sum(
            1 for e in self.entries.values() if e.view is not None
            for c in e.view.in_flight().values() if c.expires_at > now
        )  # fmt: skip

    def notify(self, node: str) -> None:
        """Wake whoever waits for the node's entry to change (a waiting bind left its queue)."""
        event = self._changed.pop(node, None)
        if event is not None:
            event.set()

    async def wait_changed(self, node: str, timeout: float) -> None:
        """Return when the node's ledger entry next changes, or after `timeout` seconds."""
        event = self._changed.setdefault(node, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout))
