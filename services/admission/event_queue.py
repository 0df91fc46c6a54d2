"""Admission events, published in the background so that no review ever waits on NATS.

Reviews `offer` an event to a bounded queue and return at once; a background task publishes
them with bus.publish_event (acknowledged, deduplicated by event id). It waits a few
milliseconds after the first event so that a burst goes out together (one socket write, the
acknowledgements read together): per event that halves the CPU the webhook spends on events.
When NATS is slow or down and the queue is full, events are dropped (counted), never a review.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from nats.js import JetStreamContext

from tessera.bus import publish_event
from tessera.cancelling import cancel_and_wait
from tessera.models import AdmissionAction, AdmissionEvent

log = logging.getLogger("tessera.admission")


@dataclass(frozen=True)
class PendingEvent:
    """What a review leaves behind; the model is built by the worker, off the review path."""

    action: AdmissionAction
    namespace: str
    name: str
    pod_uid: str
    reason: str
    review_uid: str
    never_placed: str = ""


class EventQueue:
    def __init__(
        self,
        js: JetStreamContext,
        source: str,
        *,
        maxsize: int = 2048,
        batch_window_s: float = 0.01,
        max_batch: int = 64,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.js = js
        self.source = source
        self.queue: asyncio.Queue[PendingEvent] = asyncio.Queue(maxsize=maxsize)
        self.batch_window_s = batch_window_s
        self.max_batch = max_batch
        self.on_drop = on_drop
        self.tasks: list[asyncio.Task[None]] = []
        self.published = 0
        self.dropped = 0

    def offer(self, event: PendingEvent) -> bool:
        """Queue without waiting; False (and counted) when the queue is full."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.on_drop:
                self.on_drop()
            return False
        return True

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._work())]

    async def stop(self, drain_timeout_s: float = 2.0) -> None:
        """Publish what is queued for up to `drain_timeout_s`, then stop the workers."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.queue.join(), drain_timeout_s)
        # (a cancel Python 3.11's wait_for drops, inside a publish, is sent again)
        await cancel_and_wait(self.tasks)
        self.tasks = []

    async def _work(self) -> None:
        while True:
            batch = [await self.queue.get()]
            try:
                await asyncio.sleep(self.batch_window_s)
                while len(batch) < self.max_batch and not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                await asyncio.gather(*(self._publish(pending) for pending in batch))
            finally:
                for _ in batch:
                    self.queue.task_done()

    async def _publish(self, pending: PendingEvent) -> None:
        try:
            event = AdmissionEvent(
                # The review uid is unique per admission call: a retried publish dedupes.
                event_id=f"admission:{pending.review_uid}:{pending.action}",
                source=self.source,
                reason=pending.reason,
                action=pending.action,
                namespace=pending.namespace or "_",
                name=pending.name,
                pod_uid=pending.pod_uid,
                never_placed=pending.never_placed,
            )
            await publish_event(self.js, event, attempts=3)
            self.published += 1
        except Exception as exc:
            self.dropped += 1
            if self.on_drop:
                self.on_drop()
            log.warning("admission event lost", extra={"err": str(exc)})
