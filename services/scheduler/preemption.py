"""GPU-aware priority preemption: which pods to evict so a higher-priority pod fits. Pure, no I/O.

When a pod fits no node, each node is asked: which pods of strictly lower priority (the pod's
`spec.priority`, resolved from its PriorityClass; never HAMi's `nvidia.com/priority`, which is a
runtime compute priority) could go so that the pod fits under every HAMi rule? The fit is the very
same `fit_pod` the filter runs, on the node's ledger minus the victims. The cheapest set wins, by
the key (PDB violations, number of victims, highest victim priority, GPU memory evicted): a set
that violates a PodDisruptionBudget is used only when no other exists, as kube-scheduler does.

Two stages keep this cheap at thousands of nodes:
1. a vectorised lower bound of each node's best key (numpy over every candidate victim in the
   cluster, `preemption_view.bounds`); it never over-estimates.
2. the exact search on nodes in order of that bound, stopping as soon as no remaining node's
   bound can beat the best set found. Per node, sets are taken by increasing size; all sets of a
   size go through an optimistic numpy card check at once, and only the survivors, cheapest key
   first, through `fit_pod`: the first that fits is the node's best of that size.
The work is bounded: per node at most `MAX_VISITS` sets looked at and `MAX_FIT_CHECKS` fit
checks (beyond: kube-scheduler's greedy reprieve, remove every candidate and put back what still
lets the pod fit), and at most `MAX_EXTRA_NODES` nodes searched after the first set is found. A
result reached under a bound says so (`exact=False`); below the bounds it is the minimum.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from tessera.models import Allocation

from .placement import PodFit
from .preemption_rules import (
    DisruptionBudget,
    NodeState,
    PreemptionQuery,
    VictimSet,
    candidates,
    evicted_memory,
    fit_without,
    may_preempt,
    optimistic_fit,
    pod_priority,
    violations,
)
from .preemption_view import ClusterView, NodeBlock, bounds

__all__ = [
    "ClusterView", "DisruptionBudget", "NodeBlock", "NodeState", "PreemptionQuery", "VictimSet",
    "fit_without", "may_preempt", "node_victims", "pod_priority", "select_victims", "violations",
]  # fmt: skip


def node_victims(
    node: NodeState, query: PreemptionQuery, block: NodeBlock | None = None
) -> VictimSet | None:
    """The cheapest victim set on one node, or None when no allowed set makes the pod fit."""
    cands = candidates(node, query)
    if not cands or not fit_without(node, {a.pod_uid for a in cands}, query).ok:
        return None  # removing more never hurts a fit: if all cannot help, nothing can
    block = block or NodeBlock.of(node, query.now)
    at = {uid: i for i, uid in enumerate(block.uids)}
    usage = block.rows[[at[a.pod_uid] for a in cands]]  # [n, 3, G]
    prio = np.array([query.priorities[a.pod_uid] for a in cands], np.int64)
    memory = np.array([evicted_memory(a) for a in cands], np.int64)
    covered = [np.array([a.pod_uid in b.pods for a in cands]) for b in query.budgets]
    best: VictimSet | None = None
    checks = visits = 0
    for size in range(1, len(cands) + 1):
        if best is not None and best.violations == 0:
            break  # a larger set has a worse key
        combos = np.array(list(itertools.islice(
            itertools.combinations(range(len(cands)), size), query.max_visits - visits + 1,
        )), np.int64).reshape(-1, size)  # fmt: skip
        visits += len(combos)
        if visits > query.max_visits:
            return _bounded(node, cands, query, best)
        ok = optimistic_fit(block.free + usage[combos].sum(axis=1), block.cap_mem,
                            block.card_ok, query.request)  # fmt: skip
        combos = combos[ok]
        if not len(combos):
            continue
        viol = np.zeros(len(combos), np.int64)
        for b, member in zip(query.budgets, covered, strict=True):
            viol += np.maximum(0, member[combos].sum(axis=1) - max(b.allowed, 0))
        top, spent = prio[combos].max(axis=1), memory[combos].sum(axis=1)
        for j in np.lexsort((spent, top, viol)):
            key = (int(viol[j]), size, int(top[j]), int(spent[j]))
            if best is not None and key >= best.key:
                break  # sorted: the rest of this size is no better
            checks += 1
            if checks > query.max_fit_checks:
                return _bounded(node, cands, query, best)
            combo = [cands[i] for i in combos[j]]
            fit = fit_without(node, {a.pod_uid for a in combo}, query)
            if fit.ok:
                best = _victim_set(node, combo, fit, query, exact=True)
                break
    return best


def _victim_set(
    node: NodeState, combo: list[Allocation], fit: PodFit, query: PreemptionQuery, exact: bool
) -> VictimSet:
    ordered = tuple(sorted(combo, key=lambda a: a.pod_uid))
    return VictimSet(
        node=node.name, victims=ordered, violations=violations(ordered, query.budgets),
        max_priority=max(query.priorities[a.pod_uid] for a in ordered),
        memory_mib=sum(evicted_memory(a) for a in ordered), containers=fit.containers,
        exact=exact,
    )  # fmt: skip


def _bounded(
    node: NodeState, cands: list[Allocation], query: PreemptionQuery, best: VictimSet | None
) -> VictimSet:
    greedy = _greedy(node, cands, query)
    return greedy if best is None or greedy.key < best.key else replace(best, exact=False)


def _greedy(node: NodeState, cands: list[Allocation], query: PreemptionQuery) -> VictimSet:
    """kube-scheduler's reprieve: evict every candidate, then put back, most valuable first
    (PDB-protected, then highest priority, then most memory), each one that still lets it fit."""
    protected = {uid for b in query.budgets for uid in b.pods}
    order = sorted(
        cands,
        key=lambda a: (a.pod_uid not in protected, -query.priorities[a.pod_uid],
                       -evicted_memory(a)),
    )  # fmt: skip
    removed = {a.pod_uid for a in cands}
    for a in order:
        removed.discard(a.pod_uid)
        if not fit_without(node, removed, query).ok:
            removed.add(a.pod_uid)
    combo = [a for a in cands if a.pod_uid in removed]
    return _victim_set(node, combo, fit_without(node, removed, query), query, exact=False)


def select_victims(view: ClusterView, query: PreemptionQuery) -> VictimSet | None:
    """The node and victim set with the least key over the cluster (ties: the node met first in
    the bound's order)."""
    best: VictimSet | None = None
    extra = 0
    for bound, i in bounds(view, query):
        if best is not None and bound >= best.key:
            break
        if best is not None:
            extra += 1
            if extra > query.max_extra_nodes:  # bounded work: a node left unsearched could win
                return replace(best, exact=False)
        found = node_victims(view.nodes[i], query, view.blocks[i])
        if found is not None and (best is None or found.key < best.key):
            best = found
    return best
