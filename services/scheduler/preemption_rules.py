"""Preemption's vocabulary and its small pure rules: who may preempt whom, what a victim set
costs, and an optimistic card check in numpy (never stricter than `fit_pod`). No I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.hami import PodRequest
from tessera.models import Allocation, DeviceGrant, NodeRegistration

from .cards import allocation_usage, build_cards, counts_against_capacity
from .placement import PodFit, fit_pod
from .rules import FitContext, PodOptions, QuotaBudget

MAX_FIT_CHECKS = 2048  # per node: beyond this the exact search gives way to the greedy reprieve
MAX_VISITS = 20000  # per node: victim sets looked at (most are skipped by the optimistic check)
MAX_EXTRA_NODES = 16  # nodes searched exactly after the first set is found (then: exact=False)
NEVER = "Never"


def pod_priority(pod: dict[str, Any]) -> int:
    """The pod's preemption priority: `spec.priority` (0 when unset, as with no PriorityClass)."""
    spec = pod.get("spec") or {}
    value = spec.get("priority") if isinstance(spec, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def may_preempt(pod: dict[str, Any]) -> bool:
    """`preemptionPolicy: Never` pods wait for room; they never evict anyone."""
    spec = pod.get("spec") or {}
    return not (isinstance(spec, dict) and spec.get("preemptionPolicy") == NEVER)


@dataclass(frozen=True)
class DisruptionBudget:
    """A PodDisruptionBudget as preemption sees it: how many of its pods may still go."""

    name: str
    allowed: int
    pods: frozenset[str]  # uids of the pods it selects


@dataclass(frozen=True)
class NodeState:
    """One node as the ledger has it."""

    name: str
    registration: NodeRegistration
    allocations: Mapping[str, Allocation]
    cordoned: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PreemptionQuery:
    pod_uid: str
    request: PodRequest
    options: PodOptions
    priority: int
    priorities: Mapping[str, int]  # pod uid -> spec.priority; a pod not in it is never a victim
    budgets: Sequence[DisruptionBudget] = ()
    now: float = 0.0
    max_fit_checks: int = MAX_FIT_CHECKS
    max_visits: int = MAX_VISITS
    max_extra_nodes: int = MAX_EXTRA_NODES

    def context(self) -> FitContext:
        return FitContext(self.options, QuotaBudget())


@dataclass(frozen=True)
class VictimSet:
    node: str
    victims: tuple[Allocation, ...]
    violations: int
    max_priority: int
    memory_mib: int
    containers: list[list[DeviceGrant]] = field(compare=False)  # the pod's grants afterwards
    exact: bool = True

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.violations, len(self.victims), self.max_priority, self.memory_mib)

    def names(self) -> list[str]:
        return [f"{v.namespace}/{v.name}" for v in self.victims]


def evicted_memory(allocation: Allocation) -> int:
    """GPU memory (MiB) the allocation holds, summed over its cards."""
    return sum(u.memory_mib for u in allocation_usage(allocation).values())


def candidates(node: NodeState, query: PreemptionQuery) -> list[Allocation]:
    """Allocations that may be evicted for the pod: holding capacity, of a pod with a known
    priority strictly lower, and not already being evicted for another pod."""
    out = []
    for uid, a in node.allocations.items():
        if uid == query.pod_uid or not counts_against_capacity(a, query.now):
            continue
        priority = query.priorities.get(uid)
        if priority is None or priority >= query.priority:
            continue
        out.append(a)
    out.sort(key=lambda a: (query.priorities[a.pod_uid], evicted_memory(a), a.pod_uid))
    return out


def violations(victims: Iterable[Allocation], budgets: Sequence[DisruptionBudget]) -> int:
    uids = {v.pod_uid for v in victims}
    return sum(max(0, len(uids & b.pods) - max(b.allowed, 0)) for b in budgets)


def fit_without(node: NodeState, removed: set[str], query: PreemptionQuery) -> PodFit:
    """The pod's fit on the node's ledger minus `removed` (same code as the filter)."""
    kept = [a for uid, a in node.allocations.items() if uid not in removed]
    cards = build_cards(node.registration, kept, query.now, node.cordoned)
    return fit_pod(cards, query.request, query.context())


def optimistic_fit(
    free: np.ndarray, cap_mem: np.ndarray, card_ok: np.ndarray, request: PodRequest
) -> np.ndarray:
    """Per row: could every GPU container find enough cards on its own, counting only memory,
    cores and slots? `free` is [..., 3, G] (memory, cores, slots free after the evictions),
    `cap_mem` and `card_ok` broadcast against [..., G]. Looser than `fit_pod` (containers do not
    compete, no type/UUID/NUMA/exclusivity rules), so a False here means fit_pod says no too."""
    ok = np.ones(free.shape[:-2], bool)
    mem, cores, slots = free[..., 0, :], free[..., 1, :], free[..., 2, :]
    for c in request.all:
        if c is None:
            continue
        pct = c.memory_percentage
        need = cap_mem * pct // 100 if pct is not None else c.memory_mib
        good = card_ok & (mem >= need) & (cores >= c.cores) & (slots >= 1)
        ok &= good.sum(axis=-1) >= c.count
    return ok
