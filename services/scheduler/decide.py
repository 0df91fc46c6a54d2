"""The placement decision over the index: which node, which cards, and why the others failed.

Pure (reads the index, writes nothing). The same code serves filter, the side-effect-free
`nodes` path, prioritize, the benchmark and what-if questions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from tessera.hami import PodRequest

from .index import ClusterIndex, Need, NodeEntry
from .placement import PodFit, fit_pod
from .rules import NODE_UNREGISTERED, FitContext, PodOptions, QuotaBudget


@dataclass
class Decision:
    """Fitting nodes in preference order (lazily), and the reasons of the nodes that failed."""

    index: ClusterIndex
    request: PodRequest
    options: PodOptions
    budget: QuotaBudget
    slots: object  # numpy array of candidate slots in policy order
    pruned: object  # numpy array of slots refused by the cheap summaries
    unknown: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    reason_counts: Counter[str] = field(default_factory=Counter)

    def context(self) -> FitContext:
        return FitContext(self.options, QuotaBudget(self.budget.memory_mib, self.budget.cores))

    def fits(self) -> Iterator[tuple[NodeEntry, PodFit]]:
        """Nodes where the pod fits, best first; failures are recorded as they are met.

        A node whose per-GPU fit refused this very request on these very cards (the same
        `ClusterIndex.refusals` memo `explain_rest` keeps: the node's cards are a new list after
        any change to its row) is not fitted again: the next pod of a workload skips the nodes
        its predecessor was refused on until they change."""
        memo, key = self.index.refusals, None
        for slot in self.slots:  # type: ignore[attr-defined]
            entry = self.index.entry_at(slot)
            cards = entry.cards
            known = memo.get(slot)
            if known is not None and known[0] is cards:
                if key is None:
                    key = self.memo_key()
                if known[1] == key:
                    self.failed[entry.name] = known[2] + self.index.foreign_note(entry.name)
                    self.reason_counts.update(known[3])
                    continue
            fit = fit_pod(cards, self.request, self.context())
            if fit.ok:
                yield entry, fit
            else:
                self.record(entry.name, fit)
                if not entry.blocked:
                    if key is None:
                        key = self.memo_key()
                    memo[slot] = (cards, key, fit.reason_text(), tuple(fit.reasons.keys()))

    def memo_key(self) -> str:
        """What a node's refusal depends on besides its cards (`ClusterIndex.refusals`)."""
        return repr((self.request, self.options, self.budget.memory_mib, self.budget.cores))

    def record(self, node: str, fit: PodFit) -> None:
        self.failed[node] = fit.reason_text() + self.index.foreign_note(node)
        self.reason_counts.update(fit.reasons.keys())

    def explain_rest(self) -> None:
        """Exact HAMi reasons for the nodes the summaries pruned and the unknown names (only
        needed when the pod is refused, or for the side-effect-free path).

        A refused pod comes back: kube-scheduler retries it with backoff, and every retry asks
        for every node's reason (O(nodes) fits: a fifth of a second at 5,000 nodes). A node's
        reason for the same request is remembered with the cards it was found on
        (`ClusterIndex.refusals`); a node whose cards were rebuilt since (any change to its
        row) is fitted again, so the reasons stay exact and cost O(changed nodes)."""
        memo = self.index.refusals
        key = self.memo_key()
        for slot in self.pruned:  # type: ignore[attr-defined]
            entry = self.index.entry_at(slot)
            if entry.blocked:  # HAMi's holdings there are unknown (foreign.py)
                self.failed[entry.name] = entry.blocked
                self.reason_counts[entry.blocked.partition(":")[0]] += 1
                continue
            cards = entry.cards
            known = memo.get(int(slot))
            if known is not None and known[0] is cards and known[1] == key:
                text, reasons = known[2], known[3]
            else:
                fit = fit_pod(cards, self.request, self.context())
                if fit.ok:  # the summaries are conservative; should not happen, but stay exact
                    continue
                text, reasons = fit.reason_text(), tuple(fit.reasons.keys())
                memo[int(slot)] = (cards, key, text, reasons)
            self.failed[entry.name] = text + self.index.foreign_note(entry.name)
            self.reason_counts.update(reasons)
        for name in self.unknown:
            self.failed[name] = (f"{NODE_UNREGISTERED}: no Tessera node agent registered this node"
                                 + self.index.foreign_note(name))
            self.reason_counts[NODE_UNREGISTERED] += 1


def decide(
    index: ClusterIndex,
    request: PodRequest,
    options: PodOptions,
    names: list[str],
    budget: QuotaBudget | None = None,
    avoid_busy: bool = True,
) -> Decision:
    slots, unknown = index.resolve(names)
    ordered, pruned = index.order(
        slots, Need.of(request), options.node_policy, avoid_busy, Need.together(request)
    )
    return Decision(index, request, options, budget or QuotaBudget(), ordered, pruned, unknown)


def prioritize_scores(index: ClusterIndex, options: PodOptions, names: list[str]) -> list[int]:
    """0-10 per node from HAMi's node score (0-30) under the node policy."""
    scores = []
    for name in names:
        entry = index.node(name)
        if entry is None:
            scores.append(0)
            continue
        fullness = min(10, round(entry.score / 3))
        scores.append(fullness if options.node_policy == "binpack" else 10 - fullness)
    return scores
