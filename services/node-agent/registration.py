"""The node's presence on the bus: NodeRegistration heartbeats, node events, HAMi's annotation,
and the health monitor that feeds them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from tessera.node_agent.devices import (
    DeviceSource,
    HealthTracker,
    PhysicalGpu,
    advertise,
)
from tessera.node_agent.metrics import NodeAgentMetrics
from tessera.node_agent.state import DeviceState

from tessera import bus
from tessera.cluster.port import ClusterPort
from tessera.codec import encode
from tessera.device_kinds import registry
from tessera.models import NodeAction, NodeEvent, NodeRegistration
from tessera.settings import TesseraSettings

ANNOTATION_REFRESH_S = 30.0


class NodeRegistrar:
    """Re-puts the registration every heartbeat (and at once on a change)."""

    def __init__(
        self,
        *,
        node: str,
        settings: TesseraSettings,
        state: DeviceState,
        nodes_kv: KeyValue,
        js: JetStreamContext,
        cluster: ClusterPort | None,
        log: logging.Logger,
        instance: str,
    ) -> None:
        self.node = node
        self.settings = settings
        self.state = state
        self.nodes_kv = nodes_kv
        self.js = js
        self.cluster = cluster
        self.log = log
        self.instance = instance
        self._annotated: tuple[str, float] | None = None

    async def put(self) -> None:
        registration = NodeRegistration(node=self.node, devices=self.state.devices())
        await self.nodes_kv.put(self.node, encode(registration))

    async def annotate(self) -> None:
        """HAMi's hami.io/node-nvidia-register (and each other device family's register
        annotation, tessera.device_kinds), on change and every 30 s."""
        if self.cluster is None:
            return
        annotations = registry.register_annotations(self.state.devices())
        text = json.dumps(annotations, sort_keys=True)
        fresh = self._annotated and time.monotonic() - self._annotated[1] < ANNOTATION_REFRESH_S
        if fresh and self._annotated[0] == text:
            return
        try:
            # HAMi's handshake (`Reported_<time>`), for the families that have one, with each
            # write: the register annotation's freshness as HAMi's device plugins show it
            await self.cluster.patch_node_annotations(self.node, {
                **annotations, **registry.handshake_annotations(self.state.devices())})
            self._annotated = (text, time.monotonic())
        except Exception as exc:
            self.log.warning("node annotation not written", extra={"err": str(exc)})

    async def publish(
        self, action: NodeAction, reason: str, uuids: list[str], event_id: str
    ) -> None:
        event = NodeEvent(
            event_id=event_id, action=action, node=self.node, device_uuids=uuids, reason=reason,
            source=f"node-agent/{self.node}",
        )
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            self.log.warning("node event not published", extra={"err": str(exc)})

    async def run(self, stop: asyncio.Event) -> None:
        first = True
        seen = -1
        while not stop.is_set():
            try:
                await self.put()
                if first:
                    first = False
                    await self.publish(
                        "registered", f"{len(self.state.devices())} GPU(s)",
                        [d.uuid for d in self.state.devices()], f"{self.node}:{self.instance}:reg",
                    )
                    self.log.info("node registered", extra={"gpus": len(self.state.devices())})
                await self.annotate()
            except Exception as exc:
                self.log.warning("registration failed", extra={"err": str(exc)})
            seen = self.state.version
            # Wake at the next heartbeat, or at once when the devices change.
            waiter = asyncio.create_task(self.state.wait_change(seen))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait(
                {waiter, stopper}, timeout=self.settings.node_heartbeat_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in (waiter, stopper):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


class HealthMonitor:
    """Driver events → unhealthy GPUs (ListAndWatch, registration, events); recovery."""

    def __init__(
        self,
        *,
        source: DeviceSource,
        gpus: list[PhysicalGpu],
        settings: TesseraSettings,
        state: DeviceState,
        registrar: NodeRegistrar,
        log: logging.Logger,
        wait_s: float = 0.5,
        metrics: NodeAgentMetrics | None = None,
        apply_health: Callable[[frozenset[str]], Awaitable[None]] | None = None,
    ) -> None:
        self.metrics = metrics or NodeAgentMetrics()
        self.source = source
        self.gpus = gpus
        self.settings = settings
        self.state = state
        self.registrar = registrar
        self.log = log
        self.wait_s = wait_s
        self.tracker = HealthTracker([g.uuid for g in gpus], settings.health_recovery_s)
        # Re-advertising under the node's configuration (node_config.NodeConfigurator).
        self.apply_health = apply_health

    async def _apply(self) -> None:
        if self.apply_health is not None:
            await self.apply_health(self.tracker.unhealthy)
            return
        await self.state.update(advertise(self.gpus, self.settings, self.tracker.unhealthy))

    async def step(self) -> None:
        event = await asyncio.to_thread(self.source.wait_event, self.wait_s)
        now = time.time()
        if event is not None:
            self.metrics.driver_events.inc()
            newly = self.tracker.record(event, now)
            if newly:
                self.log.warning("GPU unhealthy", extra={"uuids": newly, "why": event.describe()})
                await self._apply()
                await self.registrar.publish(
                    "unhealthy", event.describe(), newly, f"{self.registrar.node}:bad:{now}"
                )
        back = self.tracker.recover(now)
        if back:
            self.log.info("GPU healthy again", extra={"uuids": back})
            await self._apply()
            await self.registrar.publish(
                "registered", f"healthy again: {', '.join(back)}", back,
                f"{self.registrar.node}:ok:{now}",
            )

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except Exception as exc:
                self.metrics.nvml_errors.inc()
                self.log.warning("health watch failed", extra={"err": str(exc)})
                await asyncio.sleep(self.wait_s)
