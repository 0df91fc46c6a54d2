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
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service

from tessera import bus
from tessera.bus import Buckets, BusKeeper
from tessera.cluster.port import ClusterPort, WatchEvent, watch_pods_listed
from tessera.codec import CodecError, decode, encode
from tessera.models import (
    AllocationState,
    ErrorReply,
    ExplainReply,
    ExplainRequest,
    NodeEvent,
    NodeRegistration,
    PodGoneEvent,
    QuotaState,
    UsageSample,
)
from tessera.restore import init_containers_succeeded
from tessera.settings import TesseraSettings
from tessera.validation import Bounds, Problem, Rejections

from .api import Extender, build_app
from .config import SchedulerSettings
from .engine import Scheduler
from .foreign import ForeignCapacity
from .http_server import ExtenderServer, tls_context
from .index import ClusterIndex
from .ledger import LedgerWriter
from .metrics import SchedulerMetrics
from .pod_gate import PodGate
from .rebuild import LedgerRebuilder, ledger_cas, restore_rules
from .registration_codec import RegistrationCodec
from .stale import Listing
from .stale_release import release_stale
from .validation import LedgerGuard, cluster_rebuild
from .wire_fast import RegistrationWire

# Pod events handled between two yields to the loop: a listing is replayed in one go otherwise
# (80,000 pods: ~1.5 s during which no filter is answered); 500 take ~10 ms.
_REPLAY_SLICE = 500
log = logging.getLogger("tessera.scheduler")
SERVICE_VERSION = "0.1.0"
_FINISHED_PHASES = ("Succeeded", "Failed")


def default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


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
        keeper: BusKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.nc = nc
        self.js = js
        self.buckets = buckets
        self.cluster = cluster
        self.clock = clock  # the NATS server's clock in production (tessera.clock.ServerClock)
        self.keeper = keeper
        self.instance = instance or config.instance or default_instance()
        self.index = ClusterIndex(config.cordoned_uuids())
        self.metrics = SchedulerMetrics()
        self.scheduler = Scheduler(
            settings, config, self.index, LedgerWriter(buckets.ledger), nc, js, cluster,
            self.metrics, self.instance, clock,
        )  # fmt: skip
        self.rejections = Rejections(f"scheduler/{self.instance}", js, self.metrics.registry)
        self.foreign = ForeignCapacity(
            settings=settings, index=self.index, cluster=cluster, registry=self.metrics.registry,
            clock=clock,
        )  # fmt: skip
        self.guard = LedgerGuard(
            bounds=Bounds.of(settings), index=self.index, ledger_kv=buckets.ledger,
            rejections=self.rejections,
            rebuild=self.foreign.repairing(cluster_rebuild(cluster)) if cluster else None,
            clock=clock,
        )  # fmt: skip
        self.gate = PodGate(cluster)
        self.scheduler.pod_filter.pod_check = self.gate.check_identity
        self.scheduler.pod_filter.node_check = self.gate.placement_problem
        self.nodes_synced = asyncio.Event()
        self.ledger_synced = asyncio.Event()  # set after the sync *and* the rebuild from pods
        # The pod watch has replayed its first listing (it starts once ready: _watch_pods).
        self.pods_listed = asyncio.Event()
        self.scheduler.preemption.pods_listed = self.pods_listed
        self.stopping = asyncio.Event()
        self.rebuilder = (
            LedgerRebuilder(
                cluster=cluster, index=self.index,
                write=lambda node, mutate: ledger_cas(buckets.ledger, node, mutate),
                quota_enabled=settings.quota_enabled, claim_ttl_s=config.claim_ttl_s, clock=clock,
                foreign=self.foreign, rules=restore_rules(settings),
                registration_wait_s=3 * settings.node_heartbeat_s,
            )
            if cluster is not None else None
        )  # fmt: skip
        if self.rebuilder is not None:  # a forged or impossible restoration is announced
            self.rebuilder.on_problem = lambda line: self.rejections.reject(
                "ledger", "restore", Problem("restored_grant_refused", line[:480]),
                zlib.crc32(line.encode()),
            )
        self.rebuild_error = ""
        # node -> when its registration was last written, on the NATS server's clock (the KV
        # entry's own timestamp): "node lost" never compares one machine's clock to another's.
        self.heard: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._releasing: set[asyncio.Task[None]] = set()  # pod-watch releases in flight
        self._watch_tasks: list[asyncio.Task[None]] = []
        self._generation = keeper.generation if keeper is not None else 0  # the bus we synced
        self._micro: Service | None = None
        self._listed: set[str] = set()  # buckets whose start-up listing is complete
        self.registrations = RegistrationCodec()  # heartbeats without a decode

    # --- lifecycle ----------------------------------------------------------------------------
    def ready(self) -> bool:
        return not self.not_ready_reason()

    def not_ready_reason(self) -> str:
        """Why filters and binds are refused now ('' when serving)."""
        if self.keeper is not None and not self.keeper.ready:
            return f"scheduler not ready: {self.keeper.reason}"
        if self.keeper is not None and self.keeper.generation != self._generation:
            return "scheduler not ready: the buckets were re-created; the ledger is being rebuilt"
        synced = getattr(self.clock, "synced", None)
        if synced is not None and not synced.is_set():
            return "scheduler not ready: the NATS server's clock is not measured yet"
        if not self.nodes_synced.is_set():
            return "scheduler not ready: node registrations not synced yet"
        if not self.foreign.nodes_listed.is_set():
            return "scheduler not ready: the cluster's nodes (DRA or extender mode) not listed yet"
        if not self.ledger_synced.is_set():
            why = f" ({self.rebuild_error})" if self.rebuild_error else ""
            return f"scheduler not ready: the ledger is being synced and rebuilt from pods{why}"
        return ""

    def app(self) -> Extender:
        return build_app(
            self.scheduler, self.ready, self.config.max_body_bytes,
            refusing=self.not_ready_reason, guard=self.guard, gate=self.gate,
        )  # fmt: skip

    def probe_app(self) -> Extender:
        """Only /healthz, /readyz and /metrics: for kubelet and Prometheus, which present no
        client certificate to an mTLS extender."""
        return build_app(self.scheduler, self.ready, probes_only=True)

    async def start(self) -> None:
        self.index.defer_rebuilds()  # rows built once, when both buckets are listed
        loops: list[Callable[[], Awaitable[None]]] = [self._sweep_loop]
        if self.cluster is not None:
            loops += [self._watch_pods, self._reconcile_loop, self._watch_usage]
            if hasattr(self.cluster, "watch_nodes"):
                loops.append(self.foreign.watch_nodes)  # HAMi's node registrations
            else:
                self.foreign.nodes_listed.set()
        else:
            self.foreign.nodes_listed.set()
        if self.keeper is not None:
            loops.append(self._follow_bus)
        for loop in loops:
            self._tasks.append(asyncio.create_task(self._forever(loop)))
        self._start_watches()
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
                await bus.flush(self.nc)  # registered before it counts as served
                self._micro = micro
                return
            except Exception as exc:
                log.warning("explain endpoint not registered yet", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.5)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        waits = [self.nodes_synced.wait(), self.ledger_synced.wait(),
                 self.foreign.nodes_listed.wait()]
        synced = getattr(self.clock, "synced", None)
        if synced is not None:
            waits.append(synced.wait())
        await asyncio.wait_for(asyncio.gather(*waits), timeout)
        self.metrics.ready.set(1)

    async def stop(self) -> None:
        self.stopping.set()
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
            self._micro = None
        if self._releasing:  # let the watch's releases finish (each one a ledger write)
            await asyncio.wait(set(self._releasing), timeout=5.0)
        tasks = [*self._tasks, *self._watch_tasks, *self._releasing]
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a loop stuck in a call that ignores cancellation (a NATS request on a
            # dead connection) must not hold the process up; it is named and left behind.
            _done, stuck = await asyncio.wait(tasks, timeout=10.0)
            for task in stuck:
                log.warning("task did not stop within 10 s", extra={"task": task.get_name()})
        self._tasks.clear()
        self._watch_tasks.clear()
        await self.guard.stop()
        await self.scheduler.drain()
        await self.rejections.drain()

    def kill(self) -> None:
        """Stop abruptly, as a crash would (tests): no draining, nothing finished."""
        for task in [*self._tasks, *self._watch_tasks, *self._releasing]:
            task.cancel()

    # --- the bus lost its store ---------------------------------------------------------------
    def _start_watches(self) -> None:
        loops: list[Callable[[], Awaitable[None]]] = [self._watch_nodes, self._watch_ledger]
        if self.settings.quota_enabled:
            loops.append(self._watch_quota)
        self._watch_tasks = [asyncio.create_task(self._forever(loop)) for loop in loops]

    async def _follow_bus(self) -> None:
        """When the buckets were re-created (NATS lost its store), everything the index learnt
        from them is void: stop serving, forget it, watch again, and rebuild the ledger from the
        cluster's pods before the next filter."""
        assert self.keeper is not None
        seen = self.keeper.generation
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.2)
            if self.keeper.generation == seen:
                continue
            seen = self.keeper.generation
            log.warning("buckets re-created: re-syncing and rebuilding the ledger",
                        extra={"generation": seen})  # fmt: skip
            self.nodes_synced.clear()
            self.ledger_synced.clear()
            self.metrics.ready.set(0)
            for task in self._watch_tasks:
                task.cancel()
            for task in self._watch_tasks:
                with contextlib.suppress(BaseException):
                    await task
            now = self.clock()
            for name in list(self.index.entries):
                self.index.set_ledger(name, None, 0, now)
            self.scheduler.quotas.clear()
            self._generation = seen
            self._start_watches()

    async def serve_http(self, host: str, port: int, *, probes_only: bool = False) -> None:
        """Serve the extender until `stopping` is set (http_server.py). With
        `TESSERA_TLS_CLIENT_CA` the TLS handshake itself refuses any caller without a client
        certificate that CA signed."""
        tls = None
        cert, key = self.config.tls_cert, self.config.tls_key
        if not probes_only and (cert or key):
            tls = tls_context(cert or "", key, self.config.tls_client_ca or None)
        server = ExtenderServer(self.probe_app() if probes_only else self.app(), tls)
        try:
            await server.serve(host, port, self.stopping)
        except OSError as exc:  # the address is taken: end the process, as uvicorn did
            log.error("cannot listen", extra={"listen": f"{host}:{port}", "err": str(exc)})
            raise SystemExit(1) from exc

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
        watcher = bus.watch_entries(self.buckets.nodes)  # its sync marker can be trusted
        try:
            async for entry in watcher:
                now = self.clock()
                if entry is None:
                    for name in [n for n, e in self.index.entries.items() if e.schedulable]:
                        if seen is not None and name not in seen:
                            self.index.set_registration(name, None, now)
                    seen = None
                    self._listed.add("nodes")
                    self._flush_when_listed(now)
                    self.nodes_synced.set()
                    continue
                key = entry.key
                if seen is not None:
                    seen.add(key)
                value: NodeRegistration | RegistrationWire | None = None
                if entry.operation not in ("DEL", "PURGE") and entry.value is not None:
                    # A heartbeat: the last valid registration, re-dated (no decode, no checks).
                    value = self.registrations.heartbeat_only(key, entry.value)
                    if value is None:
                        try:
                            value = self.registrations.read(entry.value)
                        except CodecError as exc:
                            self.guard.registration_undecodable(key, exc)
                            continue
                        if not self.guard.registration_ok(key, value, entry.revision):
                            continue  # never applied: the node keeps its last valid registration
                        self.registrations.accepted(key, entry.value, value)
                if value is None:
                    self.registrations.forget(key)
                    self.heard.pop(key, None)
                    if seen is None:
                        await self._announce_lost(key, "registration deleted")
                else:
                    self.heard[key] = entry.created_s  # the NATS server's clock
                self.index.set_registration(key, value, now)
        finally:
            with contextlib.suppress(Exception):
                await watcher.aclose()

    async def _watch_ledger(self) -> None:
        """Like bus.watch_models, but a revision the index already holds (this replica's own
        write, applied when it returned) is skipped before decoding: decoding is the cost."""
        seen: set[str] | None = set()
        watcher = bus.watch_entries(self.buckets.ledger)  # its sync marker can be trusted
        try:
            async for entry in watcher:
                now = self.clock()
                if entry is None:
                    for name in [n for n, e in self.index.entries.items() if e.view is not None]:
                        if seen is not None and name not in seen:
                            self.index.set_ledger(name, None, 0, now)
                    seen = None
                    await self._rebuild_from_pods()
                    self._listed.add("ledger")
                    self._flush_when_listed(self.clock())
                    self.ledger_synced.set()
                    continue
                key = entry.key
                if seen is not None:
                    seen.add(key)
                if entry.operation in ("DEL", "PURGE") or entry.value is None:
                    self.guard.ledger_valid(key)
                    self.scheduler.ledger.codec.forget(key)
                    self.index.set_ledger(key, None, entry.revision, now)
                    continue
                known = self.index.entries.get(key)
                if known is not None and entry.revision <= known.ledger_revision:
                    continue
                value = self.scheduler.ledger.own_value(key, entry.value)
                if value is None:
                    try:
                        value = self.scheduler.ledger.codec.read(key, entry.value)
                    except CodecError as exc:
                        # Quarantined and repaired; the index keeps the last valid value.
                        self.guard.ledger_rejected(
                            key, entry.revision, Problem("undecodable", str(exc)[:300])
                        )
                        continue
                    if not self.guard.ledger_ok(key, value, entry.revision):
                        continue
                else:
                    self.guard.ledger_valid(key)
                self.index.set_ledger(key, value, entry.revision, now)
                self.scheduler.preemption.observe_ledger(key, value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.aclose()

    def _flush_when_listed(self, now: float) -> None:
        """Build the index rows deferred during the start-up listing once both buckets are
        listed (before either sync event is set, so nothing is served on unbuilt rows)."""
        if self._listed >= {"nodes", "ledger"}:
            self.index.flush_rebuilds(now)

    async def _rebuild_from_pods(self) -> None:
        """Restore what the ledger lacks from the pods' annotations (see rebuild.py). Runs after
        every (re)sync of the ledger, before the scheduler serves: a lost or empty ledger can
        never let a new pod onto GPUs that running pods hold. A failure (cluster API away) is
        raised: the watch restarts and tries again, and filters stay refused meanwhile."""
        if self.rebuilder is None:
            return
        try:
            report = await self.rebuilder.rebuild()
        except Exception as exc:
            self.rebuild_error = f"rebuild from pods failed: {type(exc).__name__}: {exc}"[:300]
            raise
        self.rebuild_error = ""
        self.metrics.ledger_restored.inc(report.restored)
        listing, self.rebuilder.listed = self.rebuilder.listed, None
        if self.config.release_missing_pods and listing is not None:
            # Pods deleted while no scheduler watched (stale.py). No grace for allocations
            # written near the listing: the ledger watch waits for this rebuild, so every
            # allocation the index holds was read before the listing began, and the pod of one
            # that was bound existed before it too; a consistent listing that lacks the pod
            # means it is gone. (A grace of seconds kept a quickly restarted stack's previous
            # allocations until the periodic pass, whole cards Pending meanwhile.)
            await release_stale(self.index, listing, self.scheduler.release, skew_s=0.0)

    async def _watch_quota(self) -> None:
        async for key, value, revision in bus.watch_models(
            self.buckets.quota, QuotaState, self.guard.quota_undecodable
        ):
            if not key:
                continue
            if value is not None and not self.guard.quota_ok(key, value, revision):
                continue
            if value is None:
                self.scheduler.quotas.pop(key, None)
            else:
                self.scheduler.quotas[key] = value

    async def _watch_pods(self) -> None:
        """Started once ready: its first listing (every pod of the cluster, replayed through
        `on_pod_event`: ~1.5 CPU s at 80,000 pods) runs while the scheduler serves instead of
        before. Meanwhile the gate looks each pod up (`get_pod`), releases and init marks wait
        for it, and preemption neither starts nor ends a nomination on pod facts it lacks
        (`pods_listed`). What ready guarantees is unchanged: the ledger was listed and rebuilt
        from the pods before (`_rebuild_from_pods`)."""
        assert self.cluster is not None
        await asyncio.gather(self.nodes_synced.wait(), self.ledger_synced.wait())
        events = watch_pods_listed(self.cluster)
        count = 0
        async with contextlib.aclosing(events):
            async for event in events:
                if event is None:
                    self.pods_listed.set()
                    continue
                await self.on_pod_event(event)
                count += 1
                if count % _REPLAY_SLICE == 0:  # a listing's replay lets filters in meanwhile
                    await asyncio.sleep(0)

    async def on_pod_event(self, event: WatchEvent) -> None:
        self.gate.observe(event)
        self.foreign.on_pod_event(event)
        self.scheduler.preemption.observe_pod(event)
        pod = event.object
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        node = self.index.pod_nodes.get(uid) if uid else None
        if node is None:
            if event.type == "DELETED":
                await self._pending_pod_gone(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if event.type == "DELETED":
            self._release_soon(node, uid, "pod deleted")
        elif phase in _FINISHED_PHASES:
            self._release_soon(node, uid, f"pod {phase.lower()}")
        else:
            # The allocation first, read as the index holds it (no model built): only one still
            # waiting for its init containers asks the pod. A restart's watch replays every
            # running pod through here.
            entry = self.index.entries.get(node)
            view = entry.view if entry is not None else None
            held = view.allocations.get(uid) if view is not None else None
            if (held is not None and held.init_count and not held.init_done
                    and init_containers_succeeded(pod)):  # fmt: skip
                result = await self.scheduler.ledger.set_init_done(node, uid)
                if result is not None:
                    self.index.set_ledger(node, result.value, result.revision, self.clock())

    def _release_soon(self, node: str, uid: str, why: str) -> None:
        """Release off the pod watch. Awaited in turn, each release (a ledger round trip, more
        on a loaded machine) held back every later pod event: in a burst, deleted pods' GPUs
        stayed held for up to 38 s (tests/scheduler/test_concurrency.py beside two CPU hogs),
        past the README's bound, and new pods were refused meanwhile. A release that fails is
        logged and left to the reconcile; it no longer restarts the watch."""

        async def release() -> None:
            try:
                await self.scheduler.release(node, uid, why=why)
            except Exception as exc:
                log.warning("release failed; the reconcile retries it",
                            extra={"pod_uid": uid, "node": node, "err": str(exc)})  # fmt: skip

        task = asyncio.create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _watch_usage(self) -> None:
        """The node agents' usage samples: preemption releases a victim only once its node
        reports the GPU memory back (a sample that does not decode, or names another node than
        its subject, is ignored)."""
        sub = await self.nc.subscribe(bus.USAGE_ALL)
        try:
            async for msg in sub.messages:
                try:
                    sample = decode(msg.data, UsageSample)
                except CodecError:
                    continue
                if msg.subject != bus.usage_subject(sample.node):
                    continue
                self.scheduler.preemption.observe_usage(sample)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _pending_pod_gone(self, pod: dict[str, Any]) -> None:
        """A deleted pod that holds no allocation: forget its refusal (explain) and tell the bus
        (dashboard, tessera_pods_pending), once per pod (the event id dedupes replicas)."""
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        namespace, name, uid = meta.get("namespace") or "default", meta.get("name"), meta.get("uid")
        if not name or spec.get("nodeName"):
            return
        remembered = self.scheduler.failures.forget_pod(uid or "", namespace, name)
        if not remembered and spec.get("schedulerName") != self.settings.scheduler_name:
            return
        event = PodGoneEvent(namespace=namespace, name=name, pod_uid=uid or "",
                             source=self.instance, reason="pod deleted before it was placed",
                             event_id=f"{uid or namespace + '/' + name}:gone")
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            log.warning("could not publish pod gone", extra={"pod": name, "err": str(exc)})

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
        cutoff = now - limit  # one float comparison per node: this runs every sweep
        for name in [n for n, heard in self.heard.items() if heard < cutoff]:
            entry = self.index.entries.get(name)
            heard = self.heard.get(name)
            if entry is not None and entry.registration is not None and heard is not None and (
                now - heard > limit
            ):
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
            self.foreign.load(pods, listed_at)
            if self.config.release_missing_pods:
                listing = Listing.of_pods(pods, listed_at, self.index.pod_nodes)
                await release_stale(self.index, listing, self.scheduler.release)

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
        waiting = scheduler.preemption.waiting_summary(uid) if uid else None
        if waiting is not None:
            return ExplainReply(ok=True, pending=True, node=waiting[0], summary=waiting[1],
                                at=self.clock())  # fmt: skip
        if node is not None:
            entry = self.index.entries[node]
            allocation = entry.ledger.allocations[uid] if entry.ledger else None
            state = allocation.state if allocation else AllocationState.RESERVED
            if state == AllocationState.RESERVED and uid in scheduler.releaser.bound_unmarked:
                state = AllocationState.BOUND  # bound; the mark is left to its Allocate
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
