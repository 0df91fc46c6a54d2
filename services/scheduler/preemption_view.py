"""The vectorised stage of victim selection: every node's cards and every allocation's usage per
card as numpy arrays, and a lower bound of each node's best victim-set key from them. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .cards import allocation_usage, build_cards, counts_against_capacity
from .preemption_rules import NodeState, PreemptionQuery, optimistic_fit

BIG = np.iinfo(np.int64).max

@dataclass(frozen=True)
class NodeBlock:
    """One node's rows of the view: free capacity per card and each active allocation's usage
    per card. Valid for one ledger revision until `valid_until` (the next expiry among its
    reservations and preemption marks), so a caller may keep it between attempts."""

    node: NodeState
    free: np.ndarray  # [3, G]: memory, cores, slots free now
    cap_mem: np.ndarray  # [G]
    card_ok: np.ndarray  # [G] healthy, not cordoned, not MIG
    rows: np.ndarray  # [R, 3, G] usage of each allocation that holds capacity
    uids: tuple[str, ...]
    valid_until: float

    @classmethod
    def of(cls, node: NodeState, now: float) -> NodeBlock:
        cards = build_cards(node.registration, node.allocations.values(), now, node.cordoned)
        width = len(cards)
        column = {c.uuid: j for j, c in enumerate(cards)}
        free = np.array([[c.free_mem for c in cards], [c.free_cores for c in cards],
                         [c.split_count - c.used_slots for c in cards]], np.int32).reshape(3, width)
        cap = np.array([c.memory_mib for c in cards], np.int32)
        ok = np.array([c.healthy and not c.cordoned and c.mode.lower() != "mig" for c in cards],
                      bool)  # fmt: skip
        rows, uids, expiries = [], [], []
        for uid, a in node.allocations.items():
            for t in (a.expires_at, a.preempted_until):
                if t is not None and t > now:
                    expiries.append(t)
            if not counts_against_capacity(a, now):
                continue
            row = np.zeros((3, width), np.int32)
            for uuid, u in allocation_usage(a).items():
                j = column.get(uuid)
                if j is not None:
                    row[:, j] = (u.memory_mib, u.cores, u.slots)
            rows.append(row)
            uids.append(uid)
        stacked = np.stack(rows) if rows else np.zeros((0, 3, width), np.int32)
        return cls(node, free, cap, ok, stacked, tuple(uids), min(expiries, default=math.inf))


@dataclass
class ClusterView:
    """Every node's cards and every allocation's usage per card, as arrays."""

    nodes: list[NodeState]
    blocks: list[NodeBlock]
    free: np.ndarray  # [N, 3, G] memory, cores, slots free now (marked victims count as gone)
    cap_mem: np.ndarray  # [N, G]
    card_ok: np.ndarray  # [N, G] healthy, not cordoned, not MIG, exists
    row_node: np.ndarray  # [R] node of each allocation holding capacity
    rows: np.ndarray  # [R, 3, G] its usage per card
    row_total: np.ndarray  # [R] MiB it holds
    row_uid: list[str]
    # The rows' priorities for one priority map (kept while the caller passes the same map).
    _prio: tuple[Mapping[str, int], np.ndarray] | None = None
    _row_of: dict[str, int] | None = None

    def priorities(self, query: PreemptionQuery) -> np.ndarray:
        """Each row's pod priority (BIG: unknown, so never a victim; the preemptor itself too)."""
        if self._prio is None or self._prio[0] is not query.priorities:
            prio = np.fromiter((query.priorities.get(u, BIG) for u in self.row_uid), np.int64,
                               len(self.row_uid))  # fmt: skip
            self._prio = (query.priorities, prio)
        prio = self._prio[1]
        if query.pod_uid in query.priorities:
            if self._row_of is None:
                self._row_of = {uid: i for i, uid in enumerate(self.row_uid)}
            own = self._row_of.get(query.pod_uid)
            if own is not None:
                prio = prio.copy()
                prio[own] = BIG
        return prio

    _after: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    _prefix: tuple[Mapping[str, int], tuple[np.ndarray, ...]] | None = None

    def after_each(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row: its node's free capacity if that row alone went, the card sizes, card ok
        (independent of the query: computed once per view)."""
        if self._after is None:
            n = self.row_node
            self._after = (self.free[n] + self.rows, self.cap_mem[n], self.card_ok[n])
        return self._after

    def prefix(self, query: PreemptionQuery) -> tuple[np.ndarray, ...]:
        """Rows ordered by (node, priority, memory), and per row its node's free capacity if it
        and every row before it on the node went (once per view and priority map)."""
        if self._prefix is None or self._prefix[0] is not query.priorities:
            prio = self.priorities(query)
            order = np.lexsort((self.row_total, prio, self.row_node))
            nodes = self.row_node[order]
            running = np.cumsum(self.rows[order], axis=0)
            starts = np.searchsorted(nodes, nodes, side="left")
            before = running[np.maximum(starts - 1, 0)] * (starts > 0)[:, None, None]
            free = self.free[nodes] + running - before
            self._prefix = (query.priorities, (
                prio[order], nodes, free, self.cap_mem[nodes], self.card_ok[nodes]))  # fmt: skip
        return self._prefix[1]

    @classmethod
    def build(cls, nodes: Sequence[NodeState], now: float) -> ClusterView:
        return cls.of_blocks([NodeBlock.of(n, now) for n in nodes])

    @classmethod
    def of_blocks(cls, blocks: Sequence[NodeBlock]) -> ClusterView:
        width = max((b.cap_mem.shape[0] for b in blocks), default=1) or 1
        n = len(blocks)
        free = np.zeros((n, 3, width), np.int32)
        cap = np.zeros((n, width), np.int32)
        ok = np.zeros((n, width), bool)
        total = sum(b.rows.shape[0] for b in blocks)
        rows = np.zeros((total, 3, width), np.int32)
        row_node = np.zeros(total, np.int64)
        uids: list[str] = []
        at = 0
        for i, b in enumerate(blocks):
            g = b.cap_mem.shape[0]
            free[i, :, :g], cap[i, :g], ok[i, :g] = b.free, b.cap_mem, b.card_ok
            r = b.rows.shape[0]
            rows[at : at + r, :, :g] = b.rows
            row_node[at : at + r] = i
            uids.extend(b.uids)
            at += r
        return cls([b.node for b in blocks], list(blocks), free, cap, ok, row_node, rows,
                   rows[:, 0].sum(axis=1, dtype=np.int64), uids)  # fmt: skip


Key = tuple[int, int, int, int]


def bounds(view: ClusterView, query: PreemptionQuery) -> Iterator[tuple[Key, int]]:
    """(lower bound of the node's best key, node position) for every node where some allowed set
    might make the pod fit, best first. Never above the exact key, because the card check is
    optimistic and removing more allocations never hurts a fit:
    - one victim enough (optimistically)? then (0, 1, its priority, its memory), least first;
    - else (0, 2, p, 0), p the least priority such that evicting every candidate of priority
      <= p fits optimistically (any working set has a highest priority at least p).
    The second kind is computed only if the caller asks past the first (lazily)."""
    if not view.row_uid:
        return
    prio = view.priorities(query)
    allowed = prio < query.priority
    if not allowed.any():
        return
    free, cap, ok = view.after_each()
    single = np.nonzero(optimistic_fit(free, cap, ok, query.request) & allowed)[0]
    order = single[np.lexsort((view.row_node[single], view.row_total[single], prio[single]))]
    _, first = np.unique(view.row_node[order], return_index=True)
    firsts = order[np.sort(first)]
    for k in firsts:
        yield (0, 1, int(prio[k]), int(view.row_total[k])), int(view.row_node[k])
    # Nodes with no single victim: evict by increasing priority until it could fit.
    s_prio, s_nodes, s_free, s_cap, s_ok = view.prefix(query)
    has_single = np.zeros(view.free.shape[0], bool)
    has_single[view.row_node[firsts]] = True
    hits = optimistic_fit(s_free, s_cap, s_ok, query.request) & (s_prio < query.priority)
    hits = np.nonzero(hits & ~has_single[s_nodes])[0]
    _, first = np.unique(s_nodes[hits], return_index=True)
    firsts = hits[first]
    for k in firsts[np.lexsort((s_nodes[firsts], s_prio[firsts]))]:
        yield (0, 2, int(s_prio[k]), 0), int(s_nodes[k])
