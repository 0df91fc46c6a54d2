"""One clock for leases between machines: the NATS server's.

Every expiry and heartbeat that one replica writes and another judges (reservation TTLs, in-flight
claims, "node lost") is read on this clock, so a replica whose own clock is off by minutes still
agrees with the others. `ServerClock()` is a `now()` callable: the local clock plus an offset
measured against the server's timestamp on a tiny JetStream message (the server stamps every
stored message with its own time). The offset is re-measured periodically; until the first
measurement the clock is not `synced`, and services that judge leases report not-ready.

Tests inject a skewed `local` clock (e.g. `lambda: time.time() + 40`) and see the same leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime

from nats.js import JetStreamContext

from tessera import bus

log = logging.getLogger("tessera.clock")

Clock = Callable[[], float]


def server_time(stamp: datetime | None) -> float | None:
    """A server timestamp (KV entry `created`, stream message `time`) as epoch seconds."""
    return stamp.timestamp() if stamp is not None else None


class ServerClock:
    """`now()` on the NATS server's clock (epoch seconds)."""

    def __init__(self, local: Clock = time.time, *, samples: int = 3) -> None:
        self.local = local
        self.samples = samples
        self.offset = 0.0
        self.rtt_s: float | None = None
        self.synced = asyncio.Event()

    def __call__(self) -> float:
        return self.local() + self.offset

    async def measure(self, js: JetStreamContext, instance: str) -> float:
        """Measure the offset (the sample with the shortest round trip wins) and adopt it."""
        subject = bus.clock_subject(instance)
        best: tuple[float, float] | None = None  # (rtt, offset)
        for _ in range(self.samples):
            sent = self.local()
            ack = await js.publish(subject, b"", timeout=2.0)
            acked = self.local()
            msg = await js.get_msg(bus.CLOCK_STREAM, seq=ack.seq)
            stamp = server_time(msg.time)
            if stamp is None:
                continue
            rtt = acked - sent
            offset = stamp - (sent + acked) / 2
            if best is None or rtt < best[0]:
                best = (rtt, offset)
        if best is None:
            raise RuntimeError("the server returned no timestamp")
        self.rtt_s, self.offset = best
        self.synced.set()
        return self.offset

    async def run(
        self, js: JetStreamContext, instance: str, stop: asyncio.Event, interval_s: float = 5.0
    ) -> None:
        """Keep the offset current until `stop`; a failed measurement keeps the last offset."""
        while not stop.is_set():
            try:
                await self.measure(js, instance)
            except Exception as exc:
                log.warning("server clock not measured", extra={"err": str(exc)})
            wait = interval_s if self.synced.is_set() else min(0.5, interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)


class LocalClock:
    """A clock that is already 'synced' (single-process tests, tools): the local clock as is."""

    def __init__(self, local: Clock = time.time) -> None:
        self.local = local
        self.synced = asyncio.Event()
        self.synced.set()

    def __call__(self) -> float:
        return self.local()
