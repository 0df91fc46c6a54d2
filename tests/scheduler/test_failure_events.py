"""Scheduling-failed events are a public API: a refusal's event must not be lost.

Two ways it was: the publisher gave up after ~6 s of failed publishes, and a repeat of the same
refusal within 30 s was then never published (the first was taken as sent). Now the publisher
keeps retrying (the event id dedupes a retry that had landed) and a repeat is suppressed only
once the first is known to have landed."""

from __future__ import annotations

import asyncio
from typing import Any

from tessera.scheduler.background import BackgroundTasks, EventPublisher
from tessera.scheduler.failures import FailureLog
from tessera.scheduler.metrics import SchedulerMetrics
from tessera.scheduler.pods import PodIdentity

from tessera.models import SchedulingFailedEvent


class RecordingPublisher:
    """Stands in for EventPublisher: remembers each event and its completion callback."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, Any]] = []

    def publish_soon(self, event: Any, on_done: Any = None) -> None:
        self.sent.append((event, on_done))


def test_a_repeat_is_published_again_when_the_first_did_not_land() -> None:
    publisher = RecordingPublisher()
    clock = [100.0]
    log = FailureLog(SchedulerMetrics(), publisher, "test", lambda: clock[0])  # type: ignore[arg-type]
    pod = PodIdentity("uid-1", "ns", "p")
    log.remember(pod, {"n1": "1/1 CardInsufficientMemory"}, "no node fits")
    assert len(publisher.sent) == 1
    clock[0] += 1
    log.remember(pod, {"n1": "1/1 CardInsufficientMemory"}, "no node fits")
    assert len(publisher.sent) == 1  # still being retried: not twice at once
    publisher.sent[0][1](False)  # given up
    clock[0] += 1
    log.remember(pod, {"n1": "1/1 CardInsufficientMemory"}, "no node fits")
    assert len(publisher.sent) == 2  # the refusal is announced after all
    publisher.sent[1][1](True)
    clock[0] += 1
    log.remember(pod, {"n1": "1/1 CardInsufficientMemory"}, "no node fits")
    assert len(publisher.sent) == 2  # landed: the repeat is suppressed


def test_a_publish_landing_after_a_repeat_is_known_to_the_repeat() -> None:
    """The repeat keeps the first refusal's record, so the first publish landing while the
    repeat was suppressed still counts: a third refusal is not published a second time."""
    publisher = RecordingPublisher()
    clock = [100.0]
    log = FailureLog(SchedulerMetrics(), publisher, "test", lambda: clock[0])  # type: ignore[arg-type]
    pod = PodIdentity("uid-2", "ns", "q")
    reasons = {"n1": "1/1 CardInsufficientCore"}
    log.remember(pod, reasons, "no node fits")
    clock[0] += 1
    log.remember(pod, reasons, "no node fits")  # suppressed: the first is in flight
    publisher.sent[0][1](True)  # ... and lands now
    clock[0] += 1
    log.remember(pod, reasons, "no node fits")
    assert len(publisher.sent) == 1
    assert log.get("uid-2") is log.get("ns/q") and log.get("uid-2").published


class FlakyJetStream:
    """A JetStream whose publish fails (no ack) a few times before it works."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes, headers: Any = None,
                      timeout: float = 2.0) -> None:  # fmt: skip
        if self.failures > 0:
            self.failures -= 1
            raise TimeoutError("nats: timeout")
        self.published.append(subject)


async def test_publisher_keeps_retrying_until_the_stream_acks() -> None:
    js = FlakyJetStream(failures=7)  # more than one bus.publish_event's own 3 attempts
    tasks = BackgroundTasks()
    outcome: list[bool] = []
    publisher = EventPublisher(js, tasks, retry_for_s=30.0)  # type: ignore[arg-type]
    publisher.publish_soon(SchedulingFailedEvent(namespace="ns", name="p"), outcome.append)
    await asyncio.wait_for(tasks.drain(30.0), 30.0)
    assert js.published == ["tessera.events.sched.ns.failed"] and outcome == [True]
