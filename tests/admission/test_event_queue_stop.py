"""The admission webhook's event queue stops within a bound while a publish waits for its ack
and the cancel that abandons it is lost (Python 3.11's wait_for drops one landing with the
ack, inside nats-py's request; tests/lost_cancel.py): before, the stop waited for ever."""

from __future__ import annotations

import asyncio

from lost_cancel import dropping_the_first_cancel
from tessera.admission.event_queue import EventQueue, PendingEvent

STOP_BOUND_S = 5.0


class AckLosingJetStream:
    """A broker whose ack is awaited when the stop's cancel lands: the first cancel is lost."""

    def __init__(self) -> None:
        self.publishing = asyncio.Event()

    async def publish(self, *args: object, **kwargs: object) -> None:
        self.publishing.set()
        await dropping_the_first_cancel()


async def test_stop_ends_while_a_publish_loses_its_cancel() -> None:
    js = AckLosingJetStream()
    queue = EventQueue(js, source="t", batch_window_s=0.0)  # type: ignore[arg-type]
    queue.start()
    assert queue.offer(PendingEvent("allowed", "ns", "p", "uid-1", "", "review-1"))
    await asyncio.wait_for(js.publishing.wait(), 10)
    stopping = asyncio.ensure_future(queue.stop(drain_timeout_s=0.1))
    done, _ = await asyncio.wait({stopping}, timeout=STOP_BOUND_S)
    assert done, f"the event queue did not stop within {STOP_BOUND_S:g} s"
    stopping.result()
