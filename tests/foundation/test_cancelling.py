"""`cancel_and_wait` ends a loop that ends only on a cancel even when a cancel is lost: Python
3.11's `asyncio.wait_for` drops one landing as its awaitable completes (a bus reply), and the
loop goes on; one cancel then an await waited for ever (the quota service's 300 s stop)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from lost_cancel import Reply, dropping_the_first_cancel

from tessera.cancelling import cancel_and_wait


async def test_a_cancel_lost_in_wait_for_is_sent_again() -> None:
    reply = Reply()
    rounds = 0

    async def loop_on_replies() -> None:  # a loop that ends only on a cancel
        nonlocal rounds
        while True:
            await reply.wait()
            rounds += 1

    task = asyncio.create_task(loop_on_replies())
    await asyncio.wait_for(reply.waiting.wait(), 10)
    reply.arrive_and_cancel(task)  # the reply and the cancel in one loop iteration
    if sys.version_info < (3, 12):  # the defect: the cancel is gone, the loop goes on
        await asyncio.wait_for(reply.waiting.wait(), 10)
        assert rounds == 1 and not task.done()
    assert await cancel_and_wait(task, bound_s=10) == []
    assert task.cancelled()


async def test_every_task_ends_within_the_bound() -> None:
    tasks = [asyncio.create_task(dropping_the_first_cancel()) for _ in range(3)]
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await cancel_and_wait(tasks, bound_s=10) == []
    assert all(t.cancelled() for t in tasks)
    assert loop.time() - start < 5  # a few re-cancels, not the bound


async def test_a_task_that_ignores_every_cancel_is_reported_not_waited_for() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, bound_s=0.3) == [task]
    release.set()
    task.cancel()  # wakes it: it sees the release and ends
    await asyncio.wait_for(task, 10)
