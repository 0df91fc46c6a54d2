"""How kube-scheduler calls a `nodeCacheCapable` extender, for the benchmarks.

kube-scheduler does not send every node: its own filters stop once they found
`numFeasibleNodesToFind` feasible nodes (`percentageOfNodesToScore`; 0, the default, is adaptive:
max(5, 50 - nodes / 125) % of the nodes, at least 100 nodes; every node below 100 nodes or at
100 %), starting at `nextStartNodeIndex`, which advances by the nodes it processed each cycle
(mod the node count). So the extender gets a different list on almost every call. The
extender's managed GPU resources are `ignoredByScheduler`, so every node of the bench cluster is
feasible to kube-scheduler unless a label pool (a nodeSelector) restricts it: the window is then
the pool's members met from the start index on, and the start advances past every node visited.
kube-scheduler checks nodes in parallel (`findNodesThatPassFilters`: `Parallelizer().Until`, 16
workers by default, each taking the next chunk of min(sqrt(n), n/16 + 1) consecutive nodes from a
channel when done with its own, `workqueue.ParallelizeUntil`), and each node that passes is
appended (an atomic counter) as its worker finishes it, so the list's order is the workers'
interleaving, not the node list's: each chunk's nodes in order, the chunks merged in whatever
order the goroutines' timing gives (no fixed stride: it differs every cycle). `order`
(`BENCH_ORDER`): `sequential` (default: the node list's order, as kube-scheduler writes it when
one worker at a time runs, e.g. on one CPU) or `parallel` (16 workers whose every node check
takes a random time, 0.5-1.5 units, seeded: the goroutines' nondeterministic merge on a
many-core host).

A pod the extender refuses is retried with kube-scheduler's backoff: 1 s
(`podInitialBackoffSeconds`), doubling per attempt, at most 10 s (`podMaxBackoffSeconds`).

Modes (`BENCH_LISTS`): `window` (default: the rotating adaptive window), `same` (every call
the same full list, byte for byte: the best case the extender's caches were built for),
`full` (every node, a fresh list each call: the start rotated by one window each cycle, as
when feasibility changes). `refused` (`BENCH_REFUSED`, 0): nodes kube-scheduler's own filters
refuse each cycle, drawn at random."""

from __future__ import annotations

import heapq
import math
import os
import random
from collections.abc import Sequence

MIN_FEASIBLE = 100  # minFeasibleNodesToFind
MIN_PERCENTAGE = 5  # minFeasibleNodesPercentageToFind
BASE_PERCENTAGE = 50  # basePercentageOfNodesToScore
BACKOFF_INITIAL_S = 1.0  # podInitialBackoffSeconds
BACKOFF_MAX_S = 10.0  # podMaxBackoffSeconds
MODES = ("window", "same", "full")
ORDERS = ("sequential", "parallel")
WORKERS = 16  # kube-scheduler's default parallelism
# kube-scheduler's JSON (Go's encoding/json): no spaces between elements
COMPACT = (",", ":")


def extender_args(pod: bytes, names: bytes) -> bytes:
    """A nodeCacheCapable filter call's body as kube-scheduler writes it: `ExtenderArgs` has no
    JSON tags (upstream `kube-scheduler/extender/v1/types.go`), so Go writes its field names,
    the unused node list as null, compactly: `{"Pod":...,"Nodes":null,"NodeNames":[...]}`.
    `BENCH_KEYS=lower`: `{"pod": ..., "nodenames": ...}`, as kube-sim and these benchmarks
    wrote it before session 21 (the extender reads either; only the real form is what a
    cluster sends)."""
    if os.environ.get("BENCH_KEYS", "go") == "lower":
        return b'{"pod": %s, "nodenames": %s}' % (pod, names)
    return b'{"Pod":%s,"Nodes":null,"NodeNames":%s}' % (pod, names)


def nodes_to_find(total: int, percentage: int = 0) -> int:
    """kube-scheduler's `numFeasibleNodesToFind` (integer arithmetic, as in Go)."""
    if total < MIN_FEASIBLE or percentage >= 100:
        return total
    adaptive = percentage if percentage > 0 else max(MIN_PERCENTAGE, BASE_PERCENTAGE - total // 125)
    return max(MIN_FEASIBLE, total * adaptive // 100)


def backoff_s(attempts: int) -> float:
    """Seconds a pod refused `attempts` times (>= 1) waits before its next try."""
    return min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** (attempts - 1))


class KubeLists:
    """The candidate lists kube-scheduler would send, one per scheduling cycle."""

    def __init__(self, names: Sequence[str], mode: str = "window", percentage: int = 0,
                 find: int | None = None, order: str = "sequential", seed: int = 35,
                 refused: int = 0) -> None:
        """`find`: the window's size instead of kube-scheduler's `numFeasibleNodesToFind`
        (a bench of a given list size, e.g. 500 names at 20,000 nodes). `refused`: that many
        nodes, drawn anew each cycle, fail kube-scheduler's own filters (cordoned, not enough
        CPU for the pod, a taint): left out of the list wherever they fall."""
        if mode not in MODES:
            raise ValueError(f"unknown list mode {mode!r}: one of {', '.join(MODES)}")
        if order not in ORDERS:
            raise ValueError(f"unknown list order {order!r}: one of {', '.join(ORDERS)}")
        self.names = list(names)
        self.mode = mode
        self.order = order
        self.find = find or nodes_to_find(len(self.names), percentage)
        self.start = 0  # nextStartNodeIndex
        self.rng = random.Random(seed)  # the parallel workers' timing
        self.refused = refused
        self.refusals = random.Random(seed + 1)  # (apart: the workers' timing stays the same)

    def next(self, members: Sequence[str] | None = None) -> list[str]:
        """The next cycle's list. `members`: the nodes feasible to kube-scheduler (a label
        pool, in node-list order as a set or list), None: every node."""
        if self.refused:
            refused = set(self.refusals.sample(self.names, min(self.refused, len(self.names))))
            members = frozenset(n for n in (self.names if members is None else members)
                                if n not in refused)  # fmt: skip
        if self.order == "parallel" and self.mode != "same":
            return self._parallel(members)
        names, total = self.names, len(self.names)
        if self.mode == "same":
            return self.names if members is None else list(members)
        if self.mode == "full":
            start = self.start
            self.start = (self.start + nodes_to_find(total)) % total
            rotated = names[start:] + names[:start]
            if members is None:
                return rotated
            wanted = set(members)
            return [n for n in rotated if n in wanted]
        if members is None:
            out = [names[(self.start + i) % total] for i in range(min(self.find, total))]
            self.start = (self.start + len(out)) % total
            return out
        wanted = members if isinstance(members, (set, frozenset)) else set(members)
        out, visited = [], 0
        while visited < total and len(out) < self.find:
            name = names[(self.start + visited) % total]
            visited += 1
            if name in wanted:
                out.append(name)
        self.start = (self.start + visited) % total
        return out

    def _parallel(self, members: Sequence[str] | None) -> list[str]:
        """`next` as kube-scheduler's parallel filters write it: the nodes from the start index
        on, in the order `WORKERS` workers finish them (each checks its chunk of consecutive
        nodes in order, a random time per node, and takes the next chunk when done), stopping
        at the number to find (a full list: every node); the start advances by the nodes
        checked."""
        names, total = self.names, len(self.names)
        find = total if self.mode == "full" else min(self.find, total)
        wanted = (None if members is None
                  else members if isinstance(members, (set, frozenset)) else set(members))
        chunk = max(1, min(math.isqrt(total), total // WORKERS + 1))  # chunkSizeFor
        chunks = -(-total // chunk)
        uniform = self.rng.uniform
        # (time its current node is done, worker, next node, end of its chunk)
        working = [(uniform(0.5, 1.5), k, k * chunk, min(total, (k + 1) * chunk))
                   for k in range(min(WORKERS, chunks))]  # fmt: skip
        heapq.heapify(working)
        taken = len(working)
        out: list[str] = []
        checked = 0
        while working and len(out) < find:
            done, worker, at, end = heapq.heappop(working)
            name = names[(self.start + at) % total]
            checked += 1
            if wanted is None or name in wanted:
                out.append(name)
            at += 1
            if at >= end and taken < chunks:
                at, end = taken * chunk, min(total, (taken + 1) * chunk)
                taken += 1
            if at < end:
                heapq.heappush(working, (done + uniform(0.5, 1.5), worker, at, end))
        if self.mode == "full":
            self.start = (self.start + nodes_to_find(total)) % total
        else:
            self.start = (self.start + checked) % total
        return out
