"""Filter, prioritize and bind: the decision (pure) joined to the ledger, quota and cluster (I/O).

The HTTP layer (api.py) only translates JSON; the watch loops (runtime.py) feed the index and
call `release_pod` / `sweep`. Everything this class needs is passed in (no globals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from tessera import bus, hami
from tessera.bus import CasConflictError, NoChange
from tessera.cluster.port import ClusterError, ClusterPort, ConflictError
from tessera.codec import CodecError, decode, encode
from tessera.hami import PodRequest, RequestError
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    DeviceGrant,
    ErrorReply,
    NodeLedger,
    QuotaReply,
    QuotaRequest,
    QuotaState,
    SchedulingFailedEvent,
)
from tessera.settings import TesseraSettings

from .config import SchedulerSettings
from .decide import Decision, decide, prioritize_scores
from .index import ClusterIndex
from .ledger import (
    AlreadyBoundError,
    ClaimHeldError,
    LedgerWriter,
    NodeFullError,
    ReservationGoneError,
    ReservationRequest,
)
from .metrics import SchedulerMetrics
from .rules import (
    REQUEST_INVALID,
    RESOURCE_QUOTA_NOT_FIT,
    FitContext,
    PodOptions,
    QuotaBudget,
    parse_pod_options,
)

log = logging.getLogger("tessera.scheduler")
_FAILURE_MEMORY = 10_000
_REPUBLISH_SAME_FAILURE_S = 30.0


_NO_GPU = "\0no-gpu"  # _ensure_reserved's answer for a pod that asks for no GPU


class BadRequestError(ValueError):
    """The call itself is malformed (HTTP 400)."""


@dataclass
class FilterOutcome:
    nodenames: list[str] | None = None
    passed_all: bool = False  # the pod asks for no GPU: every node passes untouched
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""


@dataclass
class FailureRecord:
    node_reasons: dict[str, str]
    summary: str
    at: float


@dataclass(frozen=True)
class PodIdentity:
    uid: str
    namespace: str
    name: str

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodIdentity:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
            raise BadRequestError("pod.metadata.name is required")
        uid = meta.get("uid") or ""
        namespace = meta.get("namespace") or "default"
        if not isinstance(uid, str) or not isinstance(namespace, str):
            raise BadRequestError("pod.metadata.uid and namespace must be strings")
        return cls(uid, namespace, meta["name"])


def grants_charge(containers: list[list[DeviceGrant]], init_count: int) -> tuple[int, int, int]:
    """(memory, cores, gpus) for quota as HAMi counts it: app summed, init by max."""

    def total(grants: list[list[DeviceGrant]]) -> tuple[int, int, int]:
        return (
            sum(g.memory_mib for c in grants for g in c),
            sum(g.cores for c in grants for g in c),
            sum(len(c) for c in grants),
        )

    app = total(containers[init_count:])
    peaks = [total([c]) for c in containers[:init_count]]
    return tuple(max([app[i], *(p[i] for p in peaks)]) for i in range(3))  # type: ignore[return-value]


class Scheduler:
    def __init__(
        self,
        settings: TesseraSettings,
        config: SchedulerSettings,
        index: ClusterIndex,
        ledger: LedgerWriter,
        nc: NatsClient,
        js: JetStreamContext,
        cluster: ClusterPort | None,
        metrics: SchedulerMetrics,
        instance: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.config = config
        self.index = index
        self.ledger = ledger
        self.nc = nc
        self.js = js
        self.cluster = cluster
        self.metrics = metrics
        self.instance = instance
        self.clock = clock
        self.quotas: dict[str, QuotaState] = {}
        self.failures: OrderedDict[str, FailureRecord] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- background work --------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 3.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def _publish(self, event: Any) -> None:
        try:
            await bus.publish_event(self.js, event, attempts=3)
        except Exception as exc:
            log.warning("event publish failed", extra={"event": type(event).__name__,
                                                       "err": str(exc)})  # fmt: skip

    def _hint(self, node: str) -> bus.Versioned[NodeLedger] | None:
        entry = self.index.entries.get(node)
        if entry is None or entry.ledger is None:
            return None
        return bus.Versioned(entry.ledger, entry.ledger_revision)

    def _apply(self, node: str, result: bus.Versioned[NodeLedger] | None) -> None:
        if result is not None:
            self.index.set_ledger(node, result.value, result.revision, self.clock())

    def learn_node_objects(self, nodes: list[Any]) -> None:
        """Full Node objects (the `nodes` path) carry hami.io/device-cordon: remember it."""
        now = self.clock()
        for node in nodes:
            meta = node.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            text = (
                annotations.get(hami.ANN_DEVICE_CORDON, "") if isinstance(annotations, dict) else ""
            )
            uuids = frozenset(u.strip() for u in str(text).split(",") if u.strip())
            if meta.get("name") in self.index.entries:
                self.index.set_cordon(meta["name"], uuids, now)

    # --- filter -------------------------------------------------------------------------------
    def parse(self, pod: dict[str, Any]) -> tuple[PodRequest, PodOptions]:
        return hami.parse_pod_request(pod, self.settings), parse_pod_options(pod, self.settings)

    def budget(self, namespace: str, uid: str) -> QuotaBudget:
        state = self.quotas.get(namespace) if self.settings.quota_enabled else None
        if state is None:
            return QuotaBudget()
        charges = [c for k, c in state.charges.items() if k != uid]
        limits = state.limits

        def left(limit: int | None, used: int) -> int | None:
            return None if limit is None else max(0, limit - used)

        return QuotaBudget(
            left(limits.memory_mib, sum(c.memory_mib for c in charges)),
            left(limits.cores, sum(c.cores for c in charges)),
        )

    async def filter(
        self, pod: dict[str, Any], names: list[str], *, dry_run: bool = False
    ) -> FilterOutcome:
        ident = PodIdentity.of(pod)
        try:
            request, options = self.parse(pod)
        except RequestError as exc:
            return self._refuse_invalid(ident, names, str(exc))
        if not request.wants_gpu:
            return FilterOutcome(nodenames=list(names), passed_all=True)
        if not dry_run and not ident.uid:
            raise BadRequestError("pod.metadata.uid is required")
        if not dry_run:
            held = self.index.pod_nodes.get(ident.uid)
            if held is not None:
                entry = self.index.entries.get(held)
                known = entry.ledger.allocations.get(ident.uid) if entry and entry.ledger else None
                if held in names and known is not None and _live(known, self.clock()):
                    return FilterOutcome(nodenames=[held])  # a retried filter: keep it
                why = "reservation lapsed" if held in names else "rescheduled to other candidates"
                await self.release(held, ident.uid, why=why)
        started = time.perf_counter()
        decision = decide(
            self.index, request, options, names, self.budget(ident.namespace, ident.uid),
            self.config.avoid_busy_nodes,
        )  # fmt: skip
        if dry_run:
            fitting = [entry.name for entry, _fit in decision.fits()]
            self.metrics.fit_seconds.observe(time.perf_counter() - started)
            decision.explain_rest()
            return FilterOutcome(nodenames=fitting, failed=decision.failed)
        container_names = _container_names(pod)
        placed, quota_refusal = await self._place(
            ident, request, options, decision, started, container_names
        )
        if placed is not None:
            self.failures.pop(ident.uid, None)
            return FilterOutcome(nodenames=[placed], failed=decision.failed)
        if quota_refusal:
            failed = {n: quota_refusal for n in names}
            self._count_refusal({RESOURCE_QUOTA_NOT_FIT: len(names)})
            self._remember_failure(ident, failed, quota_refusal)
            return FilterOutcome(failed=failed)
        decision.explain_rest()
        self._count_refusal(decision.reason_counts)
        summary = f"0/{len(names)} nodes fit the GPU request"
        self._remember_failure(ident, decision.failed, summary)
        return FilterOutcome(failed=decision.failed)

    async def _place(
        self,
        ident: PodIdentity,
        request: PodRequest,
        options: PodOptions,
        decision: Decision,
        started: float,
        container_names: list[str],
    ) -> tuple[str | None, str]:
        """Reserve on the best node that still fits at CAS time: (node, quota refusal text)."""
        timed = False
        held_charge: tuple[int, int, int] | None = None
        for entry, fit in decision.fits():
            if not timed:
                self.metrics.fit_seconds.observe(time.perf_counter() - started)
                timed = True
            charge = grants_charge(fit.containers, len(request.init))
            if self.settings.quota_enabled and charge != held_charge:
                refusal = await self._reserve_quota(ident, charge)
                if refusal:
                    return None, refusal
                held_charge = charge
            template = Allocation(
                pod_uid=ident.uid, namespace=ident.namespace, name=ident.name, node=entry.name,
                containers=[], init_count=len(request.init),
                priority=next((r.priority for r in request.all if r and r.priority is not None),
                              1),
                core_policy=self.settings.core_policy,
                container_names=container_names,
                quota_held=held_charge is not None,
            )  # fmt: skip
            assert entry.registration is not None
            reservation = ReservationRequest(
                registration=entry.registration,
                cordoned=self.index.cordon_of(entry),
                request=request,
                ctx_factory=lambda: FitContext(options, QuotaBudget()),
                template=template,
                now=self.clock(),
                ttl_s=self.settings.reservation_ttl_s,
            )
            # Other filters running while this CAS is in flight should look elsewhere first.
            self.index.busy[entry.slot] = True
            try:
                result = await self.ledger.reserve(reservation, self._hint(entry.name))
            except NodeFullError as exc:
                decision.record(entry.name, exc.fit)
                continue
            except (CasConflictError, NoChange):
                continue
            self._apply(entry.name, result)
            allocation = result.value.allocations.get(ident.uid)
            self.metrics.placed.inc()
            self.spawn(self._publish(AllocationEvent(
                event_id=f"{ident.uid}:{entry.name}:reserved", action="reserved", node=entry.name,
                pod_uid=ident.uid, namespace=ident.namespace, name=ident.name,
                containers=allocation.containers if allocation else [], source=self.instance,
            )))  # fmt: skip
            return entry.name, ""
        if held_charge is not None:
            self.spawn(self._release_quota(ident.namespace, ident.uid, ident.name))
        return None, ""

    def _refuse_invalid(self, ident: PodIdentity, names: list[str], message: str) -> FilterOutcome:
        reason = f"{REQUEST_INVALID}: {message}"
        unresolvable = {n: reason for n in names}
        self._count_refusal({REQUEST_INVALID: len(names)})
        self._remember_failure(ident, unresolvable, reason)
        return FilterOutcome(unresolvable=unresolvable)

    def _count_refusal(self, counts: dict[str, int]) -> None:
        """One unschedulable pod; per reason, how many nodes refused it for that reason."""
        self.metrics.unschedulable.inc()
        for reason, nodes in counts.items():
            self.metrics.refusals.labels(reason=reason).inc(nodes)

    def _remember_failure(self, ident: PodIdentity, reasons: dict[str, str], summary: str) -> None:
        now = self.clock()
        key = ident.uid or f"{ident.namespace}/{ident.name}"
        previous = self.failures.pop(key, None)
        self.failures[key] = FailureRecord(reasons, summary, now)
        self.failures[f"{ident.namespace}/{ident.name}"] = self.failures[key]
        while len(self.failures) > _FAILURE_MEMORY:
            self.failures.popitem(last=False)
        if (
            previous is not None
            and previous.node_reasons == reasons
            and now - previous.at < _REPUBLISH_SAME_FAILURE_S
        ):
            return
        self.spawn(self._publish(SchedulingFailedEvent(
            namespace=ident.namespace, name=ident.name, pod_uid=ident.uid, reason=summary,
            node_reasons=dict(list(reasons.items())[:200]), source=self.instance,
        )))  # fmt: skip

    # --- quota ----------------------------------------------------------------------------------
    async def _reserve_quota(self, ident: PodIdentity, charge: tuple[int, int, int]) -> str:
        """'' when held, else the refusal text (a timeout is a refusal, never a hang)."""
        memory, cores, gpus = charge
        body = QuotaRequest(namespace=ident.namespace, pod_uid=ident.uid, name=ident.name,
                            memory_mib=memory, cores=cores, gpus=gpus)  # fmt: skip
        timeout = self.settings.request_timeout_s
        try:
            msg = await self.nc.request(bus.QUOTA_RESERVE, encode(body), timeout=timeout)
            reply = decode(msg.data, QuotaReply)
        except (NatsTimeoutError, NoRespondersError, TimeoutError):
            return f"{RESOURCE_QUOTA_NOT_FIT}: quota service did not answer within {timeout:g} s"
        except CodecError as exc:
            try:
                error = decode(msg.data, ErrorReply)
            except CodecError:
                return f"{RESOURCE_QUOTA_NOT_FIT}: quota service answered garbage: {exc}"
            return f"{RESOURCE_QUOTA_NOT_FIT}: quota service error: {error.reason}"
        if not reply.ok:
            return f"{RESOURCE_QUOTA_NOT_FIT}: {reply.reason or 'namespace quota exceeded'}"
        return ""

    async def _release_quota(self, namespace: str, uid: str, name: str = "") -> None:
        body = QuotaRequest(namespace=namespace, pod_uid=uid, name=name)
        try:
            await self.nc.request(bus.QUOTA_RELEASE, encode(body),
                                  timeout=self.settings.request_timeout_s)  # fmt: skip
        except Exception as exc:
            log.warning("quota release failed", extra={"pod_uid": uid, "err": str(exc)})

    # --- prioritize ---------------------------------------------------------------------------
    def prioritize(self, pod: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
        ident = PodIdentity.of(pod)
        held = self.index.pod_nodes.get(ident.uid) if ident.uid else None
        if held is not None:
            return [{"host": n, "score": 10 if n == held else 0} for n in names]
        try:
            _request, options = self.parse(pod)
        except RequestError:
            return [{"host": n, "score": 0} for n in names]
        scores = prioritize_scores(self.index, options, names)
        return [{"host": n, "score": s} for n, s in zip(names, scores, strict=True)]

    # --- bind ---------------------------------------------------------------------------------
    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """'' on success, else the error text kube-scheduler shows."""
        if not self.cluster:
            return "no cluster API configured: this scheduler cannot bind pods"
        if not uid:
            try:
                uid = (await self.cluster.get_pod(namespace, name))["metadata"]["uid"]
            except (ClusterError, KeyError) as exc:
                return f"pod {namespace}/{name}: {exc}"
        ident = PodIdentity(uid, namespace, name)
        error = await self._ensure_reserved(ident, node)
        if error == _NO_GPU:
            return await self._bind_plain(ident, node)
        if error:
            return error
        deadline = self.clock() + self.config.bind_timeout_s
        waited = False
        while True:
            now = self.clock()
            try:
                result = await self.ledger.claim(
                    node, uid, self.instance, now, self.config.claim_ttl_s, self._hint(node)
                )
                break
            except ClaimHeldError as exc:
                if not waited:
                    self.metrics.claim_waits.inc()
                    waited = True
                remaining = deadline - now
                if remaining <= 0:
                    return (f"node {node} is busy: {exc.claim.namespace}/{exc.claim.name} holds "
                            f"its in-flight claim; retry")  # fmt: skip
                until_lapse = exc.claim.expires_at - now + 0.01
                await self.index.wait_changed(node, min(remaining, until_lapse))
            except ReservationGoneError as exc:
                # Our reservation lapsed while we waited for the claim: take a fresh one if
                # the pod still fits the node, and keep waiting within the same deadline.
                if self.clock() >= deadline:
                    return f"pod {namespace}/{name} on {node}: {exc}; it will be filtered again"
                error = await self._ensure_reserved(ident, node, trust_index=False)
                if error:
                    return error
                await asyncio.sleep(0.01)  # never a tight loop, whatever the ledger says
            except AlreadyBoundError:
                return ""
            except CasConflictError as exc:
                return f"ledger busy on {node}: {exc}"
        self._apply(node, result)
        allocation = result.value.allocations[uid]
        error = await self._bind_in_cluster(ident, node, allocation)
        if error:
            await self.release(node, uid, why=f"bind failed: {error}")
            return error
        await self._mark_bound(node, uid)
        self.metrics.bound.inc()
        self.spawn(self._publish(AllocationEvent(
            event_id=f"{uid}:bound", action="bound", node=node, pod_uid=uid,
            namespace=namespace, name=name, containers=allocation.containers,
            source=self.instance,
        )))  # fmt: skip
        return ""

    async def _mark_bound(self, node: str, uid: str, attempts: int = 3) -> None:
        """Record the cluster bind in the ledger. The pod is bound whatever happens here, so a
        failure (NATS away) is retried, then left to the sweeper, which adopts binds the cluster
        shows; it never turns into a bind error kube-scheduler would act on."""
        for attempt in range(1, attempts + 1):
            try:
                bound = await self.ledger.mark_bound(node, uid, self.clock(), self._hint(node))
                self._apply(node, bound)
                return
            except NoChange:
                return  # already bound, or the node agent has marked it allocated
            except ReservationGoneError as exc:
                log.warning("mark bound: reservation gone", extra={"pod_uid": uid, "err": str(exc)})
                return
            except Exception as exc:
                log.warning("mark bound failed", extra={"pod_uid": uid, "attempt": attempt,
                                                        "err": str(exc)})  # fmt: skip
                await asyncio.sleep(0.05 * attempt)

    async def _ensure_reserved(
        self, ident: PodIdentity, node: str, *, trust_index: bool = True
    ) -> str:
        """The pod must hold a live reservation on `node`; make one if filter did not (the
        side-effect-free path, another replica's expired one, a different node)."""
        now = self.clock()
        entry = self.index.entries.get(node)
        known = entry.ledger.allocations.get(ident.uid) if entry and entry.ledger else None
        if trust_index and known is not None and _live(known, now):
            return ""  # our index saw the reservation (ours, or a replica's via the watch)
        current = await bus.read(self.ledger.kv, node, NodeLedger)
        if current is not None:
            self._apply(node, current)
            existing = current.value.allocations.get(ident.uid)
            if (
                existing is not None
                and existing.active
                and not (
                    existing.state == AllocationState.RESERVED
                    and existing.expires_at is not None
                    and existing.expires_at <= now
                )
            ):
                return ""
        held = self.index.pod_nodes.get(ident.uid)
        if held is not None and held != node:
            await self.release(held, ident.uid, why=f"kube-scheduler bound it to {node}")
        assert self.cluster is not None
        try:
            pod = await self.cluster.get_pod(ident.namespace, ident.name)
        except ClusterError as exc:
            return f"pod {ident.namespace}/{ident.name}: {exc}"
        outcome = await self.filter(pod, [node])
        if outcome.passed_all:
            return _NO_GPU
        if outcome.nodenames == [node]:
            return ""
        reasons = outcome.failed.get(node) or outcome.unresolvable.get(node) or outcome.error
        return f"pod {ident.namespace}/{ident.name} does not fit {node}: {reasons}"

    async def _bind_plain(self, ident: PodIdentity, node: str) -> str:
        """A pod that asks for no GPU: bind it, nothing to record."""
        assert self.cluster is not None
        try:
            await self.cluster.bind_pod(ident.namespace, ident.name, ident.uid, node)
        except ClusterError as exc:
            return f"bind {ident.namespace}/{ident.name} to {node}: {exc}"
        return ""

    async def _bind_in_cluster(self, ident: PodIdentity, node: str, allocation: Allocation) -> str:
        assert self.cluster is not None
        now = str(int(self.clock()))
        try:
            await self.cluster.patch_pod_metadata(
                ident.namespace,
                ident.name,
                annotations={
                    hami.ANN_DEVICES_TO_ALLOCATE: hami.encode_pod_devices(allocation.containers),
                    hami.ANN_VGPU_NODE: node,
                    hami.ANN_VGPU_TIME: now,
                    hami.ANN_BIND_TIME: now,
                    hami.ANN_BIND_PHASE: hami.BIND_PHASE_ALLOCATING,
                },
                labels={hami.LABEL_VGPU_NODE: node},
            )
            await self.cluster.bind_pod(ident.namespace, ident.name, ident.uid, node)
        except ConflictError as exc:
            with contextlib.suppress(ClusterError):
                pod = await self.cluster.get_pod(ident.namespace, ident.name)
                if (pod.get("spec") or {}).get("nodeName") == node:
                    return ""  # a retried bind that already happened
            return f"bind {ident.namespace}/{ident.name} to {node}: {exc}"
        except (ClusterError, ValueError) as exc:
            with contextlib.suppress(ClusterError):
                await self.cluster.patch_pod_metadata(
                    ident.namespace, ident.name,
                    annotations={hami.ANN_BIND_PHASE: hami.BIND_PHASE_FAILED},
                )  # fmt: skip
            return f"bind {ident.namespace}/{ident.name} to {node}: {exc}"
        return ""

    # --- release ------------------------------------------------------------------------------
    async def release(self, node: str, uid: str, *, why: str) -> bool:
        """Remove the pod's allocation (ledger, quota, event). True when this call removed it."""
        try:
            result, removed = await self.ledger.release(node, uid, self._hint(node))
        except CasConflictError as exc:
            log.warning("release lost too many races", extra={"pod_uid": uid, "err": str(exc)})
            return False
        self._apply(node, result)
        if removed is None:
            return False
        self.metrics.released.inc()
        if removed.quota_held:
            self.spawn(self._release_quota(removed.namespace, uid, removed.name))
        self.spawn(self._publish(AllocationEvent(
            event_id=f"{uid}:released", action="released", node=node, pod_uid=uid,
            namespace=removed.namespace, name=removed.name, containers=removed.containers,
            reason=why, source=self.instance,
        )))  # fmt: skip
        return True

    async def sweep(self) -> int:
        """Drop every expired reservation and lapsed claim; returns how many pods were dropped."""
        now = self.clock()
        dropped = 0
        for entry in list(self.index.entries.values()):
            ledger = entry.ledger
            if ledger is None:
                continue
            await self._adopt_orphaned_bind(entry.name, ledger, now)
            lapsed_claim = ledger.claim is not None and ledger.claim.expires_at <= now
            due = entry.reserved_until is not None and entry.reserved_until <= now
            if not (due or lapsed_claim):
                continue
            keep = await self._bound_meanwhile(entry.name, ledger, now)
            try:
                result, removed = await self.ledger.sweep(entry.name, now, keep)
            except CasConflictError:
                continue
            self._apply(entry.name, result)
            for allocation in removed:
                dropped += 1
                self.metrics.expired.inc()
                if allocation.quota_held:
                    self.spawn(self._release_quota(allocation.namespace, allocation.pod_uid,
                                                   allocation.name))  # fmt: skip
                self.spawn(self._publish(AllocationEvent(
                    event_id=f"{allocation.pod_uid}:released", action="released",
                    node=entry.name, pod_uid=allocation.pod_uid, namespace=allocation.namespace,
                    name=allocation.name, containers=allocation.containers,
                    reason="reservation expired before bind", source=self.instance,
                )))  # fmt: skip
        return dropped

    async def _bound_meanwhile(self, node: str, ledger: NodeLedger, now: float) -> frozenset[str]:
        """Expired reservations whose pod is in fact bound to the node (a replica died between
        the cluster bind and marking it bound): these are kept and marked bound."""
        keep = set()
        for a in ledger.allocations.values():
            if a.state != AllocationState.RESERVED or a.expires_at is None or a.expires_at > now:
                continue
            if await self._pod_bound_to(a, node):
                keep.add(a.pod_uid)
        return frozenset(keep)

    async def _pod_bound_to(self, allocation: Allocation, node: str) -> bool:
        if self.cluster is None:
            return False
        try:
            pod = await self.cluster.get_pod(allocation.namespace, allocation.name)
        except ClusterError:
            return False
        meta = pod.get("metadata") or {}
        return meta.get("uid") == allocation.pod_uid and (
            (pod.get("spec") or {}).get("nodeName") == node
        )

    async def _adopt_orphaned_bind(self, node: str, ledger: NodeLedger, now: float) -> None:
        """The claim's holder is still `reserved` long after taking the claim: its binder died
        between the cluster bind and marking it bound. If the pod is bound to the node, mark it
        bound now, so the agent's Allocate (which wants a bound pod) is not held up until the
        reservation lapses. (A pod not bound is left alone: its binder may just be slow.)"""
        claim = ledger.claim
        if (
            claim is None
            or claim.expires_at <= now
            or now - claim.taken_at < self.config.orphaned_bind_s
        ):
            return
        held = ledger.allocations.get(claim.pod_uid)
        if held is None or held.state != AllocationState.RESERVED:
            return
        if not await self._pod_bound_to(held, node):
            return
        try:
            result = await self.ledger.mark_bound(node, held.pod_uid, now, self._hint(node))
        except (ReservationGoneError, CasConflictError, NoChange):
            return
        self._apply(node, result)
        self.spawn(self._publish(AllocationEvent(
            event_id=f"{held.pod_uid}:bound", action="bound", node=node, pod_uid=held.pod_uid,
            namespace=held.namespace, name=held.name, containers=held.containers,
            reason="adopted: bound in the cluster, its binder did not finish",
            source=self.instance,
        )))  # fmt: skip


def _live(allocation: Allocation, now: float) -> bool:
    return allocation.active and not (
        allocation.state == AllocationState.RESERVED
        and allocation.expires_at is not None
        and allocation.expires_at <= now
    )


def _container_names(pod: dict[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return [str(c.get("name", "")) for c in containers]
