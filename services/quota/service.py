"""The quota service: NATS micro endpoints over KV tessera-quota.

State lives only in the KV bucket (one key per namespace, every write a CAS through
bus.cas_update), so any number of replicas can serve the same namespaces: two reservations that
race on one namespace cannot both pass the fit check against the same revision. The rules
themselves are in arithmetic.py; this module decodes, calls them, writes and replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service
from prometheus_client import CollectorRegistry
from tessera.quota import arithmetic as qa
from tessera.quota import status_pages
from tessera.quota.dra_charges import dra_allocations
from tessera.quota.metrics import QuotaMetrics
from tessera.quota.recovery import Reconciler, ReleaseConsumer, snapshot
from tessera.quota.resource_quotas import ResourceQuotaWatcher
from tessera.quota.stale_charges import (
    dra_booked,
    gone_allocation,
    live_uids,
    release_stale_charges,
)
from tessera.quota.store import JOURNAL_HARD_MAX, JOURNAL_SOFT_MAX, QuotaStore

from tessera import bus
from tessera.bus import (
    Buckets,
    BusKeeper,
    CasConflictError,
    NoChange,
    Versioned,
    cas_update,
)
from tessera.cancelling import cancel_and_wait
from tessera.cluster.port import ClusterError, ClusterPort, NotFoundError
from tessera.codec import CodecError, Message, decode, encode
from tessera.command_policy import PodCheck, authorize_quota, node_of, pod_problem
from tessera.dra_names import DRA_REASON
from tessera.models import (
    AllocationEvent,
    ErrorReply,
    NodeLedger,
    QuotaAmount,
    QuotaCharge,
    QuotaEvent,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaState,
    QuotaStatusRequest,
)
from tessera.restore import RestoreReport, allocations_from_pods
from tessera.settings import TesseraSettings
from tessera.signing import CommandGate, CommandRefused, verifier_from_file
from tessera.validation import Problem, Rejections, quota_problem, quota_salvage

SERVICE_VERSION = "0.1.0"
# Many replicas hammering one namespace lose CAS races to each other; keep trying well past the
# default before answering "busy" (each attempt is a read and a conditional write, ~1 ms).
CAS_ATTEMPTS = 200
MAX_REASON_CHARS = 600


class QuotaService:
    """One replica of tessera.quota. Build it with a connected client; `start()`, `stop()`."""

    def __init__(
        self,
        nc: NatsClient,
        buckets: Buckets,
        settings: TesseraSettings,
        *,
        cluster: ClusterPort | None = None,
        instance: str = "",
        clock: Callable[[], float] = time.time,
        reconcile_interval_s: float | None = None,
        grace_margin_s: float | None = None,
        consumer: str = bus.QUOTA_RELEASED_CONSUMER,
        log: logging.Logger | None = None,
        keeper: BusKeeper | None = None,
        status_budget: int | None = None,
    ) -> None:
        self.nc = nc
        # bytes a status reply's states may take (status_pages.py): the server's max_payload
        self.status_budget = status_budget
        self.js = nc.jetstream()
        self.kv = buckets.quota
        self.buckets = buckets
        self.settings = settings
        self.cluster = cluster
        self.instance = instance or f"quota-{socket.gethostname()}-{os.getpid()}"
        self.clock = clock
        self.log = log or logging.getLogger("tessera.quota")
        self.store = QuotaStore(buckets.quota, buckets.quota_charges, clock, self.log)
        self.metrics = QuotaMetrics()
        self.reconciler = Reconciler(
            quota=buckets.quota,
            ledger=buckets.ledger,
            clock=clock,
            # A reservation is followed by its ledger entry within the reservation TTL; a charge
            # still unbacked after that (plus a margin for clock skew) was leaked by a crash.
            grace_s=settings.reservation_ttl_s
            + (settings.quota_grace_margin_s if grace_margin_s is None else grace_margin_s),
            log=self.log,
            store=self.store,
        )
        self.reconcile_interval_s = reconcile_interval_s or settings.quota_reconcile_interval_s
        self.rejections = Rejections(self.instance, self.js, CollectorRegistry())
        # Every reserve/release/set is signed by its sender and authorised (tessera.signing).
        self.commands = CommandGate(
            verifier_from_file(settings.command_trust_file, clock), self.rejections,
            self.instance,
        )
        self._pods_seen: dict[str, tuple[float, str]] = {}  # uid -> (until, node): found
        self.releases = ReleaseConsumer(
            self.js, consumer, self._release_charge, self.log, check=self._release_is_true
        )
        self._micro: Service | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        # Namespaces with an early fold in flight, and each busy namespace's journal length as the
        # last reserve left it (only namespaces past JOURNAL_SOFT_MAX are kept).
        self._folding: dict[str, asyncio.Task[None]] = {}
        self._journal_length: dict[str, int] = {}
        self._stopping = asyncio.Event()
        self.keeper = keeper
        self.rq_watcher: ResourceQuotaWatcher | None = None
        # Set while the quota state is rebuilt after NATS lost it: reservations wait.
        self.rebuilding = ""

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Reconcile once, then serve. Returns once the endpoints answer."""
        if self.cluster is not None:
            self.rq_watcher = ResourceQuotaWatcher(
                self.cluster, self.settings, self._apply_quotas, self.log,
                stored=self._namespaces_limited_by_resource_quotas,
            )
        try:
            pods, listed_at = await self._list_pods()
            await self.charges_from_pods(pods)
            gone = None
            if pods is not None:  # pods deleted while no scheduler watched: their charges go
                ledgers = await snapshot(self.buckets.ledger, NodeLedger, self.log)
                booked = dra_booked(ledger for ledger, _revision in ledgers.values())
                await release_stale_charges(self.store, pods, listed_at, self.log,
                                            booked=booked)  # fmt: skip
                gone = gone_allocation(live_uids(pods), listed_at)
            await self.reconciler.run_once(gone=gone)
        except Exception as exc:  # the periodic pass will try again
            self.log.warning("start-up reconcile failed", extra={"err": str(exc)})
        self._tasks.append(asyncio.create_task(self._reconcile_loop()))
        self._tasks.append(asyncio.create_task(self._fold_loop()))
        self._tasks.append(asyncio.create_task(self.releases.run(self._stopping)))
        if self.rq_watcher is not None:
            self._tasks.append(asyncio.create_task(self.rq_watcher.run(self._stopping)))
        if self.keeper is not None:
            self._tasks.append(asyncio.create_task(self._follow_bus(self.keeper)))
        self._micro = await add_service(
            self.nc,
            name=bus.QUOTA_SERVICE,
            version=SERVICE_VERSION,
            description="namespace GPU quotas (HAMi ResourceQuota semantics)",
            metadata={"instance": self.instance},
        )
        endpoints: list[tuple[str, str, Callable[[Request], Awaitable[None]]]] = [
            ("reserve", bus.QUOTA_RESERVE, self._on_reserve),
            ("release", bus.QUOTA_RELEASE, self._on_release),
            ("status", bus.QUOTA_STATUS, self._on_status),
            ("set", bus.QUOTA_SET, self._on_set),
        ]
        for name, subject, handler in endpoints:
            await self._micro.add_endpoint(name=name, subject=subject, handler=handler)
        await bus.flush(self.nc)
        await self._wait_until_routed()
        self.log.info("quota service serving", extra={"instance": self.instance})

    async def _wait_until_routed(self, timeout_s: float = 5.0) -> None:
        """Ask our own status endpoint until the broker routes requests to it.

        Right after one replica replaced another, we saw a client's first request answered
        "no responders" for a few milliseconds; callers take that for a missing quota service.
        The likely cause: nats-py's flush lets its PING overtake the SUBs still queued
        (`bus.flush`), so the server had not read them yet. A round trip through our own
        endpoint before start() returns made it disappear in our tests.
        """
        probe = encode(QuotaStatusRequest(limit=1))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.nc.request(bus.QUOTA_STATUS, probe, timeout=1.0)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.log.warning("endpoints not reachable yet", extra={"err": str(exc)})
                    return
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._stopping.set()
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
            self._micro = None
        for task in self._tasks:
            task.cancel()
        # Events already under way get a moment to reach the stream, then are abandoned: a
        # service must stop within seconds even with NATS gone.
        if self._background:
            await asyncio.wait(set(self._background), timeout=1.0)
        # (a cancel Python 3.11's wait_for drops is sent again)
        await cancel_and_wait([*self._tasks, *self._background])
        self._tasks.clear()

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    async def _reconcile_loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.reconcile_interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.reconciler.run_once(self.reconcile_interval_s)
            except Exception as exc:
                self.log.warning("reconcile failed", extra={"err": str(exc)})

    async def _fold_loop(self, interval_s: float = 1.0) -> None:
        """Keep every namespace's counter small: journal entries move into their own keys."""
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval_s)
            try:
                states = await snapshot(self.kv, QuotaState, self.log)
                for namespace, (state, _revision) in states.items():
                    if state.charges or state.releasing:
                        await self.store.fold(namespace)
                if self.rq_watcher is not None:  # kubectl describe quota: Used
                    await self.rq_watcher.publish_usage(
                        {ns: state.used() for ns, (state, _revision) in states.items()})
            except Exception as exc:
                self.log.warning("fold pass failed", extra={"err": str(exc)})

    # --- NATS lost its store -------------------------------------------------------------------

    async def _follow_bus(self, keeper: BusKeeper) -> None:
        seen = keeper.generation
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), 0.2)
            if keeper.generation == seen:
                continue
            seen = keeper.generation
            self.rebuilding = "quota state is being rebuilt after NATS lost its store; retry"
            while not self._stopping.is_set():
                try:
                    await self.rebuild()
                    break
                except Exception as exc:
                    self.log.warning("quota rebuild failed; retrying", extra={"err": str(exc)})
                    await asyncio.sleep(1.0)
            self.rebuilding = ""

    async def rebuild(self) -> None:
        """The quota bucket was re-created empty: limits from the ResourceQuota objects already
        known, charges from the bound pods' annotations, then the usual pass over the ledger."""
        if self.rq_watcher is not None:
            await self.rq_watcher.reapply_all()
        await self.charges_from_pods()
        await self.reconciler.run_once()
        self.log.warning("quota state rebuilt")

    async def _list_pods(self) -> tuple[list[Any] | None, float]:
        """The cluster's pods (None without a cluster) and when the listing began."""
        listed_at = self.clock()
        return (await self.cluster.list_pods() if self.cluster is not None else None), listed_at

    async def charges_from_pods(self, pods: list[Any] | None = None) -> int:
        """Give every bound, unfinished GPU pod its charge back where it has none (never drops
        one); returns how many namespaces were written. `pods`: a listing already taken."""
        if self.cluster is None:
            return 0
        if pods is None:
            pods = await self.cluster.list_pods()
        now = self.clock()
        report = RestoreReport()
        by_node = allocations_from_pods(
            pods, quota_held=True, now=now, claim_ttl_s=0.0, report=report,
        )  # fmt: skip
        backed: dict[str, dict[str, Any]] = defaultdict(dict)
        for found in by_node.values():
            for allocation, _claim in found:
                backed[allocation.namespace][allocation.pod_uid] = allocation
        # DRA pods: their slices are in their ResourceClaims (dra_charges.py). Claims that
        # cannot be read now leave those charges to the reconcile with the rebuilt ledger.
        try:
            dra = await dra_allocations(self.cluster, self.buckets.nodes, pods, now, report)
        except Exception as exc:
            self.log.warning("DRA pods' charges not read from their claims",
                             extra={"err": str(exc)[:300]})  # fmt: skip
            dra = []
        for allocation in dra:
            backed[allocation.namespace].setdefault(allocation.pod_uid, allocation)
        if report.refused:
            self.log.warning("DRA claims not charged", extra={"refused": report.refused[:10]})
        written = 0
        for namespace, allocations in backed.items():
            view = await self.store.full_state(namespace) or QuotaState(namespace=namespace)
            missing = [
                qa.charge_from_allocation(a) for u, a in allocations.items()
                if u not in view.charges
            ]  # fmt: skip
            if not missing:
                continue
            _result, wrote = await cas_apply(
                self.kv, namespace, lambda s, ns=namespace, m=missing: qa.restore(s, ns, m)
            )
            written += wrote
        return written

    def _refusing(self) -> str:
        """Reservations wait only while the state is rebuilt; a bus that is away fails them by
        itself (and /readyz says so)."""
        return self.rebuilding

    # --- endpoint plumbing --------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        model: type[Message],
        handler: Callable[[Any], Coroutine[Any, Any, Message]],
        *,
        command: bool = True,
    ) -> None:
        """Verify the sender (commands), decode, authorise, handle, reply. Whatever goes wrong,
        the caller gets an ErrorReply (a JetStream delivery gets nothing: it asked nothing)."""
        started = time.perf_counter()
        reply: Message
        try:
            if command:
                sender = self.commands.verify(request._msg)
            body = decode(request.data, model)
            if command:
                await self._authorize(request.subject, sender, body)
            reply = await handler(body)
        except CommandRefused as refused:
            self.commands.report(request.subject, refused)
            self.metrics.answered(request.subject.rpartition(".")[2], "refused",
                                  time.perf_counter() - started)
            if refused.code == "jetstream_delivery":
                return  # its reply subject is a stream's ack: nobody asked
            with contextlib.suppress(Exception):
                await request.respond(encode(ErrorReply(reason=_short(
                    f"command refused ({refused.code}): {refused.detail}"))))
            return
        except CodecError as exc:
            reply = ErrorReply(reason=_short(f"bad {model.__name__}: {exc}"))
        except qa.QuotaInputError as exc:
            reply = ErrorReply(reason=_short(str(exc)))
        except CasConflictError:
            reply = ErrorReply(reason="quota state is busy (too many concurrent writers); retry")
        except Exception as exc:
            self.log.exception("quota request failed", extra={"subject": request.subject})
            reply = ErrorReply(reason=_short(f"internal error: {type(exc).__name__}: {exc}"))
        result = "error" if isinstance(reply, ErrorReply) else (
            "refused" if getattr(reply, "ok", True) is False else "ok")
        self.metrics.answered(request.subject.rpartition(".")[2], result,
                              time.perf_counter() - started)
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    async def _on_reserve(self, request: Request) -> None:
        await self._serve(request, QuotaRequest, self.reserve)

    async def _on_release(self, request: Request) -> None:
        await self._serve(request, QuotaRequest, self.release)

    async def _on_status(self, request: Request) -> None:
        await self._serve(request, QuotaStatusRequest, self.status, command=False)

    async def _on_set(self, request: Request) -> None:
        await self._serve(request, QuotaSetRequest, self.set_limits)

    async def _authorize(self, subject: str, sender: str, body: Message) -> None:
        """Raise CommandRefused unless `sender` may send this command for this pod/namespace."""
        if not self.commands.verifier.enforcing:
            return  # no trust file: nothing proves who sent it (docs/security.md)
        if isinstance(body, QuotaSetRequest):
            verdict = authorize_quota(subject, sender, namespace=body.namespace, pod_uid="",
                                      name="", check_only=False)  # fmt: skip
        else:
            assert isinstance(body, QuotaRequest)
            verdict = authorize_quota(subject, sender, namespace=body.namespace,
                                      pod_uid=body.pod_uid, name=body.name,
                                      check_only=body.check_only)  # fmt: skip
        if isinstance(verdict, PodCheck):
            verdict = await self._pod_problem(verdict)
        if not verdict and isinstance(body, QuotaRequest) and body.handed_from:
            verdict = await self._hand_on_problem(sender, body)
        if verdict:
            raise CommandRefused("not_allowed", verdict, sender)

    async def _hand_on_problem(self, sender: str, req: QuotaRequest) -> str | None:
        """A charge is handed on only by the node agent of the node where the pod it comes from
        has its DRA booking (a shared claim's first pod, kept by the scheduler's release until
        the hand-on): nobody frees another node's, or an extender pod's, charge this way."""
        node = node_of(sender)
        if not node:
            return (f"{sender or 'an unnamed sender'} may not hand quota charges on (a node "
                    "agent hands on its node's shared DRA claims)")  # fmt: skip
        try:
            entry = await bus.read(self.buckets.ledger, node, NodeLedger)
        except Exception as exc:
            return f"the ledger of {node} could not be read to check the hand-on: {exc}"
        held = entry.value.allocations.get(req.handed_from) if entry is not None else None
        if held is None or held.reason != DRA_REASON or held.namespace != req.namespace:
            return (f"pod {req.handed_from} has no DRA booking of namespace {req.namespace} on "
                    f"{node} to hand on")  # fmt: skip
        return None

    async def _pod_problem(self, check: PodCheck) -> str | None:
        """A reservation holds quota only for a pod the cluster has (bound to the sender's node
        when a node agent sends it). Found pods are remembered for a reservation TTL."""
        if self.cluster is None:
            return None  # no cluster API (TESSERA_CLUSTER=none): nothing can be bound either
        now = time.monotonic()
        seen = self._pods_seen.get(check.uid)
        if seen and seen[0] > now and (check.node is None or seen[1] == check.node):
            return None
        try:
            pod = await self.cluster.get_pod(check.namespace, check.name)
        except NotFoundError:
            pod = None
        except ClusterError as exc:
            return f"the cluster could not confirm pod {check.namespace}/{check.name}: {exc}"
        problem = pod_problem(check, pod)
        if problem is None and pod is not None:
            if len(self._pods_seen) > 50_000:
                self._pods_seen.clear()
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            self._pods_seen[check.uid] = (now + self.settings.reservation_ttl_s, node)
        return problem

    # --- the operations -----------------------------------------------------------------------

    async def reserve(self, req: QuotaRequest) -> Message:
        qa.check_request(req)
        wait = self._refusing()
        if wait:
            return ErrorReply(reason=wait)
        if req.check_only:
            current, own = await self.store.read_with_own(req.namespace, req.pod_uid)
            state = current.value if current else None
            reason = self._invalid(req.namespace, state) or qa.refusal(state, req, own)
            if reason:
                self._exceeded(state, req, reason)
                return QuotaReply(ok=False, reason=reason, states=_summary(state, req))
            return QuotaReply(ok=True, reason="fits", states=_summary(state, req))
        if not req.pod_uid:
            raise qa.QuotaInputError("a reservation needs pod_uid (or check_only for a dry run)")
        await self._journal_room(req.namespace)
        stamp = self.clock()
        seen: list[QuotaState | None] = [None]

        def hold(state: QuotaState | None, own: QuotaCharge | None) -> QuotaState:
            seen[0] = state  # the state a refusal was decided against, for the event
            invalid = self._invalid(req.namespace, state)
            if invalid:
                raise qa.QuotaRefused(invalid)
            return qa.reserve(state, req, stamp, own)

        def hold_handed_on(state: QuotaState | None, own: QuotaCharge | None,
                           handed: QuotaCharge | None) -> QuotaState:  # fmt: skip
            seen[0] = state
            invalid = self._invalid(req.namespace, state)
            if invalid:
                raise qa.QuotaRefused(invalid)
            return qa.hand_on(state, req, stamp, own, handed)

        try:
            if req.handed_from:
                result, wrote = await self.store.update_pair(
                    req.namespace, req.pod_uid, req.handed_from, hold_handed_on)
            else:
                result, wrote = await self.store.update(req.namespace, req.pod_uid, hold)
        except qa.QuotaRefused as refused:
            self._exceeded(seen[0], req, refused.reason)
            return QuotaReply(ok=False, reason=refused.reason, states=_summary(seen[0], req))
        state = result.value if result else None
        self._journal_grew(req.namespace, state)
        if not qa.asks_gpu(req):
            outcome = "nothing to hold: the pod asks no GPU"
        elif wrote:
            outcome = "reserved"
        else:
            outcome = "already held"
        return QuotaReply(ok=True, reason=outcome, states=_summary(state, req))

    async def release(self, req: QuotaRequest) -> QuotaReply:
        qa.check_namespace(req.namespace)
        if not req.pod_uid:
            raise qa.QuotaInputError("release needs pod_uid")
        result, freed = await self.store.update(
            req.namespace, req.pod_uid, lambda s, own: qa.release(s, req.pod_uid, own_settled=own)
        )
        return QuotaReply(
            ok=True,
            reason="released" if freed else f"nothing held by pod {req.pod_uid}",
            states=_summary(result.value if result else None, req),
        )

    async def status(self, req: QuotaStatusRequest) -> Message:
        # kube-apiserver's DRA device quotas of the namespace(s), as the objects say
        devices = self.rq_watcher.device_quotas(req.namespace) if self.rq_watcher else []
        budget = self.status_budget or status_pages.budget_for(self.nc.max_payload)
        if req.namespace:
            qa.check_namespace(req.namespace)
            full = await self.store.full_state(req.namespace)
            if full is None and devices:
                return QuotaReply(ok=True, reason=f"no GPU limits or charges by Tessera in "
                                  f"{req.namespace}; Kubernetes counts its DRA devices",
                                  device_quotas=devices)  # fmt: skip
            if full is None:
                return ErrorReply(
                    reason=f"unknown namespace {req.namespace!r}: no quota limits or charges "
                    "are recorded for it (its GPU use is unlimited)"
                )
            full, cut = status_pages.bounded(full, budget)
            reason = (f"{len(full.charges)} of {len(full.charges) + cut} charges listed (the "
                      f"newest; a reply is bounded at {budget} bytes); the totals count them "
                      "all") if cut else ""  # fmt: skip
            return QuotaReply(ok=True, reason=reason, states=[full], device_quotas=devices)
        states = await snapshot(self.kv, QuotaState, self.log)
        shown, quotas, more, left = status_pages.page(
            (v for v, _r in states.values()), devices, after=req.after, limit=req.limit,
            budget=budget)  # fmt: skip
        reason = (f"{left} more namespace(s) after {more!r}: ask again with after={more!r} (a "
                  f"reply is bounded at {budget} bytes)") if more else ""  # fmt: skip
        return QuotaReply(ok=True, reason=reason, states=shown, device_quotas=quotas,
                          continue_after=more)  # fmt: skip

    async def set_limits(self, req: QuotaSetRequest) -> QuotaReply:
        qa.check_namespace(req.namespace)
        qa.check_limits(req.limits)
        source = req.source or "cli"
        if source.startswith(qa.RESOURCE_QUOTA_SOURCE):
            raise qa.QuotaInputError(f"source {source!r} is reserved for ResourceQuota objects")
        def guarded(current: QuotaState | None) -> QuotaState:
            # Checked inside the CAS: a ResourceQuota applied meanwhile is never overwritten.
            if (current is not None and current.source.startswith(qa.RESOURCE_QUOTA_SOURCE)
                    and not req.override):
                objects = current.source.removeprefix(qa.RESOURCE_QUOTA_SOURCE)
                raise qa.QuotaInputError(
                    f"namespace {req.namespace} has its GPU limits from ResourceQuota "
                    f"{objects}; edit that object (kubectl edit resourcequota), or pass "
                    "--override to replace its limits until the ResourceQuota next changes"
                )
            return qa.set_limits(current, req.namespace, req.limits, source)

        state = await self._write_limits(req.namespace, guarded)
        over = qa.over_limit(state)
        reason = "limits set"
        if over:
            reason += (
                f"; usage is above the new {', '.join(over)} limit: pods already holding quota "
                "keep it, new reservations are refused until usage falls below"
            )
        return QuotaReply(ok=True, reason=reason, states=[state])

    # --- shared by endpoints, the event consumer and the ResourceQuota watcher ----------------

    def _invalid(self, namespace: str, state: QuotaState | None) -> str:
        """Why the stored record cannot be used ('' when it can): a reservation against it is
        refused (fail closed) until limits are set again, which salvages it."""
        problem = quota_problem(namespace, state) if state is not None else None
        if problem is None:
            return ""
        self.rejections.reject("quota", namespace, problem)
        return (f"the quota record of namespace {namespace} is invalid ({problem.detail}): GPU "
                "reservations are refused until its limits are set again")  # fmt: skip

    async def _write_limits(
        self, namespace: str, mutate: Callable[[QuotaState | None], QuotaState]
    ) -> QuotaState:
        def salvaged(state: QuotaState | None) -> QuotaState:
            if state is None or quota_problem(namespace, state) is None:
                return mutate(state)
            state = quota_salvage(namespace, state)  # writing limits repairs the record
            try:
                return mutate(state)
            except NoChange:
                return state

        result, wrote = await cas_apply(self.kv, namespace, salvaged)
        if result is None:
            return QuotaState(namespace=namespace)
        if wrote:
            self._changed(result.value, result.revision)
            self.log.info(
                "limits changed",
                extra={"namespace": namespace, "limits": result.value.limits.model_dump(),
                       "source": result.value.source},
            )
        return result.value

    async def _apply_quotas(self, namespace: str, quotas: dict[str, QuotaAmount]) -> None:
        await self._write_limits(namespace, lambda s: qa.limits_from_quotas(s, namespace, quotas))

    async def _namespaces_limited_by_resource_quotas(self) -> set[str]:
        states = await snapshot(self.kv, QuotaState, self.log)
        return {
            ns for ns, (state, _rev) in states.items()
            if state.source.startswith(qa.RESOURCE_QUOTA_SOURCE)
        }

    async def _release_is_true(self, event: AllocationEvent) -> bool:
        """A released event is applied only if the ledger agrees: the pod holds no active
        allocation on that node any more (the scheduler removes it before announcing)."""
        try:
            current = await bus.read(self.buckets.ledger, event.node, NodeLedger)
        except CodecError:
            return True  # the ledger entry is being repaired; the reconciler corrects later
        allocation = current.value.allocations.get(event.pod_uid) if current else None
        if allocation is None or not allocation.active:
            return True
        self.rejections.reject("event", bus.alloc_event_subject(event.node, "released"), Problem(
            "release_contradicted",
            f"released event for pod {event.namespace}/{event.name} ({event.pod_uid}), but the "
            f"ledger of {event.node} still holds its {allocation.state} allocation: charge kept",
        ), revision=0)  # fmt: skip
        return False

    async def _release_charge(
        self, namespace: str, pod_uid: str, charged_before: float | None
    ) -> bool:
        """Free `pod_uid`'s charge; True when this call freed it."""
        _result, wrote = await self.store.update(namespace, pod_uid, lambda s, own: qa.release(
            s, pod_uid, charged_before=charged_before, own_settled=own))  # fmt: skip
        return wrote

    # --- events (published in the background: a reply never waits on the stream) -------------

    def _changed(self, state: QuotaState, revision: int) -> None:
        event = QuotaEvent(
            event_id=f"quota:{state.namespace}:changed:{revision}",
            action="changed",
            namespace=state.namespace,
            limits=state.limits,
            used=state.used(),
            source=self.instance,
            reason=f"limits set by {state.source or 'default (unlimited)'}",
        )
        self._publish(event)

    def _exceeded(self, state: QuotaState | None, req: QuotaRequest, reason: str) -> None:
        limits = state.limits if state else QuotaAmount()
        used = state.used() if state else QuotaAmount()
        # The same refusal retried against the same state is one event (Nats-Msg-Id dedupe).
        who = req.pod_uid or req.name
        digest = hashlib.sha256(
            f"{who}|{limits.model_dump_json()}|{used.model_dump_json()}".encode()
        ).hexdigest()[:16]
        event = QuotaEvent(
            event_id=f"quota:{req.namespace}:exceeded:{digest}" if who else uuid.uuid4().hex,
            action="exceeded",
            namespace=req.namespace,
            limits=limits,
            used=used,
            pod_uid=req.pod_uid,
            source=self.instance,
            reason=reason,
        )
        self._publish(event)

    def _journal_grew(self, namespace: str, state: QuotaState | None) -> None:
        """Note the journal's length after a write; past JOURNAL_SOFT_MAX, fold it early."""
        length = len(state.charges) if state is not None else 0
        if length <= JOURNAL_SOFT_MAX:
            self._journal_length.pop(namespace, None)
            return
        self._journal_length[namespace] = length
        self._fold_soon(namespace)

    async def _journal_room(self, namespace: str) -> None:
        """Before a reserve writes: when the journal is at JOURNAL_HARD_MAX and a fold is in flight
        (reserves outran it), wait for that fold, so the journal cannot grow without bound on a
        busy host. A fold that fails or takes over a few seconds is not waited on further: the
        reserve goes ahead (the bound is for speed; no charge depends on it)."""
        fold = self._folding.get(namespace)
        if fold is None or self._journal_length.get(namespace, 0) < JOURNAL_HARD_MAX:
            return
        await asyncio.wait({fold}, timeout=5.0)

    def _fold_soon(self, namespace: str) -> None:
        """Fold a namespace whose journal grew past JOURNAL_SOFT_MAX now, in the background (at
        most one at a time per namespace), so reserves keep decoding a short value."""
        if namespace in self._folding:
            return

        async def fold() -> None:
            try:
                await self.store.fold(namespace, min_age_s=0.0)
            except Exception as exc:  # the periodic fold pass tries again
                self.log.warning("early fold failed", extra={"namespace": namespace,
                                                             "err": str(exc)})  # fmt: skip
            finally:
                self._folding.pop(namespace, None)

        task = asyncio.create_task(fold())
        self._folding[namespace] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish(self, event: QuotaEvent) -> None:
        async def publish() -> None:
            try:
                await bus.publish_event(self.js, event, attempts=3)
            except Exception as exc:
                self.log.warning("quota event not published", extra={"err": str(exc)})

        task = asyncio.create_task(publish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def cas_apply(
    kv: KeyValue, namespace: str, mutate: Callable[[QuotaState | None], QuotaState]
) -> tuple[Versioned[QuotaState] | None, bool]:
    """cas_update that also says whether it wrote: (current value or None, changed)."""
    wrote = False

    def tracked(state: QuotaState | None) -> QuotaState:
        nonlocal wrote
        wrote = False  # the last call is the one that counts (earlier ones lost a race)
        new_state = mutate(state)
        wrote = True
        return new_state

    try:
        result = await cas_update(kv, namespace, QuotaState, tracked, attempts=CAS_ATTEMPTS)
    except NoChange:
        return None, False
    return result, wrote


def _summary(state: QuotaState | None, req: QuotaRequest) -> list[QuotaState]:
    """What reserve/release replies carry: the namespace's limits and this pod's own charge.

    Not every charge: a namespace may hold thousands, and the caller asked about one pod
    (tessera.quota.status returns the full state)."""
    if state is None:
        return []
    own = {req.pod_uid: state.charges[req.pod_uid]} if req.pod_uid in state.charges else {}
    return [state.model_copy(update={"charges": own})]


def _short(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"
