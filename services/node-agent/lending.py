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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.elastic_compute import (
    IDLE_AFTER_S,
    LEND_INTERVAL_S,
    ComputeLender,
    ComputeTaken,
    LendingMember,
)

IDLE_WAIT_S = 1.0  # nothing elastic on the node: how long to wait before looking again


class ComputeLending:
    def __init__(
        self,
        log: logging.Logger,
        *,
        interval_s: float = LEND_INTERVAL_S,
        idle_after_s: float = IDLE_AFTER_S,
        on_reclaims: Callable[[Iterable[ComputeTaken]], None] | None = None,
    ) -> None:
        self.log = log
        # each tick's reclaims, handed over on the event loop (compute_reclaims.py: coalesced,
        # published by its own task; it must not block)
        self.on_reclaims = on_reclaims
        self.interval_s = interval_s
        self.lender = ComputeLender(idle_after_s)
        self._gpus: dict[str, tuple[LendingMember, ...]] = {}
        self._changed = asyncio.Event()
        self._failing = False
        self.allowances: dict[tuple[str, str], int] = {}  # (container key, uuid) -> % x 100
        self.names: dict[str, tuple[str, str, str]] = {}  # key -> (namespace, pod, container)

    @property
    def gpus(self) -> Mapping[str, tuple[LendingMember, ...]]:
        return self._gpus

    def set_members(
        self,
        gpus: Mapping[str, Sequence[LendingMember]],
        names: Mapping[str, tuple[str, str, str]] | None = None,
    ) -> None:
        """The containers of every GPU that holds an elastic container (the usage sampler's
        view, refreshed every sample), and who each is (metrics). A GPU absent here is no
        longer watched."""
        if names is not None:
            self.names = dict(names)
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
            if self.on_reclaims is not None:  # also with nothing taken: windows end
                self.on_reclaims(self.lender.taken)
                self.lender.taken = []
            with contextlib.suppress(TimeoutError):
                if self._gpus:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                else:  # nothing elastic: sleep until the sampler finds some
                    self._changed.clear()
                    await asyncio.wait_for(_first(stop, self._changed), IDLE_WAIT_S)


class LendingCollector(Collector):
    """At scrape time: per elastic container and GPU its guaranteed share, burst limit and the
    allowance in force (what it may use now; above the guarantee = lent), and how often compute
    was taken back."""

    def __init__(self, lending: Callable[[], ComputeLending | None]) -> None:
        self.lending = lending

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        share = GaugeMetricFamily(
            "tessera_node_agent_compute_share_pct", "elastic compute per container and GPU, "
            "% of the GPU: guaranteed, burst_limit, allowance (in force now), lent (allowance "
            "beyond the guarantee)",
            labels=["namespace", "pod", "container", "device_uuid", "kind"])
        reclaims = CounterMetricFamily(
            "tessera_node_agent_compute_reclaims", "times lent compute was taken back from a "
            "busy elastic container (its allowance lowered: a neighbour woke), per container "
            "and GPU still lent on", labels=["namespace", "pod", "container", "device_uuid"])
        lending = self.lending()
        if lending is not None:
            for (key, uuid), (guarantee, burst, allow) in lending.lender.view.items():
                who = list(lending.names.get(key, ("", key, "")))
                for kind, value in (("guaranteed", guarantee), ("burst_limit", burst),
                                    ("allowance", allow / 100),
                                    ("lent", max(0.0, allow / 100 - guarantee))):
                    share.add_metric([*who, uuid, kind], value)
        if lending is not None:
            # a copy: the tick (in a thread) may be adding to it meanwhile
            for (key, uuid), count in dict(lending.lender.reclaims_of).items():
                who = list(lending.names.get(key, ("", key, "")))
                reclaims.add_metric([*who, uuid], count)
        yield share
        yield reclaims


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
