"""A refusal shape's text worded from its key instead of fitting one of its nodes (pure).

A first refusal of a pod of several containers meets a dozen or two shapes no request was
refused by alike yet (`CardClasses.shared_texts`), and fitted one node of each: its cards
built, every container picked and charged, the text formatted (~40-60 µs a shape, ~0.7 ms of
a two-container pod's first refusal at 5,000 nodes). But where every card class is libvgpu
slices a shape's key already says everything the text reads (`refusal_steps.card_codes`): per
card of the node, the first of HAMi's checks it fails against the container the node fails
at, with the cards the containers before it took already charged (0: it passes). The text is
HAMi's count of those reasons over the node's cards (`placement.format_reasons`), with the
cards that pass counted as `AllocatedCardsInsufficientRequest` (`placement.pick_cards`).

Worded here only where that is the whole story: the node's cards all take pods (signature 0:
none unhealthy, cordoned or out of slots, whose reason would depend on which of the class's
static checks fails first), no NUMA binding (its own reason), and, for a pod of one container,
fewer passing cards than it asks (else it fits: None). Anything else is left to the fit
(`ShapeTexts.word` gives `UNWORDED`). `tests/scheduler/test_refusal_fast.py`,
`test_refusal_shapes.py` and `test_shape_texts.py` compare every reason with fitting each node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from .placement import format_reasons
from .refusal_steps import STATIC_BASE, VERDICT_REASONS
from .rules import CARDS_INSUFFICIENT

UNWORDED = object()  # (a shape `word` leaves to the fit)
Worded = tuple[str, tuple[str, ...]] | None


class ShapeTexts(dict):
    """A `CardClasses.shared_texts` table ((family, count, key) -> (text, reason names), or
    None for a shape that takes the pod) whose `in` also words a shape it does not hold yet
    from its key (`word`), and keeps it: the caller then reads it as if a fit had found it."""

    def __init__(self, static_reason: Callable[[int], str | None], several: bool,
                 numa_bind: bool) -> None:  # fmt: skip
        super().__init__()
        self._static_reason = static_reason  # (a static check's reason by its id)
        self._head = 16 if several else 8  # (the key's head: step and signature, or signature)
        # (its codes: a pod's steps' int64 (`group_steps`), one container's `card_codes` int16)
        self._code = np.dtype("<i8") if several else np.dtype("<i2")
        self._several = several
        self._wordable = not numa_bind

    def __contains__(self, shared: object) -> bool:
        if dict.__contains__(self, shared):
            return True
        if not self._wordable or not isinstance(shared, tuple) or len(shared) != 3:
            return False
        worded = self.word(shared[1], shared[2])
        if worded is UNWORDED:
            return False
        self[shared] = worded
        return True

    def word(self, count: int, key: bytes) -> Worded | Any:
        """The text and reason names of the nodes of this shape (`count`: the failing
        container's), None where the pod fits them, `UNWORDED` where the key alone does not
        say (the caller fits a node)."""
        head = self._head
        if len(key) < head or (len(key) - head) % self._code.itemsize:
            return UNWORDED
        if int.from_bytes(key[head - 8 : head], "little", signed=True) != 0:
            return UNWORDED  # (cards that take no pod: their reasons are not in the codes)
        codes = np.frombuffer(key, dtype=self._code, offset=head)
        reasons: dict[str, int] = {}
        passing = total = 0
        for code in codes.tolist():
            if code < 0:
                continue  # (no card there)
            total += 1
            if code == 0:
                passing += 1
                continue
            reason = VERDICT_REASONS.get(code)
            if reason is None:
                at = code - STATIC_BASE  # (a class's static check: its reason's id)
                reason = self._static_reason(at) if at >= 0 else None
                if reason is None:
                    return UNWORDED
            reasons[reason] = reasons.get(reason, 0) + 1
        if passing >= count:
            # (one container: it fits the node; several: the key names the step that fails,
            # so this is not a shape of the pod as worded here)
            return UNWORDED if self._several else None
        if passing:
            reasons[CARDS_INSUFFICIENT] = reasons.get(CARDS_INSUFFICIENT, 0) + passing
        return format_reasons(Counter(reasons), total), tuple(reasons)
