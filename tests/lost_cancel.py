"""What Python 3.11's `asyncio.wait_for` does to a cancel that lands as its awaitable completes
(a bus reply arriving, inside nats-py's request): it drops it and returns the result. Tests of a
stop that must end its loops even so (tessera/cancelling.py)."""

from __future__ import annotations

import asyncio


class Reply:
    """A reply the test delivers in the same iteration as it cancels the waiting task."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None
        self.waiting = asyncio.Event()

    async def wait(self) -> None:
        self.future = asyncio.get_running_loop().create_future()
        self.waiting.set()
        await asyncio.wait_for(self.future, 3600)
        self.waiting.clear()

    def arrive_and_cancel(self, task: asyncio.Task[object]) -> None:
        assert self.future is not None
        self.future.set_result(None)
        task.cancel()


async def dropping_the_first_cancel() -> None:
    """Wait for ever, dropping the first cancel (as wait_for drops one that lands with its
    reply), ending on the next."""
    dropped = False
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if dropped:
                raise
            dropped = True
