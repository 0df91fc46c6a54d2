"""The placement decision over the index: which node, which cards, and why the others failed.

Pure (reads the index, writes nothing). The same code serves filter, the side-effect-free
`nodes` path, prioritize, the benchmark and what-if questions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tessera.hami import PodRequest

from .index import ClusterIndex, NodeEntry
from .node_reasons import NodeReasons
from .placement import PodFit, fit_pod
from .refusal_fast import refused_at_once, refused_rest_at_once
from .refusal_memo import FITS, RefusalMemo
from .refusal_shapes import first_step, group
from .rules import NODE_UNREGISTERED, FitContext, PodOptions, QuotaBudget

_BULK = 16  # candidates left from which remembered refusals are looked up vectorised
_SHAPES = 1 << 16  # shapes remembered per request before its shapes start over
_TAKES_FIRST = -2  # a shape that takes a pod's first container: its nodes fitted one by one
# A walk of a list of at least `_AT_ONCE` candidates that checked `_AT_ONCE_CHECKED` against
# the summaries (a placed pod of bench/decision_lockstep.py's trace checks at most ~80), or
# worded a run of known refusals to its end, without a fit, checks every candidate at once
# (`refusal_fast.refused_rest_at_once`); 128, not 256: a first refusal stops its walk a
# doubling round earlier (bench/RESULTS.md "refuse5": the 5,000-node full list's refused p99
# 2.40 -> 2.11 ms, placed pods alike)
_AT_ONCE, _AT_ONCE_CHECKED = 1024, 128


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
    failed: NodeReasons = field(default_factory=NodeReasons)  # kube-scheduler's failedNodes
    reason_counts: Counter[str] = field(default_factory=Counter)
    _key: str | None = None
    _memo: RefusalMemo | None = None
    _step: object = False  # (`first_step`, once asked: False = not asked yet)
    # every candidate worded at once (`refusal_fast.refused_rest_at_once`): None = not tried
    _at_once: bool | None = None

    def context(self) -> FitContext:
        return FitContext(self.options, QuotaBudget(self.budget.memory_mib, self.budget.cores))

    def fits(self) -> Iterator[tuple[NodeEntry, PodFit]]:
        """Nodes where the pod fits, best first; failures are recorded as they are met.

        A node whose per-GPU fit refused this very request on its row as it is (the same
        `ClusterIndex.refusal_memo` `explain_rest` keeps; any write of the node's row makes it
        stale) is not fitted again: the next pod of a workload skips the nodes its predecessor
        was refused on until they change."""
        index = self.index
        row_version, refused_at = index.row_version, index.refused_at
        ordering = getattr(self.slots, "_ordering", None)  # index.Ordered: its survivors
        if ordering is None:  # (a plain sequence of slots)
            survivors, more = list(self.slots), None  # type: ignore[call-overload]
        else:
            survivors, more = ordering.survivors, ordering.advance
        i = 0
        known: np.ndarray | None = None  # remembered refusals of survivors[known_from:]
        known_from = 0
        bulk = False  # the last nodes were worded in bulk: likely refused everywhere
        while True:
            if i >= len(survivors):
                if more is not None and self._at_once is None and (
                    bulk or ordering.checked >= _AT_ONCE_CHECKED
                ) and len(ordering.slots) >= _AT_ONCE:  # fmt: skip
                    # (far without a fit: refused everywhere? then nothing left to walk)
                    self._at_once = refused_rest_at_once(self)
                    if self._at_once:
                        return
                if more is None or not more():
                    return
                if bulk:  # read on until the candidates left double (O(log n) bulk reads)
                    while len(survivors) < 2 * i and more():
                        pass
                continue
            if i and (known is None or i >= known_from + len(known)):
                # (not before the first survivor was fitted on its own: a placed pod fits
                # there most often, and grouping the candidates (`refusal_shapes.group`) then
                # cost an 8-GPU binpack pod that ~100 survivors of its first chunk reached it
                # 0.15-0.35 ms of its call, bench/RESULTS.md "fresh2")
                known_from, known = i, self._known(survivors[i:])
            if known is not None:
                # A run of nodes whose refusal is known (on their rows as they are, or for
                # their shape): worded in bulk.
                run = known[i - known_from :] > FITS
                stop = int(np.argmin(run)) if not run.all() else len(run)
                bulk = stop == len(run)
                if stop:
                    self._record_ids(np.asarray(survivors[i : i + stop], dtype=np.int64),
                                     known[i - known_from : i - known_from + stop])
                    i += stop
                    continue
            slot = survivors[i]
            i += 1
            bulk = False
            entry = index.entry_at(slot)
            version = int(row_version[slot])
            if refused_at[slot] == version and not entry.blocked:
                # (refused at this row for some request: this one's memo, if it has one yet,
                # is asked; none is made to ask it)
                memo = self._memo or index.refusal_memos.peek(self.memo_key())
                found = memo.get(slot, version) if memo is not None else None
                if found:  # (FITS, 0, is never remembered by a fit that stopped there)
                    assert memo is not None
                    self.memo()  # (its recency, as when it was asked)
                    self.failed.add(entry.name, memo.texts[found] + index.foreign_note(entry.name))  # type: ignore[operator]
                    self.reason_counts.update(memo.names[found])
                    continue
            fit = fit_pod(entry.cards, self.request, self.context())
            if fit.ok:
                yield entry, fit
                known = None  # (the index may have moved meanwhile)
            else:
                self.record(entry.name, fit)
                if not entry.blocked and entry.name not in index.foreign:
                    self.memo().put(slot, version, fit.reason_text(), tuple(fit.reasons.keys()))
                    refused_at[slot] = version

    def memo(self) -> RefusalMemo:
        """This request's refusal memo (`ClusterIndex.refusal_memo`)."""
        if self._memo is None:
            self._memo = self.index.refusal_memo(self.memo_key())
        return self._memo

    def _known(self, slots: list[int]) -> np.ndarray | None:
        """The reason id of each of these candidates (more than a head's worth) whose refusal
        of this request is known, -1 elsewhere: remembered at its current row (and no HAMi
        pods: worded one by one), or for its shape (`_by_shape`, which fits one node of each
        shape not known yet, in this order, until one fits)."""
        if len(slots) < _BULK:
            return None
        index = self.index
        array = np.asarray(slots, dtype=np.int64)
        versions = index.row_version[array]
        known = index.refused_at[array] == versions
        ids = np.full(len(array), -1, dtype=np.int64)
        if known.any():
            memo = self.memo()
            known &= (memo.stamp[array] == versions) & (memo.reason[array] != FITS)
            if index.foreign:
                known &= ~np.isin(array, [index.slot_of.get(n, -1) for n in index.foreign])
            ids[known] = memo.reason[array[known]]
        unknown = np.flatnonzero(ids < 0)
        shaped = self._by_shape(array[unknown], stop_at_fit=True)
        if shaped is not None:
            ids[unknown] = shaped
        return ids

    def _by_shape(self, slots: np.ndarray, stop_at_fit: bool) -> np.ndarray | None:
        """Each candidate's reason id read from its shape (`refusal_shapes`), -1 where it is
        not grouped; None when the request's refusals are not grouped. A shape the request's
        memo does not know yet is fitted on its first candidate here (in the candidates'
        order); with `stop_at_fit`, no shape after the first that fits is fitted (the walk
        then fits its nodes in order, as it would have)."""
        step = self._step
        if step is False:
            step = self._step = first_step(self.request, self.options, self.budget)
        if step is None or not len(slots):
            return None
        container, alone = step  # type: ignore[misc]
        index = self.index
        groups, keys, first = group(index, slots, container)
        memo = self.memo()
        if len(memo.shapes) > _SHAPES:
            memo.shapes.clear()
        shapes = memo.shapes
        ids = np.full(len(keys), -1, dtype=np.int64)
        firsts = first.tolist()
        classes = index.card_classes
        # (shapes another request was refused by alike: their texts, not fitted again)
        shared_texts = None if alone is not None else classes.shared_texts(container)
        for g in np.argsort(first).tolist() if stop_at_fit else range(len(keys)):
            at = firsts[g]
            if groups[at] != g:
                continue  # (not grouped: worded node by node)
            key = keys[g]
            found = shapes.get(key)
            if found is None:
                shared = None if shared_texts is None else classes.shared_key(container, key)
                if shared is not None and shared in shared_texts:  # type: ignore[operator]
                    text = shared_texts[shared]  # type: ignore[index]
                    found = FITS if text is None else memo.intern(*text)
                else:
                    fit = fit_pod(index.entry_at(int(slots[at])).cards, alone or self.request,
                                  self.context())  # fmt: skip
                    worded = None if fit.ok else (fit.reason_text(), tuple(fit.reasons.keys()))
                    if worded is None:
                        found = FITS if alone is None else _TAKES_FIRST
                    else:
                        found = memo.intern(*worded)
                    if shared is not None:
                        shared_texts[shared] = worded  # type: ignore[index]
                shapes[key] = found
            if found == _TAKES_FIRST:
                continue  # (fitted one by one: the pod may still not fit there)
            ids[g] = found
            if found == FITS and stop_at_fit:
                break
        found = np.where(groups >= 0, ids[groups], -1)
        # remembered per node too (at its row as it is): a node met again one by one (the
        # walk's head) reads it there instead of being fitted
        known = np.flatnonzero(found >= 0)
        if len(known):
            at = slots[known]
            versions = index.row_version[at]
            memo.stamp[at] = versions
            memo.reason[at] = found[known]
            index.refused_at[at] = versions
        return found

    def _record_ids(self, slots: np.ndarray, found: np.ndarray) -> None:
        """Word these nodes' known refusals (their reason ids, in this order), as `record`
        would."""
        memo = self.memo()
        rows = self.index.name_rows(slots)  # (the names then read from its table if asked)
        self.failed.add_bulk(None if rows else self.index.names_at[slots], found,
                             memo.text_array(), memo.names, rows)
        counts = np.bincount(found)
        for reason_id in np.flatnonzero(counts).tolist():
            nodes = int(counts[reason_id])
            for name in memo.names[reason_id]:
                self.reason_counts[name] += nodes

    def memo_key(self) -> str:
        """What a node's refusal depends on besides its cards (`ClusterIndex.refusal_memo`)."""
        if self._key is None:  # (the request's `repr`, kept per request and options object)
            self._key = self.index.request_facts.memo_key(
                self.request, self.options, self.budget.memory_mib, self.budget.cores)
        return self._key

    def record(self, node: str, fit: PodFit) -> None:
        """A node the pod does not fit (not worded before in this call)."""
        self.failed.add(node, fit.reason_text() + self.index.foreign_note(node))
        self.reason_counts.update(fit.reasons.keys())

    def explain_rest(self) -> None:
        """Exact HAMi reasons for the nodes the summaries pruned and the unknown names (only
        needed when the pod is refused, or for the side-effect-free path).

        A refused pod comes back: kube-scheduler retries it with backoff, and every retry asks
        for every node's reason (O(nodes) fits: a fifth of a second at 5,000 nodes). Each
        node's reason for the request is remembered at its row version (`refusal_memo.py`):
        only the nodes written since are fitted again, the others' reasons are gathered by
        slot (vectorised: O(nodes) with a constant of a few gathers, not a fit per node), so
        the reasons stay exact and cost O(changed nodes) of per-GPU work. Nodes with HAMi's
        pods (`ClusterIndex.foreign`: blocked, or a note about what HAMi holds there) are
        worded one by one as before."""
        index = self.index
        if self._at_once:  # (every candidate and unknown name worded: `fits`)
            index.refusal_memos.mark_refused(self.memo(), self.request)
            return
        pruned = self.pruned
        slots = (pruned.unordered() if hasattr(pruned, "unordered")  # (index.Pruned)
                 else np.asarray(list(pruned), dtype=np.int64))  # type: ignore[call-overload]
        if len(slots):
            memo = self.memo()
            versions = index.row_version[slots]
            foreign = [index.slot_of.get(name, -1) for name in index.foreign]
            special = np.isin(slots, foreign) if foreign else None
            stale = memo.stamp[slots] != versions
            if special is not None:
                stale &= ~special
            shaped = None
            if stale.any():  # (those remembered at their row are read as they are)
                at = np.flatnonzero(stale)
                by_shape = self._by_shape(slots[at], stop_at_fit=False)
                if by_shape is not None:
                    shaped = np.full(len(slots), -1, dtype=np.int64)
                    shaped[at] = by_shape
                    stale &= shaped < 0  # (read from their shape)
            for slot, version in zip(slots[stale].tolist(), versions[stale].tolist(),
                                     strict=True):  # fmt: skip
                fit = fit_pod(index.entry_at(slot).cards, self.request, self.context())
                if fit.ok:  # the summaries are conservative; should not happen, but stay exact
                    memo.put(slot, version, None, ())
                else:
                    memo.put(slot, version, fit.reason_text(), tuple(fit.reasons.keys()))
            index.refused_at[slots[stale]] = versions[stale]
            found = memo.reason[slots]
            if shaped is not None:
                found = np.where(shaped >= 0, shaped, found)
            if special is None:  # (the names gathered now: a slot may hold another node later)
                rows = index.name_rows(slots)  # (the names then read from its table if asked)
                self.failed.add_bulk(None if rows else index.names_at[slots], found,
                                     memo.text_array(), memo.names, rows)
            else:  # HAMi's pods on some: worded one by one, in order
                texts = memo.text_array()[found].tolist()
                for position in np.flatnonzero(special).tolist():
                    texts[position] = self._special(int(slots[position]), memo)
                    found[position] = FITS  # (counted by `_special`)
                for name, text in zip(index.names_at[slots].tolist(), texts, strict=True):
                    if text is not None:
                        self.failed.add(name, text)
            counts = np.bincount(found)
            reason_counts = self.reason_counts
            for reason_id in np.flatnonzero(counts).tolist():
                if reason_id != FITS:
                    nodes = int(counts[reason_id])
                    for name in memo.names[reason_id]:
                        reason_counts[name] += nodes
        # (its next call is first checked at once: `refusal_fast`; a hint, proven there)
        self.index.refusal_memos.mark_refused(self.memo(), self.request)
        for name in self.unknown:
            self.failed.add(name, f"{NODE_UNREGISTERED}: no Tessera node agent registered this node"
                            + index.foreign_note(name))
            self.reason_counts[NODE_UNREGISTERED] += 1

    def _special(self, slot: int, memo: RefusalMemo) -> str | None:
        """A node with HAMi's pods, worded (and counted) on its own: its refusal text, or None
        when it fits."""
        entry = self.index.entry_at(slot)
        if entry.blocked:  # HAMi's holdings there are unknown (foreign.py)
            self.reason_counts[entry.blocked.partition(":")[0]] += 1
            return entry.blocked
        fit = fit_pod(entry.cards, self.request, self.context())
        if fit.ok:
            return None
        self.reason_counts.update(fit.reasons.keys())
        return fit.reason_text() + self.index.foreign_note(entry.name)


def decide(
    index: ClusterIndex,
    request: PodRequest,
    options: PodOptions,
    names: list[str],
    budget: QuotaBudget | None = None,
    avoid_busy: bool = True,
) -> Decision:
    slots, unknown = index.resolve(names)
    budget = budget or QuotaBudget()
    facts = index.request_facts.of(request)  # (needs and sketch, kept per request object)
    if index.refusal_memos.maybe_refused(facts.sketch):  # (refused everywhere last time?)
        at_once = Decision(index, request, options, budget, (), (), [])
        if refused_at_once(at_once, slots, unknown):
            return at_once
        key = at_once._key
    else:
        key = None
    ordered, pruned = index.order(slots, facts.needs, options.node_policy, avoid_busy,
                                  facts.together)  # fmt: skip
    return Decision(index, request, options, budget, ordered, pruned, unknown, _key=key)


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
