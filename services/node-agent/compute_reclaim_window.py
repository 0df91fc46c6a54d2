"""Coalescing compute reclaims into events an operator can live with (pure).

The lender (`tessera.elastic_compute`) may take lent compute back from a container at every wake
of a neighbour, up to 50 times a second. Per container and GPU at most one event per window: the
first reclaim is reported at once (it opens a window); the reclaims that follow within the
window are summed into one summary reported when the window ends (which opens the next); a
window that ends with nothing held closes, so the next reclaim is again reported at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from tessera.elastic_compute import ComputeTaken

Key = tuple[str, str]  # (container key, GPU uuid)


@dataclass(frozen=True)
class ReclaimSummary:
    """The reclaims of one container on one GPU that one event reports."""

    key: str
    uuid: str
    reclaims: int
    max_taken_x100: int  # the most lent compute taken back at once (% of the GPU x 100)
    allowance_x100: int  # its allowance after the last of them
    guarantee_pct: int
    burst_pct: int
    for_keys: tuple[str, ...]  # the neighbours it was taken for, in all of them (sorted)
    first_at: float
    last_at: float

    @staticmethod
    def of(taken: ComputeTaken, at: float) -> ReclaimSummary:
        return ReclaimSummary(
            taken.key, taken.uuid, 1, max(0, taken.before_x100 - taken.after_x100),
            taken.after_x100, taken.guarantee_pct, taken.burst_pct,
            tuple(sorted(set(taken.for_keys))), at, at)

    def merged(self, later: ReclaimSummary) -> ReclaimSummary:
        return replace(
            later, reclaims=self.reclaims + later.reclaims,
            max_taken_x100=max(self.max_taken_x100, later.max_taken_x100),
            for_keys=tuple(sorted(set(self.for_keys) | set(later.for_keys))),
            first_at=self.first_at)


@dataclass
class _Window:
    opened_at: float
    held: ReclaimSummary | None = field(default=None)


class ReclaimCoalescer:
    """At most one summary per (container, GPU) per `window_s` (0: every reclaim its own)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._windows: dict[Key, _Window] = {}

    def add(self, taken: Iterable[ComputeTaken], at: float) -> list[ReclaimSummary]:
        """Record reclaims seen at `at`; returns those to report now (opening a window)."""
        out = []
        for t in taken:
            one = ReclaimSummary.of(t, at)
            w = self._windows.get((t.key, t.uuid))
            if w is None or at - w.opened_at >= self.window_s:
                # no window open, or one ended whose summary `due` has not handed out yet
                out.append(w.held.merged(one) if w and w.held else one)
                self._windows[(t.key, t.uuid)] = _Window(at)
            else:
                w.held = w.held.merged(one) if w.held else one
        return out

    def due(self, now: float) -> list[ReclaimSummary]:
        """The summaries of windows that ended by `now` (each opens the next window)."""
        out = []
        for key, w in list(self._windows.items()):
            if now - w.opened_at < self.window_s:
                continue
            if w.held is None:
                del self._windows[key]  # quiet: the next reclaim is reported at once
            else:
                out.append(w.held)
                self._windows[key] = _Window(now)
        return out

    def flush(self) -> list[ReclaimSummary]:
        """Everything held, at once (the agent stops)."""
        out = [w.held for w in self._windows.values() if w.held is not None]
        self._windows.clear()
        return out

    def __len__(self) -> int:
        return len(self._windows)
