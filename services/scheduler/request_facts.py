"""What a decision derives from a pod's request alone, kept per request object.

`tessera.hami.parse_pod_request` hands out one `PodRequest` object per distinct pod shape (its
remembered requests), and `rules.parse_pod_options` one `PodOptions` per distinct set of
annotations, so the pods of a workload arrive as the same objects call after call. What a
decision reads from them alone (the containers' `Need`s, the `refusal_memo.sketch`, the memo
key's `repr`) is worked out once per object here instead of per call: ~10-30 µs of a placed
call's Python on a cold cache (bench/RESULTS.md "pyfit"). Keyed by the objects' identity and
checked to be those objects (each kept alive by its entry, so an id is never another's while
kept); a request or options object seen for the first time costs what it did."""

from __future__ import annotations

from typing import Any, NamedTuple

from tessera.hami import PodRequest

from .card_summaries import Need
from .refusal_memo import sketch


class Facts(NamedTuple):
    request: PodRequest  # (kept: its id is the key)
    needs: list[Need]  # `Need.of` (read, never written, by the walks)
    together: tuple[Need, ...]  # `Need.together`
    sketch: tuple  # `refusal_memo.sketch`


class RequestFacts:
    """Per request object its `Facts`; per (request, options, quota budget) its memo key."""

    KEEP = 1024  # objects kept before the memory starts over

    def __init__(self) -> None:
        self._facts: dict[int, Facts] = {}
        self._keys: dict[tuple, tuple[Any, Any, str]] = {}

    def of(self, request: PodRequest) -> Facts:
        kept = self._facts.get(id(request))
        if kept is not None and kept.request is request:
            return kept
        if len(self._facts) >= self.KEEP:
            self._facts.clear()
        kept = self._facts[id(request)] = Facts(
            request, Need.of(request), Need.together(request), sketch(request))
        return kept

    def memo_key(self, request: PodRequest, options: Any, memory_mib: Any, cores: Any) -> str:
        """`repr((request, options, memory_mib, cores))` (`Decision.memo_key`)."""
        # (the budget's types too: 1 and True are one key, not one repr)
        at = (id(request), id(options), memory_mib, cores, type(memory_mib), type(cores))
        kept = self._keys.get(at)
        if kept is not None and kept[0] is request and kept[1] is options:
            return kept[2]
        key = repr((request, options, memory_mib, cores))
        if len(self._keys) >= self.KEEP:
            self._keys.clear()
        self._keys[at] = (request, options, key)
        return key
