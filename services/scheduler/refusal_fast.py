"""A retry of a request refused everywhere, answered without walking the candidates (pure).

kube-scheduler retries a pod it could not place after its backoff, with a new list (a
rotating window, or every node from another start). The walk (`decide.Decision.fits`) looks
for the best node that fits: it orders the candidates, reads their bounds round by round and
only then, for a refused pod, words every node's reason (`Decision.explain_rest`). For a
request refused on its last call that work is wasted when every candidate still refuses it,
and on a full 5,000-node list it is most of a retry (ordering rounds, bounds chunks, the
pruned set's order: 1-5 ms on a loaded machine).

So a request whose last call refused it (`RefusalMemo.refused`, set by `explain_rest`) is
first checked at once, in the caller's order: every candidate's reason read from the
request's memo where it was found at the node's row as it is, else from its shape
(`Decision._by_shape`, fitting one node per shape not known yet), else, for the few left
(nodes where a pod of several containers takes the first: `refusal_shapes.first_step`),
fitted node by node and remembered. If any candidate fits (or is a node with HAMi's pods,
worded apart), nothing is worded and the decision walks as before: the reasons and the
placement are always the walk's (`tests/scheduler/test_refusal_fast.py`). Otherwise every
candidate is worded in bulk and the decision walks nothing: a retry costs a few gathers over
the list plus the shapes and nodes that changed since the last call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .placement import fit_pod
from .refusal_memo import FITS
from .rules import NODE_UNREGISTERED

# nodes fitted one by one at most before the check gives up (the walk then decides): a pod of
# several containers whose first fits many nodes, all changed since its last call
_ONE_BY_ONE = 256


def refused_at_once(decision: Any, slots: np.ndarray, unknown: list[str]) -> bool:
    """Whether `decision` (a `decide.Decision` not walked yet, for candidates `slots` and the
    unregistered `unknown`) was refused everywhere at once: then its `failed` and
    `reason_counts` hold every candidate's reason, as the walk and `explain_rest` would have
    worded them (another order: the caller's), and there is nothing left to walk."""
    index = decision.index
    memos = index.refusal_memos
    if not len(slots):
        return False
    key = decision.memo_key()
    memo = memos.peek(key)
    if memo is None or not memo.refused:
        return False
    decision._memo = index.refusal_memo(key)  # (the same memo, now the most recent)
    return _word_all(decision, slots, unknown)


def refused_rest_at_once(decision: Any) -> bool:
    """Whether a decision whose walk went far without a fit (hundreds of a long list checked,
    or a run of known refusals reaching its end: `Decision.fits`) is refused by every
    candidate: then, as for a retry (`refused_at_once`), every candidate is worded from its
    row's memo, its shape or a fit, in the caller's order, into a new `failed` and
    `reason_counts` (what the walk worded so far is worded again there, alike), and nothing is
    left to walk or explain. Otherwise nothing changes and the walk goes on (the shapes found
    now are remembered at the nodes' rows: the walk reads them). A first refusal on a full
    list then pays one pass over its candidates' distinct rows instead of the rest of the
    walk (its summaries chunk by chunk, its doubling rounds) and then the pruned set's."""
    ordering = getattr(decision.slots, "_ordering", None)
    if ordering is None:
        return False
    failed, counts = decision.failed, decision.reason_counts
    decision.failed, decision.reason_counts = type(failed)(), type(counts)()
    if _word_all(decision, ordering.slots, decision.unknown):
        return True
    decision.failed, decision.reason_counts = failed, counts
    return False


def _word_all(decision: Any, slots: np.ndarray, unknown: list[str]) -> bool:
    """Word every candidate and the unregistered names if none fits (True), else False."""
    index = decision.index
    memo = decision.memo()
    if index.foreign and np.isin(
        slots, [index.slot_of.get(name, -1) for name in index.foreign]
    ).any():  # (HAMi's pods there: worded one by one by the walk)
        return False
    versions = index.row_version[slots]
    ids = np.where(memo.stamp[slots] == versions, memo.reason[slots], -1).astype(np.int64)
    if (ids == FITS).any():
        memo.refused = False
        return False
    left = np.flatnonzero(ids < 0)
    if len(left):
        shaped = decision._by_shape(slots[left], stop_at_fit=False)
        if shaped is not None:
            if (shaped == FITS).any():
                memo.refused = False
                return False
            ids[left] = shaped
            left = left[shaped < 0]
        if len(left) > _ONE_BY_ONE:
            return False
        context = decision.context
        for position in left.tolist():
            slot = int(slots[position])
            entry = index.entry_at(slot)
            if entry.blocked:
                return False
            fit = fit_pod(entry.cards, decision.request, context())
            found = memo.put(slot, int(versions[position]),
                             None if fit.ok else fit.reason_text(), tuple(fit.reasons.keys()))
            index.refused_at[slot] = int(versions[position])
            if fit.ok:
                memo.refused = False
                return False
            ids[position] = found
    rows = index.name_rows(slots)  # (the names then read from its table if asked)
    decision.failed.add_bulk(None if rows else index.names_at[slots], ids, memo.text_array(),
                             memo.names, rows)
    counts = np.bincount(ids)
    reason_counts = decision.reason_counts
    for reason_id in np.flatnonzero(counts).tolist():
        nodes = int(counts[reason_id])
        for name in memo.names[reason_id]:
            reason_counts[name] += nodes
    for name in unknown:
        decision.failed.add(name, f"{NODE_UNREGISTERED}: no Tessera node agent registered this "
                                  "node" + index.foreign_note(name))  # fmt: skip
        reason_counts[NODE_UNREGISTERED] += 1
    return True
