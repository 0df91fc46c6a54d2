"""The vectorised stage of victim selection: every node's cards and every allocation's usage per
card as numpy arrays, and a lower bound of each node's best victim-set key from them. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
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
    _prio: tuple[int, np.ndarray] | None = None
    _row_of: dict[str, int] | None = None

    def priorities(self, query: PreemptionQuery) -> np.ndarray:
        """Each row's pod priority (BIG: unknown, so never a victim; the preemptor itself too)."""
        if self._prio is None or self._prio[0] != id(query.priorities):
            prio = np.fromiter((query.priorities.get(u, BIG) for u in self.row_uid), np.int64,
                               len(self.row_uid))  # fmt: skip
            self._prio = (id(query.priorities), prio)
        prio = self._prio[1]
        if query.pod_uid in query.priorities:
            if self._row_of is None:
                self._row_of = {uid: i for i, uid in enumerate(self.row_uid)}
            own = self._row_of.get(query.pod_uid)
            if own is not None:
                prio = prio.copy()
                prio[own] = BIG
        return prio

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
    rows = np.nonzero(prio < query.priority)[0]
    if rows.size == 0:
        return
    nodes, p, total = view.row_node[rows], prio[rows], view.row_total[rows]
    order = np.lexsort((total, p, nodes))
    rows, nodes, p, total = rows[order], nodes[order], p[order], total[order]
    usage = view.rows[rows]  # [R, 3, G]
    single = optimistic_fit(view.free[nodes] + usage, view.cap_mem[nodes], view.card_ok[nodes],
                            query.request)  # fmt: skip
    hits = np.nonzero(single)[0]
    _, first = np.unique(nodes[hits], return_index=True)
    firsts = hits[first]
    ranked = np.lexsort((nodes[firsts], total[firsts], p[firsts]))
    for k in firsts[ranked]:
        yield (0, 1, int(p[k]), int(total[k])), int(nodes[k])
    # Nodes with no single victim: evict by increasing priority until it could fit.
    rest = ~np.isin(nodes, nodes[firsts])
    rows, nodes, p, usage = rows[rest], nodes[rest], p[rest], usage[rest]
    if rows.size == 0:
        return
    running = np.cumsum(usage, axis=0)
    starts = np.searchsorted(nodes, nodes, side="left")
    before = running[np.maximum(starts - 1, 0)] * (starts > 0)[:, None, None]
    prefix = optimistic_fit(view.free[nodes] + running - before, view.cap_mem[nodes],
                            view.card_ok[nodes], query.request)  # fmt: skip
    hits = np.nonzero(prefix)[0]
    _, first = np.unique(nodes[hits], return_index=True)
    firsts = hits[first]
    for k in firsts[np.lexsort((nodes[firsts], p[firsts]))]:
        yield (0, 2, int(p[k]), 0), int(nodes[k])
