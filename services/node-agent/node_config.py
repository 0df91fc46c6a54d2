"""Per-node device configuration, applied live: the ConfigMap `tessera-node-config` (watched
through the cluster port) and the local entry `tessera node-config set` sends on the bus
(`tessera.node.<node>.config.set`, admin only; `.get` shows the status).

Every change is validated (node_config_rules), then checked against the node's ledger: a
configuration that would offer less than is allocated (memory, compute, slots, or a GPU in use
filtered out) is refused — a `config_refused` node event, a Kubernetes Warning event on the
Node and the status `get` shows — and the node keeps what it had. An accepted one replaces the
advertised devices at once: the registration is re-put, HAMi's node annotation rewritten and
kubelet's ListAndWatch streams the new replicas, without a restart. The applied configuration
and the local entry are kept in `<region dir>/node-config.json`, so a restarted agent offers
what it offered before even when the ConfigMap changed meanwhile to something refused. The
ConfigMap is the desired state: a change of it refused for what pods hold stays pending and is
applied once it fits (a change sent with `set` is refused for good: its sender is told).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service
from prometheus_client import CollectorRegistry

from tessera import bus
from tessera.cluster.port import ClusterError, ClusterPort, NotFoundError, ObjectRef
from tessera.codec import CodecError, decode, encode
from tessera.models import (
    NODE_CONFIG_MAP,
    DeviceInfo,
    NodeConfigSetRequest,
    NodeConfigStatus,
    NodeDeviceConfig,
    NodeEvent,
    NodeLedger,
    StaticMigInstance,
)
from tessera.settings import TesseraSettings
from tessera.signing import CommandGate, verifier_from_file
from tessera.validation import Bounds, Rejections

from .devices import DeviceConfig, PhysicalGpu, advertise
from .metrics import NodeAgentMetrics
from .node_config_rules import (
    ConfigFile,
    NodeConfigError,
    allocated,
    describe,
    effective_entry,
    layer,
    mode_change_problems,
    node_problem,
    parse_config_map,
    parse_entry,
    resolve,
    shrink_problems,
)
from .state import DeviceState

STATE_FILE = "node-config.json"
SERVICE_VERSION = "0.1.0"
WATCH_RETRY_S = 2.0


class NodeConfigurator:
    """Owns what this node advertises: its GPUs under the current configuration and health."""

    def __init__(
        self,
        *,
        node: str,
        settings: TesseraSettings,
        state: DeviceState,
        gpus: list[PhysicalGpu],
        ledger_kv: KeyValue,
        log: logging.Logger,
        js: JetStreamContext | None = None,
        nc: NatsClient | None = None,
        cluster: ClusterPort | None = None,
        metrics: NodeAgentMetrics | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.node = node
        self.settings = settings
        self.state = state
        self.gpus = gpus
        self.ledger_kv = ledger_kv
        self.log = log
        self.js = js
        self.nc = nc
        self.cluster = cluster
        self.metrics = metrics or NodeAgentMetrics()
        # config.set is taken only signed by the admin (tessera.signing).
        self.commands = CommandGate(
            verifier_from_file(settings.command_trust_file, clock or time.time),
            Rejections(f"node-agent/{node}", js, CollectorRegistry()), f"node-agent/{node}",
        )
        self.bounds = Bounds.of(settings)
        self.path = Path(settings.region_host_dir) / STATE_FILE
        self.config = DeviceConfig.of(settings)
        self.unhealthy: frozenset[str] = frozenset()
        # migstrategy single: the MIG instances advertised in place of the GPUs (mig_plugin.py)
        self.mig_single: list[DeviceInfo] | None = None
        # migstrategy mixed: the instances served per card, shown in the registration
        self.mig_instances: dict[str, list[StaticMigInstance]] = {}
        self.config_map: ConfigFile | None = None  # the latest valid one (desired)
        self.pending = False  # the ConfigMap asks for what was refused: retried every beat
        self.local: NodeDeviceConfig | None = None
        self.sources: tuple[str, ...] = ("settings",)
        self.refused = ""
        self.refused_at: float | None = None
        self.applied_at: float | None = None
        self._lock = asyncio.Lock()
        self._micro: Service | None = None
        self._node_settings: tuple[tuple[int, float, float], TesseraSettings] | None = None

    # --- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """The configuration the node starts with: what it applied last (the state file), then
        the ConfigMap and the local entry as they are now, if they may be applied."""
        saved = await asyncio.to_thread(self._load)
        if saved is not None:
            local, applied = saved
            self.local = local
            if applied is not None:
                self.config = applied
        readable = True
        if self.cluster is not None:
            try:
                obj = await self.cluster.get_config_map(
                    self.settings.node_config_namespace, NODE_CONFIG_MAP
                )
                self.config_map = parse_config_map(obj)
            except NotFoundError:
                self.config_map = None
            except NodeConfigError as exc:
                readable = False  # keep what was applied last; the watch reports it
                await self._refuse(str(exc))
            except ClusterError as exc:
                readable = False
                self.log.warning("node config map not read", extra={"err": str(exc)})
        await self.state.update(self._devices(self.config))
        if readable:
            async with self._lock:
                try:
                    status = await self._apply(self.config_map, self.local, origin=NODE_CONFIG_MAP)
                    self.pending = not status.ok
                except Exception as exc:  # NATS not answering yet: keep what was applied last
                    self.pending = True
                    self.log.warning("node config not checked at start", extra={"err": str(exc)})
        if self.nc is not None:
            await self._serve()

    async def stop(self) -> None:
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
            self._micro = None

    # --- inputs -------------------------------------------------------------------------------

    async def set_unhealthy(self, unhealthy: frozenset[str]) -> None:
        """Health changed (HealthMonitor): re-advertise under the same configuration."""
        async with self._lock:
            self.unhealthy = unhealthy
            await self.state.update(self._devices(self.config))

    async def on_config_map(self, obj: dict[str, Any] | None) -> NodeConfigStatus:
        """The ConfigMap was created, changed (obj) or deleted (None)."""
        async with self._lock:
            try:
                parsed = parse_config_map(obj) if obj is not None else None
            except NodeConfigError as exc:
                self.pending = False  # nothing valid to apply; the node keeps what it has
                return await self._refuse(str(exc))
            self.config_map = parsed
            status = await self._apply(parsed, self.local, origin=NODE_CONFIG_MAP)
            self.pending = not status.ok
            return status

    async def set_local(self, request: NodeConfigSetRequest) -> NodeConfigStatus:
        """`tessera node-config set`: this node's own entry, over the ConfigMap's."""
        async with self._lock:
            try:
                local = None if request.reset else parse_entry(request.config)
            except NodeConfigError as exc:
                return await self._refuse(str(exc))
            if local is not None and not local.model_dump(exclude_none=True):
                return await self._refuse("node config: nothing to set (give at least one of "
                                          "devicesplitcount, devicememoryscaling, "
                                          "devicecorescaling, operatingmode, filterdevices)")
            return await self._apply(self.config_map, local, origin="tessera node-config set")

    async def watch(self, stop: asyncio.Event) -> None:
        """Follow the ConfigMap through the cluster port until `stop` (restarting the watch)."""
        if self.cluster is None:
            return
        namespace = self.settings.node_config_namespace
        while not stop.is_set():
            try:
                async for event in self.cluster.watch_config_maps(namespace):
                    if event.object.get("metadata", {}).get("name") != NODE_CONFIG_MAP:
                        continue
                    await self.on_config_map(None if event.type == "DELETED" else event.object)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("node config watch failed", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_RETRY_S)

    async def retry_pending(self) -> None:
        """A ConfigMap refused because pods held what it takes away is applied once they left
        (the ConfigMap is the desired state; the refusal is repeated only when it changes)."""
        async with self._lock:
            if self.pending:
                status = await self._apply(self.config_map, self.local, origin=NODE_CONFIG_MAP)
                self.pending = not status.ok

    async def run(self, stop: asyncio.Event) -> None:
        watcher = asyncio.create_task(self.watch(stop))
        every = max(1.0, self.settings.node_heartbeat_s)
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every)
                if stop.is_set():
                    break
                try:
                    await self.retry_pending()
                except Exception as exc:
                    self.log.warning("pending node config not retried", extra={"err": str(exc)})
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
            await self.stop()

    def node_settings(self) -> TesseraSettings:
        """The settings as this node's configuration has them (the handshake reads memory
        scaling from here: > 1 seals oversubscribe and sets CUDA_OVERSUBSCRIBE)."""
        key = (self.config.split_count, self.config.memory_scaling, self.config.core_scaling)
        if self._node_settings is None or self._node_settings[0] != key:
            self._node_settings = (key, self.settings.model_copy(update={
                "device_split_count": key[0], "device_memory_scaling": key[1],
                "device_core_scaling": key[2],
            }))  # fmt: skip
        return self._node_settings[1]

    # --- status -------------------------------------------------------------------------------

    def status(self, ok: bool = True, reason: str = "") -> NodeConfigStatus:
        return NodeConfigStatus(
            ok=ok, reason=reason, node=self.node, effective=effective_entry(self.config),
            sources=list(self.sources),
            local=self.local.model_dump(exclude_none=True) if self.local else {},
            refused=self.refused, refused_at=self.refused_at, applied_at=self.applied_at,
            pending=self.pending,
        )

    # --- applying -----------------------------------------------------------------------------

    def _devices(self, config: DeviceConfig) -> list:
        if self.mig_single is not None and config.mig_strategy == "single":
            return list(self.mig_single)
        devices = advertise(self.gpus, self.settings, self.unhealthy, config)
        if not self.mig_instances:
            return devices
        return [d.model_copy(update={"mig_instances": self.mig_instances.get(d.uuid, [])})
                for d in devices]

    def physical(self) -> list[DeviceInfo]:
        """The GPUs as offered under the current configuration (whatever MIG strategy)."""
        return advertise(self.gpus, self.settings, self.unhealthy, self.config)

    def offered_gpus(self) -> list[PhysicalGpu]:
        return [g for g in self.gpus if self.config.offers(g)]

    async def set_mig_instances(self, by_gpu: dict[str, list[StaticMigInstance]]) -> None:
        """migstrategy mixed: the instances served on each card (and who holds them), carried
        in the registration for the dashboard."""
        async with self._lock:
            if by_gpu == self.mig_instances:
                return
            self.mig_instances = dict(by_gpu)
            await self.state.update(self._devices(self.config))

    async def set_mig_single(self, devices: list[DeviceInfo] | None) -> None:
        """migstrategy single: advertise these MIG instances as the node's GPUs (None: the
        GPUs themselves)."""
        async with self._lock:
            if devices == self.mig_single:
                return
            self.mig_single = None if devices is None else list(devices)
            await self.state.update(self._devices(self.config))

    async def _ledger(self) -> NodeLedger | None:
        current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        return current.value if current else None

    @staticmethod
    def _problems(old: list[DeviceInfo], new: list[DeviceInfo], usage: dict) -> list[str]:
        return shrink_problems(new, usage) + mode_change_problems(old, new, usage)

    async def _apply(
        self, config_map: ConfigFile | None, local: NodeDeviceConfig | None, *, origin: str
    ) -> NodeConfigStatus:
        layered = layer(self.settings, config_map, self.node, local)
        candidate = resolve(layered.merged, self.settings)
        problem = node_problem(layered, candidate, self.gpus, self.bounds)
        if problem is not None:
            return await self._refuse(f"{origin}: {problem}")
        before, old_devices = self.config, self.state.devices()
        if candidate == before:
            self.config_map, self.local, self.sources = config_map, local, layered.sources
            self.refused, self.refused_at = "", None
            await asyncio.to_thread(self._save)
            return self.status(reason=f"unchanged: {describe(candidate)}")
        devices = self._devices(candidate)
        problems = self._problems(old_devices, devices, allocated(await self._ledger()))
        if not problems:
            await self.state.update(devices)
            # The scheduler may have placed a pod on the old capacity meanwhile: look again.
            problems = self._problems(old_devices, devices, allocated(await self._ledger()))
            if problems:
                await self.state.update(old_devices)
        if problems:
            return await self._refuse(
                f"{origin}: the new configuration ({describe(candidate)}) would offer less than "
                f"is allocated: {'; '.join(problems[:4])}. Nothing changed; free those first"
            )
        self.config, self.config_map, self.local = candidate, config_map, local
        self.sources = layered.sources
        self.refused, self.refused_at, self.applied_at = "", None, time.time()
        await asyncio.to_thread(self._save)
        reason = f"{origin}: {describe(candidate)} (was {describe(before)})"
        self.metrics.config_changes.labels(result="applied").inc()
        self.log.info("node config applied", extra={"node": self.node, "config": reason})
        await self._publish("configured", reason)
        await self._record("NodeConfigApplied", reason, "Normal")
        return self.status(reason=reason)

    async def _refuse(self, reason: str) -> NodeConfigStatus:
        reason = reason[:1000]
        if reason == self.refused:
            return self.status(ok=False, reason=reason)  # told already (a relisted watch)
        self.refused, self.refused_at = reason, time.time()
        self.metrics.config_changes.labels(result="refused").inc()
        self.log.warning("node config refused", extra={"node": self.node, "why": reason})
        await self._publish("config_refused", reason)
        await self._record("NodeConfigRefused", reason, "Warning")
        return self.status(ok=False, reason=reason)

    async def _publish(self, action: str, reason: str) -> None:
        if self.js is None:
            return
        event = NodeEvent(
            action=action, node=self.node, reason=reason,  # type: ignore[arg-type]
            device_uuids=[d.uuid for d in self.state.devices()], source=f"node-agent/{self.node}",
        )
        try:
            await bus.publish_event(self.js, event, attempts=2)
        except Exception as exc:
            self.log.warning("node config event not published", extra={"err": str(exc)})

    async def _record(self, reason: str, message: str, kind: str) -> None:
        if self.cluster is None:
            return
        try:
            await self.cluster.record_event(
                ObjectRef(kind="Node", name=self.node), reason, message, kind  # type: ignore[arg-type]
            )
        except Exception as exc:
            self.log.warning("node config event not recorded", extra={"err": str(exc)})

    # --- the state file -----------------------------------------------------------------------

    def _load(self) -> tuple[NodeDeviceConfig | None, DeviceConfig | None] | None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self.log.warning("node config state unreadable", extra={"err": str(exc)})
            return None
        try:
            local = parse_entry(raw["local"]) if raw.get("local") else None
            applied = parse_entry(raw["applied"]) if raw.get("applied") else None
        except (NodeConfigError, KeyError, AttributeError) as exc:
            self.log.warning("node config state unreadable", extra={"err": str(exc)})
            return None
        return local, (resolve(applied, self.settings) if applied else None)

    def _save(self) -> None:
        payload = {
            "local": self.local.model_dump(exclude_none=True) if self.local else None,
            "applied": effective_entry(self.config),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, self.path)

    # --- the bus ------------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self.nc is not None
        self._micro = await add_service(
            self.nc, name=bus.NODE_SERVICE, version=SERVICE_VERSION,
            description="Tessera node agent: per-node device configuration",
            metadata={"node": self.node},
        )  # fmt: skip
        await self._micro.add_endpoint(
            name="config-set", subject=bus.node_config_set_subject(self.node),
            handler=self._on_set,
        )  # fmt: skip
        await self._micro.add_endpoint(
            name="config-get", subject=bus.node_config_get_subject(self.node),
            handler=self._on_get,
        )  # fmt: skip
        await bus.flush(self.nc)  # registered: a request from another connection now is answered

    async def _on_set(self, request: Request) -> None:
        refused = self.commands.node_command_refused(request._msg, self.node)
        if refused is not None:
            if refused.answerable:
                with contextlib.suppress(Exception):
                    await request.respond(encode(self.status(ok=False, reason=refused.reason)))
            return
        try:
            reply = await self.set_local(decode(request.data, NodeConfigSetRequest))
        except CodecError as exc:
            reply = self.status(ok=False, reason=f"bad NodeConfigSetRequest: {exc}"[:500])
        except Exception as exc:
            self.log.exception("node config set failed")
            reply = self.status(ok=False, reason=f"internal error: {exc}"[:500])
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    async def _on_get(self, request: Request) -> None:
        with contextlib.suppress(Exception):
            await request.respond(encode(self.status()))
