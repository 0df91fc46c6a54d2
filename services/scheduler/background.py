"""Work the engine starts and does not wait for: event publishing and quota releases."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from nats.js import JetStreamContext

from tessera import bus

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


class EventPublisher:
    """Publishes events to the stream in the background; a failure is logged, never raised."""

    def __init__(self, js: JetStreamContext, tasks: BackgroundTasks) -> None:
        self.js = js
        self.tasks = tasks

    def publish_soon(self, event: Any) -> None:
        self.tasks.spawn(self._publish(event))

    async def _publish(self, event: Any) -> None:
        try:
            await bus.publish_event(self.js, event, attempts=3)
        except Exception as exc:
            log.warning("event publish failed", extra={"event": type(event).__name__,
                                                       "err": str(exc)})  # fmt: skip
