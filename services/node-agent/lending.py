"""Elastic compute: the node agent lends each GPU's idle compute to its busy elastic containers.

The policy and the tick are `tessera.elastic_compute` (pure policy + reading regions, rewriting
sealed limits). Here: the loop. The usage sampler (once a second) says which containers are on
which GPU (`set_members`: only GPUs holding an elastic container are watched); every
`LEND_INTERVAL_S` (20 ms) the lender reads their activity and rewrites the limits of each elastic
container whose allowance changed. The agent, not the tenant, is the only writer of the limits
file, so no tenant can raise its own allowance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

from tessera.elastic_compute import IDLE_AFTER_S, LEND_INTERVAL_S, ComputeLender, LendingMember

IDLE_WAIT_S = 1.0  # nothing elastic on the node: how long to wait before looking again


class ComputeLending:
    def __init__(
        self,
        log: logging.Logger,
        *,
        interval_s: float = LEND_INTERVAL_S,
        idle_after_s: float = IDLE_AFTER_S,
    ) -> None:
        self.log = log
        self.interval_s = interval_s
        self.lender = ComputeLender(idle_after_s)
        self._gpus: dict[str, tuple[LendingMember, ...]] = {}
        self._changed = asyncio.Event()
        self._failing = False
        self.allowances: dict[tuple[str, str], int] = {}  # (container key, uuid) -> % x 100

    @property
    def gpus(self) -> Mapping[str, tuple[LendingMember, ...]]:
        return self._gpus

    def set_members(self, gpus: Mapping[str, Sequence[LendingMember]]) -> None:
        """The containers of every GPU that holds an elastic container (the usage sampler's
        view, refreshed every sample). A GPU absent here is no longer watched."""
        new = {uuid: tuple(members) for uuid, members in gpus.items() if members}
        if new != self._gpus:
            self._gpus = new
            self._changed.set()

    def tick(self) -> dict[tuple[str, str], int]:
        self.allowances = self.lender.tick(self._gpus, time.time_ns())
        return self.allowances

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self._gpus:
                try:
                    await asyncio.to_thread(self.tick)
                    self._failing = False
                except Exception as exc:  # never let lending stop the agent; say it once
                    if not self._failing:
                        self.log.warning("compute lending failed", extra={"err": str(exc)})
                    self._failing = True
            with contextlib.suppress(TimeoutError):
                if self._gpus:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                else:  # nothing elastic: sleep until the sampler finds some
                    self._changed.clear()
                    await asyncio.wait_for(_first(stop, self._changed), IDLE_WAIT_S)


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
