"""Work the engine starts and does not wait for: event publishing and quota releases."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.js import JetStreamContext

from tessera import bus
from tessera.codec import encode

from .acks import JetStreamAcks

log = logging.getLogger("tessera.scheduler")


class BackgroundTasks:
    """Fire-and-forget tasks, kept referenced until done so `drain` can wait for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 3.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


# Events are a public API: a publish that fails (NATS away or slow to ack on a loaded machine)
# is retried with backoff for this long. Every event carries a Nats-Msg-Id, so a retry of a
# publish that in fact landed is dropped by the stream's dedupe window (longer than this).
RETRY_FOR_S = 60.0


class EventPublisher:
    """Publishes events to the stream in the background; a failure is retried, then logged.
    With `acks` (acks.py) each attempt is one publish awaiting its ack there, else
    `bus.publish_event`'s (the same subject, payload and Nats-Msg-Id)."""

    def __init__(
        self, js: JetStreamContext, tasks: BackgroundTasks, retry_for_s: float = RETRY_FOR_S,
        acks: JetStreamAcks | None = None,
    ) -> None:
        self.js = js
        self.tasks = tasks
        self.retry_for_s = retry_for_s
        self.acks = acks

    async def _attempt(self, event: Any) -> None:
        if self.acks is None:
            await bus.publish_event(self.js, event, attempts=3)
            return
        headers = {"Nats-Msg-Id": event.event_id}
        await self.acks.publish(bus.event_subject(event), encode(event), headers, timeout=2.0)

    def publish_soon(self, event: Any, on_done: Callable[[bool], None] | None = None) -> None:
        """Publish in the background; `on_done(landed)` once it landed or was given up."""
        self.tasks.spawn(self._publish(event, on_done))

    async def _publish(self, event: Any, on_done: Callable[[bool], None] | None) -> None:
        deadline = time.monotonic() + self.retry_for_s
        delay = 0.2
        while True:
            try:
                await self._attempt(event)
            except Exception as exc:
                if time.monotonic() + delay >= deadline:
                    log.warning("event publish failed, given up", extra={
                        "event": type(event).__name__, "err": str(exc),
                    })  # fmt: skip
                    if on_done is not None:
                        on_done(False)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if on_done is not None:
                on_done(True)
            return
