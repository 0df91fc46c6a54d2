"""NATS in: the KV watches, the event stream (replayed from its start) and usage samples.

Each feed decodes and hands messages to the pure view; anything undecodable is counted in
`tessera_bus_bad_messages_total{source}` and logged, never raised. A feed that loses its NATS
subscription starts it again (KV watches re-deliver current values, the event consumer resumes
after the last sequence it applied), so the view heals after a broker restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from tessera.bus import EVENTS_ALL, EVENTS_STREAM, USAGE_ALL, Buckets, watch_models
from tessera.cancelling import cancel_and_wait
from tessera.codec import CodecError, decode
from tessera.events import decode_event
from tessera.models import NodeLedger, NodeRegistration, QuotaState, UsageSample

from .view import ClusterView

log = logging.getLogger("tessera.metrics")

RETRY_DELAY_S = 1.0
# How often the reconnect watchdog looks at the client's reconnect count.
WATCHDOG_S = 0.5


class Feeds:
    """Keeps a ClusterView current from NATS until stopped."""

    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        buckets: Buckets,
        view: ClusterView,
        clock: Callable[[], float],
    ) -> None:
        self.nc = nc
        self.js = js
        self.buckets = buckets
        self.view = view
        self.clock = clock
        self._tasks: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._usage_sub: Any = None

    async def start(self) -> None:
        # Listen to usage first, so pods allocated from now on get a "running" observation.
        self._usage_sub = await self.nc.subscribe(USAGE_ALL, cb=self._on_usage)
        self.view.latency.usage_since = self.clock()
        self._start_streams()
        self._watchdog = asyncio.create_task(self._restart_after_reconnect())

    def _start_streams(self) -> None:
        kv_feeds: list[tuple[str, Any, type, Callable[[str, Any], None], dict[str, Any]]] = [
            ("nodes", self.buckets.nodes, NodeRegistration, self.view.put_node, self.view.nodes),
            ("ledger", self.buckets.ledger, NodeLedger, self.view.put_ledger, self.view.ledgers),
            ("quota", self.buckets.quota, QuotaState, self.view.put_quota, self.view.quotas),
        ]
        for source, kv, model, put, current in kv_feeds:
            self._tasks.append(
                asyncio.create_task(self._watch_kv(source, kv, model, put, current))
            )
        self._tasks.append(asyncio.create_task(self._follow_events()))

    async def _stop_streams(self) -> None:
        # (a cancel Python 3.11's wait_for drops, inside a bus request, is sent again)
        await cancel_and_wait(self._tasks)
        self._tasks.clear()

    async def _restart_after_reconnect(self) -> None:
        """JetStream consumers do not survive a broker restart: start them again after every
        reconnect (KV watches re-deliver current values; events resume after the last one)."""
        seen = self.nc.stats.get("reconnects", 0)
        while True:
            await asyncio.sleep(WATCHDOG_S)
            now_seen = self.nc.stats.get("reconnects", 0)
            if now_seen != seen and self.nc.is_connected:
                seen = now_seen
                log.info("nats reconnected; restarting the watches and the event consumer")
                await self._stop_streams()
                self._start_streams()

    async def stop(self) -> None:
        if self._watchdog is not None:
            await cancel_and_wait(self._watchdog)
            self._watchdog = None
        await self._stop_streams()
        if self._usage_sub is not None:
            with contextlib.suppress(Exception):
                await self._usage_sub.unsubscribe()
            self._usage_sub = None

    async def wait_synced(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.view.synced:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # --- usage (core NATS, loss tolerant) -----------------------------------------------------

    async def _on_usage(self, msg: Msg) -> None:
        try:
            sample = decode(msg.data, UsageSample)
        except CodecError as exc:
            self._bad("usage", msg.subject, exc)
            return
        self.view.put_usage(sample, self.clock())

    # --- KV -----------------------------------------------------------------------------------

    async def _watch_kv(
        self,
        source: str,
        kv: Any,
        model: type,
        put: Callable[[str, Any], None],
        current: dict[str, Any],
    ) -> None:
        def on_error(key: str, exc: Exception) -> None:
            self._bad(source, key, exc)

        while True:
            seen: set[str] | None = set()
            try:
                async for key, value, _revision in watch_models(kv, model, on_error=on_error):
                    if key == "":
                        if seen is not None:
                            # Keys deleted while we were not watching are not re-delivered.
                            for gone in set(current) - seen:
                                put(gone, None)
                            seen = None
                        self.view.kv_synced.add(source)
                        continue
                    if seen is not None:
                        seen.add(key)
                    try:
                        put(key, value)
                    except Exception as exc:  # a value that decodes but cannot be used
                        self._bad(source, key, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("kv watch ended; restarting", extra={"bucket": source,
                                                                 "err": str(exc)})
            await asyncio.sleep(RETRY_DELAY_S)

    # --- the event stream ---------------------------------------------------------------------

    async def _follow_events(self) -> None:
        while True:
            try:
                await self._consume_events()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event consumer ended; restarting", extra={"err": str(exc)})
            await asyncio.sleep(RETRY_DELAY_S)

    async def _consume_events(self) -> None:
        info = await self.js.stream_info(EVENTS_STREAM)
        if info.state.last_seq < self.view.last_event_sequence:
            # The stream was recreated (broker data lost): fold the new one from its start;
            # event ids keep anything seen before from counting twice.
            log.warning("event stream is behind what was applied; reading it from the start",
                        extra={"stream_last": info.state.last_seq,
                               "applied": self.view.last_event_sequence})
            self.view.last_event_sequence = 0
        if self.view.last_event_sequence == 0 and info.state.messages == 0:
            self.view.events_synced = True
        start = self.view.last_event_sequence + 1
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
        )
        if start <= max(1, info.state.first_seq):
            config = js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.ALL)
        sub = await self.js.subscribe(
            EVENTS_ALL, stream=EVENTS_STREAM, config=config, ordered_consumer=True,
            idle_heartbeat=5.0,
        )
        if info.state.last_seq <= self.view.last_event_sequence:
            self.view.events_synced = True
        try:
            async for msg in sub.messages:
                self._on_event(msg)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _on_event(self, msg: Msg) -> None:
        sequence = msg.metadata.sequence.stream
        try:
            event = decode_event(msg.data)
        except CodecError as exc:
            if sequence > self.view.last_event_sequence:
                self.view.last_event_sequence = sequence
                self._bad("events", msg.subject, exc)
        else:
            try:
                self.view.apply_event(event, sequence)
            except Exception as exc:  # a bug must not stop the feed; count and move on
                self.view.last_event_sequence = max(self.view.last_event_sequence, sequence)
                self._bad("events", msg.subject, exc)
        if msg.metadata.num_pending == 0:
            self.view.events_synced = True

    def _bad(self, source: str, where: str, exc: Exception) -> None:
        self.view.bad_message(source)
        log.warning("bad bus message", extra={"source": source, "where": where,
                                              "err": str(exc)[:300]})
