"""The cyclic GC once the scheduler is ready: collections between calls, not inside them.

CPython collects its youngest generation whenever 700 more container objects were allocated
than freed, wherever that happens: at 5,000 nodes about 3 % of placement decisions paid for a
collection triggered by what the calls before them kept (ledger copies, allocations), 0.4-1 ms
for the youngest generation and 2-12 ms when an older one was due, most of the decision's p99.

Here the automatic threshold is raised to a backstop (`ceiling`) and the event loop collects
every `interval_s` instead, between two callbacks (a filter call never yields inside its
decision), as soon as `young` objects have accumulated: the same generations CPython would pick,
in its order. So cyclic garbage still lives at most one interval (or `ceiling` allocations, if
the loop is stuck), and a collection delays the next callback instead of landing inside a call.

After every full collection the survivors are frozen, as the index is at ready
(`__main__.freeze_when_ready`): a full collection then walks only what was allocated since the
last one, never the whole index again (tens of milliseconds at 5,000 nodes, more as the index
is rewritten). The trade is the one made at ready: a reference cycle among frozen objects that
becomes garbage later is not reclaimed (none was found: a full collection with
`gc.DEBUG_SAVEALL` after a burst of placements found no cyclic garbage); objects freed by
reference counting, which is all of the scheduler's, are freed as before. So that such a leak
stays bounded all the same (a closed connection's transport and protocol refer to each other),
every `thaw_every_s` (10 minutes) the frozen objects are thawed and one full collection walks
them all: cyclic garbage frozen by mistake lives at most that long, and the one long collection
(tens of milliseconds at 5,000 nodes) lands between calls like the others.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class GcPolicy:
    young: int = 700  # CPython's own gen-0 threshold: how much garbage a collection waits for
    ceiling: int = 100_000  # the automatic threshold meanwhile (a loop stuck in one call)
    interval_s: float = 0.01
    middle: int = 10  # CPython's: gen-0 collections per gen-1, gen-1 per full collection
    old: int = 10
    thaw_every_s: float = 600.0  # bound on how long frozen cyclic garbage can live
    clock: Callable[[], float] = time.monotonic
    thawed_at: float | None = field(default=None, init=False)

    def install(self) -> None:
        gc.set_threshold(self.ceiling, self.middle, self.old)
        self.thawed_at = self.clock()

    def collect(self) -> int | None:
        """One step between calls: the generation collected (CPython's choice), or None when
        fewer than `young` objects accumulated since the last collection."""
        now = self.clock()
        if self.thawed_at is None:
            self.thawed_at = now
        if now - self.thawed_at >= self.thaw_every_s:
            # Everything frozen goes back under the collector once, so a cycle frozen while it
            # was still in use is reclaimed now that it is garbage.
            self.thawed_at = now
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            return 2
        young, middle, old = gc.get_count()
        if young < self.young:
            return None
        # CPython's rule: the oldest generation whose count passed its threshold.
        generation = 2 if old > self.old else 1 if middle > self.middle else 0
        gc.collect(generation)
        if generation == 2:
            gc.freeze()
        return generation

    async def run(self) -> None:
        """Install, then collect every `interval_s` until cancelled."""
        self.install()
        while True:
            await asyncio.sleep(self.interval_s)
            self.collect()


async def collect_between_calls() -> None:
    """The scheduler's policy (`python -m tessera.scheduler` runs it once ready)."""
    await GcPolicy().run()
