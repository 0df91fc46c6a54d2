"""Compute reclaims reported (issue 33, docs/elastic.md "Compute beyond the guarantee"): the
lending loop hands each tick's reclaims here (`offer`, on the event loop, no I/O); the coalescer
(`compute_reclaim_window`) lets through at most one per container and GPU per window; `run`
publishes those as `ComputeReclaimEvent`s on the bus and as a Normal `ComputeReclaimed` Event on
the pod, off the lending loop (a slow bus or API server never delays a tick)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from nats.js import JetStreamContext

from tessera import bus
from tessera.cluster.port import ClusterPort, ObjectRef
from tessera.elastic_compute import ComputeTaken
from tessera.models import ComputeReclaimEvent

from .compute_reclaim_window import ReclaimCoalescer, ReclaimSummary

QUEUE_MAX = 1024  # summaries waiting to be published (one per container/GPU/window: ample)
STOP_FLUSH_S = 2.0  # at stop: how long the held summaries may take to go out


class ComputeReclaimReporter:
    def __init__(
        self, *, node: str, js: JetStreamContext | None, cluster: ClusterPort | None,
        log: logging.Logger, source: str, window_s: float,
        names: Callable[[], Mapping[str, tuple[str, str, str]]],
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.node, self.js, self.cluster, self.log = node, js, cluster, log
        self.source, self.names, self.clock = source, names, clock
        self.window = ReclaimCoalescer(window_s)
        self._queue: asyncio.Queue[ReclaimSummary] = asyncio.Queue(QUEUE_MAX)
        self.published = 0  # events on the bus (tests, metrics)
        self.dropped = 0  # summaries lost to a full queue (the bus unreachable for long)

    def offer(self, taken: Iterable[ComputeTaken]) -> None:
        """The lending loop's reclaims of one tick, and the windows that ended: never blocks."""
        now = self.clock()
        for summary in [*self.window.add(taken, now), *self.window.due(now)]:
            self._put(summary)

    def _put(self, summary: ReclaimSummary) -> None:
        try:
            self._queue.put_nowait(summary)
        except asyncio.QueueFull:
            if not self.dropped:
                self.log.warning("compute reclaim events dropped: the bus is not keeping up")
            self.dropped += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            get = asyncio.ensure_future(self._queue.get())
            halt = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([get, halt], return_when=asyncio.FIRST_COMPLETED)
            finally:
                halt.cancel()
                if not get.done():
                    get.cancel()
            if get.done() and not get.cancelled():
                await self.report(get.result())
        for summary in self.window.flush():  # what the windows held: say it before going
            self._put(summary)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_FLUSH_S):
                while not self._queue.empty():
                    await self.report(self._queue.get_nowait())

    def event(self, s: ReclaimSummary) -> ComputeReclaimEvent:
        names = self.names()
        namespace, pod, container = names.get(s.key, ("", "", ""))
        for_pods = sorted({f"{n[0]}/{n[1]}" for k in s.for_keys if (n := names.get(k))})
        taken, now = s.max_taken_x100 / 100, s.allowance_x100 / 100
        times = ("once" if s.reclaims == 1
                 else f"{s.reclaims} times in {s.last_at - s.first_at:.0f} s")
        return ComputeReclaimEvent(
            node=self.node, device_uuid=s.uuid, pod_uid=s.key.split("/", 1)[0],
            namespace=namespace, pod=pod, container=container, reclaims=s.reclaims,
            max_taken_pct=taken, allowance_pct=now, guarantee_pct=s.guarantee_pct,
            burst_limit_pct=s.burst_pct, for_pods=for_pods, first_at=s.first_at,
            last_at=s.last_at, window_s=self.window.window_s, source=self.source,
            reason=(f"compute lent beyond the guarantee of {container or s.key} on {s.uuid} "
                    f"taken back {times} for {', '.join(for_pods) or 'busy neighbours'}: up to "
                    f"{taken:g} % of the GPU at once; allowance now {now:g} % (guarantee "
                    f"{s.guarantee_pct} %, burst limit {s.burst_pct} %)"),
        )  # fmt: skip

    async def report(self, summary: ReclaimSummary) -> None:
        try:
            event = self.event(summary)
        except ValueError as exc:  # a figure out of range (a damaged limits file): say, go on
            self.log.warning("compute reclaim event not made", extra={"err": str(exc)})
            return
        if self.js is not None:
            try:
                await bus.publish_event(self.js, event)
                self.published += 1
            except Exception as exc:
                self.log.warning("compute reclaim event not published", extra={"err": str(exc)})
        if self.cluster is None or not event.pod:
            return
        ref = ObjectRef(namespace=event.namespace, name=event.pod, uid=event.pod_uid)
        try:
            await self.cluster.record_event(ref, "ComputeReclaimed", event.reason, "Normal")
        except Exception as exc:  # best effort, as every Event
            self.log.warning("pod event not recorded", extra={"err": str(exc)})
