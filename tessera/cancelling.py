"""Stopping a task that ends only on a cancel, when one cancel may not end it.

Python 3.11's `asyncio.wait_for` drops a cancel that lands in the same loop iteration as its
awaitable completing: it returns the result instead of raising `CancelledError` (fixed in 3.12,
where wait_for is `asyncio.timeout`). nats-py waits for every request's reply with `wait_for`, so
a loop cancelled as a bus reply arrives goes on as if nothing happened — and a stopper that
cancels once and then awaits the task waits for ever (session 16: the quota service's stop hung
300 s). Loops end on their service's stop event where they can; whatever must still be
cancelled is cancelled with `cancel_and_wait`, which cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

RECANCEL_S = 0.05  # how long one cancel is given before the next
BOUND_S = 10.0  # a task that outlives this many cancels is left running (and said so)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]] | asyncio.Task[object],
                          bound_s: float = BOUND_S) -> list[asyncio.Task[object]]:  # fmt: skip
    """Cancel each task and wait until all have ended, cancelling those still running again
    every RECANCEL_S (a cancel the task swallowed is sent again), for at most `bound_s`. Their
    results and exceptions are retrieved (never logged as unretrieved). Returns the tasks that
    had not ended within the bound (they catch CancelledError and carry on: a bug)."""
    pending = {tasks} if isinstance(tasks, asyncio.Task) else set(tasks)
    current = asyncio.current_task()
    pending.discard(current)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
        for task in done:
            with contextlib.suppress(BaseException):
                task.result()
    return list(pending)
