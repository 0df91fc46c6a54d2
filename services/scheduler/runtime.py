"""The running scheduler: watches that feed the index, the sweeper, the pod watch that releases
ended pods, the explain endpoint and the HTTP server. Built from its dependencies, so tests run
several replicas in one process against one NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service
from starlette.applications import Starlette

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.port import ClusterPort, WatchEvent
from tessera.codec import CodecError, decode, encode
from tessera.models import (
    AllocationState,
    ErrorReply,
    ExplainReply,
    ExplainRequest,
    NodeEvent,
    NodeLedger,
    NodeRegistration,
    QuotaState,
)
from tessera.settings import TesseraSettings

from .api import build_app
from .config import SchedulerSettings
from .engine import Scheduler
from .index import ClusterIndex
from .ledger import LedgerWriter
from .metrics import SchedulerMetrics

log = logging.getLogger("tessera.scheduler")
SERVICE_VERSION = "0.1.0"
_FINISHED_PHASES = ("Succeeded", "Failed")


def default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _init_containers_succeeded(pod: dict[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    wanted = len(spec.get("initContainers") or [])
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    if wanted == 0 or len(statuses) < wanted:
        return False
    for status in statuses:
        terminated = ((status or {}).get("state") or {}).get("terminated") or {}
        if terminated.get("exitCode") != 0:
            return False
    return True


class SchedulerService:
    def __init__(
        self,
        settings: TesseraSettings,
        config: SchedulerSettings,
        nc: NatsClient,
        js: JetStreamContext,
        buckets: Buckets,
        cluster: ClusterPort | None,
        *,
        instance: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.config = config
        self.nc = nc
        self.js = js
        self.buckets = buckets
        self.cluster = cluster
        self.clock = clock
        self.instance = instance or config.instance or default_instance()
        self.index = ClusterIndex(config.cordoned_uuids())
        self.metrics = SchedulerMetrics()
        self.scheduler = Scheduler(
            settings, config, self.index, LedgerWriter(buckets.ledger), nc, js, cluster,
            self.metrics, self.instance, clock,
        )  # fmt: skip
        self.nodes_synced = asyncio.Event()
        self.ledger_synced = asyncio.Event()
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._micro: Service | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.nodes_synced.is_set() and self.ledger_synced.is_set()

    def app(self) -> Starlette:
        return build_app(self.scheduler, self.ready, self.config.max_body_bytes)

    async def start(self) -> None:
        loops: list[Callable[[], Awaitable[None]]] = [
            self._watch_nodes,
            self._watch_ledger,
            self._sweep_loop,
        ]
        if self.settings.quota_enabled:
            loops.append(self._watch_quota)
        if self.cluster is not None:
            loops += [self._watch_pods, self._reconcile_loop]
        for loop in loops:
            self._tasks.append(asyncio.create_task(self._forever(loop)))
        explain = asyncio.create_task(self._register_explain())
        self._tasks.append(explain)
        with contextlib.suppress(TimeoutError):  # usually at once; else it keeps trying
            await asyncio.wait_for(asyncio.shield(explain), 2.0)

    async def _register_explain(self) -> None:
        """The explain endpoint, registered whenever NATS lets us: a broker that goes away
        while the scheduler starts must not stop it from starting (it used to time out here,
        end the service's main and leave the process unable to serve or stop)."""
        while not self.stopping.is_set():
            try:
                micro = await add_service(
                    self.nc,
                    name=bus.SCHEDULER_SERVICE,
                    version=SERVICE_VERSION,
                    description="why is this pod pending (HAMi reasons per node)",
                    metadata={"instance": self.instance},
                )
                await micro.add_endpoint(
                    name="explain", subject=bus.SCHEDULER_EXPLAIN, handler=self._on_explain
                )
                self._micro = micro
                return
            except Exception as exc:
                log.warning("explain endpoint not registered yet", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.5)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(
            asyncio.gather(self.nodes_synced.wait(), self.ledger_synced.wait()), timeout
        )
        self.metrics.ready.set(1)

    async def stop(self) -> None:
        self.stopping.set()
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
            self._micro = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()
        await self.scheduler.drain()

    def kill(self) -> None:
        """Stop abruptly, as a crash would (tests): no draining, nothing finished."""
        for task in self._tasks:
            task.cancel()

    async def serve_http(self, host: str, port: int) -> None:
        """Serve the extender until `stopping` is set."""
        config = uvicorn.Config(
            self.app(), host=host, port=port, log_config=None, access_log=False,
            ssl_certfile=self.config.tls_cert, ssl_keyfile=self.config.tls_key,
            timeout_graceful_shutdown=2,
        )  # fmt: skip
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        stopper = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stopper.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 3.0)

    async def _forever(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a loop; when it fails (NATS away, cluster hiccup) start it again."""
        while not self.stopping.is_set():
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("loop failed; restarting", extra={"loop": loop.__name__,
                                                              "err": str(exc)})  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.5)

    # --- watches ------------------------------------------------------------------------------
    async def _watch_nodes(self) -> None:
        seen: set[str] | None = set()
        async for key, value, _revision in bus.watch_models(
            self.buckets.nodes, NodeRegistration, self._bad_value
        ):
            now = self.clock()
            if not key:
                for name in [n for n, e in self.index.entries.items() if e.schedulable]:
                    if seen is not None and name not in seen:
                        self.index.set_registration(name, None, now)
                seen = None
                self.nodes_synced.set()
                continue
            if seen is not None:
                seen.add(key)
            if value is None and seen is None:
                await self._announce_lost(key, "registration deleted")
            self.index.set_registration(key, value, now)

    async def _watch_ledger(self) -> None:
        """Like bus.watch_models, but a revision the index already holds (this replica's own
        write, applied when it returned) is skipped before decoding: decoding is the cost."""
        seen: set[str] | None = set()
        watcher = await self.buckets.ledger.watchall()
        try:
            async for entry in watcher:
                now = self.clock()
                if entry is None:
                    for name in [n for n, e in self.index.entries.items() if e.ledger is not None]:
                        if seen is not None and name not in seen:
                            self.index.set_ledger(name, None, 0, now)
                    seen = None
                    self.ledger_synced.set()
                    continue
                key = entry.key
                if seen is not None:
                    seen.add(key)
                if entry.operation in ("DEL", "PURGE") or entry.value is None:
                    self.index.set_ledger(key, None, entry.revision, now)
                    continue
                known = self.index.entries.get(key)
                if known is not None and entry.revision <= known.ledger_revision:
                    continue
                value = self.scheduler.ledger.own_value(key, entry.value)
                if value is None:
                    try:
                        value = decode(entry.value, NodeLedger)
                    except CodecError as exc:
                        self._bad_value(key, exc)
                        continue
                self.index.set_ledger(key, value, entry.revision, now)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _watch_quota(self) -> None:
        async for key, value, _revision in bus.watch_models(
            self.buckets.quota, QuotaState, self._bad_value
        ):
            if not key:
                continue
            if value is None:
                self.scheduler.quotas.pop(key, None)
            else:
                self.scheduler.quotas[key] = value

    def _bad_value(self, key: str, exc: Exception) -> None:
        log.warning("undecodable KV value skipped", extra={"key": key, "err": str(exc)})

    async def _watch_pods(self) -> None:
        assert self.cluster is not None
        async for event in self.cluster.watch_pods():
            await self.on_pod_event(event)

    async def on_pod_event(self, event: WatchEvent) -> None:
        pod = event.object
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        node = self.index.pod_nodes.get(uid) if uid else None
        if node is None:
            return
        phase = (pod.get("status") or {}).get("phase")
        if event.type == "DELETED":
            await self.scheduler.release(node, uid, why="pod deleted")
        elif phase in _FINISHED_PHASES:
            await self.scheduler.release(node, uid, why=f"pod {phase.lower()}")
        elif _init_containers_succeeded(pod):
            entry = self.index.entries.get(node)
            allocation = entry.ledger.allocations.get(uid) if entry and entry.ledger else None
            if allocation is not None and allocation.init_count and not allocation.init_done:
                result = await self.scheduler.ledger.set_init_done(node, uid)
                if result is not None:
                    self.index.set_ledger(node, result.value, result.revision, self.clock())

    # --- periodic work ------------------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.config.sweep_interval_s)
            if self.ready():
                await self.scheduler.sweep()
                await self._drop_silent_nodes()

    async def _drop_silent_nodes(self) -> None:
        """A node whose heartbeat is long past the bucket TTL is gone even if no delete marker
        reached the watch."""
        now = self.clock()
        limit = 2 * self.settings.node_ttl_s
        for name, entry in list(self.index.entries.items()):
            if entry.registration is not None and now - entry.registration.heartbeat_at > limit:
                await self._announce_lost(name, f"no heartbeat for {limit:.0f} s")
                self.index.set_registration(name, None, now)

    async def _announce_lost(self, name: str, why: str) -> None:
        """Publish node.<name>.lost once per vanished registration. Every replica sees the same
        last heartbeat, so the event id (the dedupe key) is the same from all of them."""
        entry = self.index.entries.get(name)
        registration = entry.registration if entry is not None else None
        if registration is None:
            return
        event = NodeEvent(
            action="lost", node=name, source=self.instance, reason=why,
            device_uuids=[d.uuid for d in registration.devices],
            event_id=f"{name}:lost:{registration.heartbeat_at}",
        )  # fmt: skip
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            log.warning("could not publish node lost", extra={"node": name, "err": str(exc)})

    async def _reconcile_loop(self) -> None:
        """Release allocations of pods that no longer exist (deleted while no replica watched)."""
        assert self.cluster is not None
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.config.reconcile_interval_s)
            if not self.ready():
                continue
            listed_at = self.clock()
            pods = await self.cluster.list_pods()
            alive = {
                (p.get("metadata") or {}).get("uid")
                for p in pods
                if (p.get("status") or {}).get("phase") not in _FINISHED_PHASES
            }
            for uid, node in list(self.index.pod_nodes.items()):
                entry = self.index.entries.get(node)
                allocation = entry.ledger.allocations.get(uid) if entry and entry.ledger else None
                if allocation is None or uid in alive:
                    continue
                # Only allocations older than the listing: a pod created after it is not missing.
                if allocation.created_at < listed_at - 5.0:
                    await self.scheduler.release(node, uid, why="pod no longer exists")

    # --- explain ------------------------------------------------------------------------------
    async def _on_explain(self, request: Request) -> None:
        try:
            body = decode(request.data, ExplainRequest)
            reply: Any = self.explain(body)
        except CodecError as exc:
            reply = ErrorReply(reason=f"bad ExplainRequest: {exc}"[:500])
        except Exception as exc:
            log.exception("explain failed")
            reply = ErrorReply(reason=f"internal error: {type(exc).__name__}: {exc}"[:500])
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    def explain(self, body: ExplainRequest) -> ExplainReply:
        scheduler = self.scheduler
        uid = body.pod_uid
        if not uid and body.name:
            uid = self.index.pod_uid(body.namespace, body.name) or ""
        node = self.index.pod_nodes.get(uid) if uid else None
        if node is not None:
            entry = self.index.entries[node]
            allocation = entry.ledger.allocations[uid] if entry.ledger else None
            state = allocation.state if allocation else AllocationState.RESERVED
            pending = state == AllocationState.RESERVED
            return ExplainReply(
                ok=True, pending=pending, node=node,
                summary=f"{state.value} on {node}" + (" (waiting for bind)" if pending else ""),
                at=allocation.updated_at if allocation else None,
            )  # fmt: skip
        record = scheduler.failures.get(uid) if uid else None
        if record is None:
            record = scheduler.failures.get(f"{body.namespace}/{body.name}")
        if record is None:
            return ExplainReply(
                ok=True, pending=False,
                summary="no placement and no refusal recorded for this pod by this scheduler",
            )  # fmt: skip
        return ExplainReply(
            ok=True, pending=True, summary=record.summary, node_reasons=record.node_reasons,
            at=record.at,
        )  # fmt: skip
