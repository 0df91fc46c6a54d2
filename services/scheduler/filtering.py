"""Filter: choose a node for the pod (the pure decision) and reserve it there in the ledger.

With `nodenames` the pod is reserved on the best node that still fits at CAS time (quota held
first when enabled); the side-effect-free `nodes` path (dry run) only answers which nodes fit.
Prioritize lives here too: it scores the same way, writing nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tessera.bus import CasConflictError, NoChange
from tessera.hami import PodRequest, RequestError
from tessera.models import Allocation, AllocationEvent, QuotaState
from tessera.settings import TesseraSettings

from .background import EventPublisher
from .backlog import BacklogGovernor
from .config import SchedulerSettings
from .decide import Decision, decide, prioritize_scores
from .failures import FailureLog
from .index import ClusterIndex
from .indexed_ledger import IndexedLedger
from .ledger import LedgerLostError, NodeFullError, ReservationRequest
from .metrics import SchedulerMetrics
from .node_reasons import NodeReasons
from .pods import (
    BadRequestError,
    PodIdentity,
    allocation_live,
    container_names,
    parse_pod,
)
from .quota_client import QuotaClient, grants_charge, quota_budget
from .release import AllocationReleaser
from .rules import (
    NODE_CONSTRAINT,
    REQUEST_INVALID,
    RESOURCE_QUOTA_NOT_FIT,
    FitContext,
    PodOptions,
    QuotaBudget,
)


@dataclass
class FilterOutcome:
    nodenames: list[str] | None = None
    passed_all: bool = False  # the pod asks for no GPU: every node passes untouched
    # node -> why it refused (kube-scheduler's failedNodes; a NodeReasons builds its dict only
    # when read: the reply encodes it with `to_json`)
    failed: dict[str, str] | NodeReasons = field(default_factory=dict)
    unresolvable: dict[str, str] | NodeReasons = field(default_factory=dict)
    error: str = ""


class PodFilter:
    def __init__(
        self,
        *,
        settings: TesseraSettings,
        config: SchedulerSettings,
        ledger: IndexedLedger,
        quota: QuotaClient,
        quotas: dict[str, QuotaState],
        releaser: AllocationReleaser,
        failures: FailureLog,
        publisher: EventPublisher,
        metrics: SchedulerMetrics,
        instance: str,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.config = config
        self.ledger = ledger
        self.index = ledger.index
        self.quota = quota
        self.quotas = quotas  # namespace -> state, kept current by the runtime's quota watch
        self.releaser = releaser
        self.failures = failures
        self.publisher = publisher
        self.metrics = metrics
        self.instance = instance
        self.clock = clock
        # Does the pod exist in the cluster? (pod_gate.PodGate, set by the runtime.)
        self.pod_check: Callable[[PodIdentity], Awaitable[str | None]] | None = None
        # (pod, node) -> why the pod's nodeSelector/affinity/taints exclude the node: nothing
        # is reserved there (bind would refuse it anyway).
        self.node_check: Callable[[dict[str, Any], str], Awaitable[str | None]] | None = None
        # what the retries of refused pods may take of the scheduler (backlog.py)
        self.backlog = BacklogGovernor(config.backlog_share, config.backlog_burst_s,
                                       config.backlog_max_defer_s)  # fmt: skip

    def budget(self, namespace: str, uid: str) -> QuotaBudget:
        state = self.quotas.get(namespace) if self.settings.quota_enabled else None
        return quota_budget(state, uid)

    async def filter(
        self, pod: dict[str, Any], names: list[str], *, dry_run: bool = False
    ) -> FilterOutcome:
        ident = PodIdentity.of(pod)
        try:
            request, options = parse_pod(pod, self.settings)
        except RequestError as exc:
            return self._refuse_invalid(ident, names, str(exc))
        if not request.wants_gpu:
            return FilterOutcome(nodenames=list(names), passed_all=True)
        if not dry_run and not ident.uid:
            raise BadRequestError("pod.metadata.uid is required")
        if not dry_run and not self.backlog.admit(ident.uid, time.monotonic()):
            self.metrics.backlog_deferred.inc()
            return FilterOutcome(error=self.backlog.deferral(ident.uid, time.monotonic()))
        if not dry_run and self.pod_check is not None:
            unknown = await self.pod_check(ident)
            if unknown is not None:  # a pod the cluster does not have: hold nothing for it
                return FilterOutcome(unresolvable=NodeReasons.uniform(names, unknown))
        if not dry_run:
            held = self.index.pod_nodes.get(ident.uid)
            if held is not None:
                entry = self.index.entries.get(held)
                known = entry.ledger.allocations.get(ident.uid) if entry and entry.ledger else None
                if held in names and known is not None and allocation_live(known, self.clock()):
                    return FilterOutcome(nodenames=[held])  # a retried filter: keep it
                why = "reservation lapsed" if held in names else "rescheduled to other candidates"
                await self.releaser.release(held, ident.uid, why=why)
        started = time.perf_counter()
        cpu_started = time.thread_time()
        decision = decide(
            self.index, request, options, names, self.budget(ident.namespace, ident.uid),
            self.config.avoid_busy_nodes,
        )  # fmt: skip
        # The kept candidate orders are merged once this decision has answered (the loop's next
        # callback: at this call's first await, its CAS), not inside the next decision.
        asyncio.get_running_loop().call_soon(self.index.tidy_orders)
        if dry_run:
            fitting = [entry.name for entry, _fit in decision.fits()]
            self.metrics.fit_seconds.observe(time.perf_counter() - started)
            decision.explain_rest()
            return FilterOutcome(nodenames=fitting, failed=decision.failed)
        placed, quota_refusal = await self._place(
            ident, request, options, decision, started, container_names(pod), pod
        )
        if placed is not None:
            self.failures.forget(ident.uid)
            self.backlog.charge(ident.uid, 0.0, False, time.monotonic())
            return FilterOutcome(nodenames=[placed], failed=decision.failed)
        if quota_refusal:
            failed = NodeReasons.uniform(names, quota_refusal)
            self.failures.count_refusal({RESOURCE_QUOTA_NOT_FIT: len(names)})
            self.failures.remember(ident, failed, quota_refusal)
            return FilterOutcome(failed=failed)
        decision.explain_rest()
        self.failures.count_refusal(decision.reason_counts)
        summary = f"0/{len(names)} nodes fit the GPU request"
        self.failures.remember(ident, decision.failed, summary)
        spent = time.thread_time() - cpu_started
        self.metrics.backlog_cpu.inc(spent)
        self.backlog.charge(ident.uid, spent, True, time.monotonic())
        return FilterOutcome(failed=decision.failed)

    async def _place(
        self,
        ident: PodIdentity,
        request: PodRequest,
        options: PodOptions,
        decision: Decision,
        started: float,
        names_of_containers: list[str],
        pod: dict[str, Any] | None = None,
    ) -> tuple[str | None, str]:
        """Reserve on the best node that still fits at CAS time: (node, quota refusal text)."""
        timed = False
        held_charge: tuple[int, int, int] | None = None
        for entry, fit in decision.fits():
            seen = (entry.ledger, entry.cards)  # what `fit` was made on (before any await)
            if not timed:
                self.metrics.fit_seconds.observe(time.perf_counter() - started)
                timed = True
            if self.node_check is not None and pod is not None:
                excluded = await self.node_check(pod, entry.name)
                if excluded:  # the pod may not run there: hold nothing on it
                    decision.failed[entry.name] = f"{NODE_CONSTRAINT}: {excluded}"
                    continue
            charge = grants_charge(fit.containers, len(request.init), request.sidecars)
            if self.settings.quota_enabled and charge != held_charge:
                refusal = await self.quota.reserve(ident, charge)
                if refusal:
                    return None, refusal
                held_charge = charge
            template = Allocation(
                pod_uid=ident.uid, namespace=ident.namespace, name=ident.name, node=entry.name,
                containers=[], init_count=len(request.init), sidecars=sorted(request.sidecars),
                priority=next((r.priority for r in request.all if r and r.priority is not None),
                              1),
                core_policy=self.settings.core_policy,
                scrub_on_free=options.scrub_on_free,
                memory_reclaim=options.memory_reclaim, memory_wait_s=options.memory_wait_s,
                container_names=names_of_containers,
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
                may_create=entry.ledger is None,
                foreign=self.index.foreign_allocations(entry.name),
                claim_ahead=self.ledger.writer.claim_ahead,  # (set here: no copy in reserve)
                # The decision's fit stands for the write's own when it was made without a
                # quota limit (the write fits without one: the quota is held already).
                decided=(entry.ledger, fit) if (
                    entry.ledger is not None and entry.ledger is seen[0]
                    and entry.cards is seen[1] and decision.budget == QuotaBudget()
                ) else None,
            )
            # Other filters running while this CAS is in flight should look elsewhere first.
            self.index.mark_busy(entry.slot)
            try:
                async with self.ledger.lock(entry.name):
                    result = await self.ledger.writer.reserve(
                        reservation, self.ledger.hint(entry.name)
                    )
            except NodeFullError as exc:
                decision.record(entry.name, exc.fit)
                continue
            except (CasConflictError, NoChange, LedgerLostError):
                continue
            self.ledger.apply(entry.name, result)
            allocation = result.value.allocations.get(ident.uid)
            self.metrics.placed.inc()
            self.publisher.publish_soon(AllocationEvent(
                event_id=f"{ident.uid}:{entry.name}:reserved", action="reserved", node=entry.name,
                pod_uid=ident.uid, namespace=ident.namespace, name=ident.name,
                containers=allocation.containers if allocation else [], source=self.instance,
            ))  # fmt: skip
            return entry.name, ""
        if held_charge is not None:
            self.quota.release_soon(ident.namespace, ident.uid, ident.name)
        return None, ""

    def _refuse_invalid(self, ident: PodIdentity, names: list[str], message: str) -> FilterOutcome:
        reason = f"{REQUEST_INVALID}: {message}"
        unresolvable = NodeReasons.uniform(names, reason)
        self.failures.count_refusal({REQUEST_INVALID: len(names)})
        self.failures.remember(ident, unresolvable, reason)
        return FilterOutcome(unresolvable=unresolvable)


def prioritize(
    index: ClusterIndex, settings: TesseraSettings, pod: dict[str, Any], names: list[str]
) -> list[dict[str, Any]]:
    """10 for the node holding the pod's reservation; otherwise HAMi's node score (0-10)."""
    ident = PodIdentity.of(pod)
    held = index.pod_nodes.get(ident.uid) if ident.uid else None
    if held is not None:
        return [{"host": n, "score": 10 if n == held else 0} for n in names]
    try:
        _request, options = parse_pod(pod, settings)
    except RequestError:
        return [{"host": n, "score": 0} for n in names]
    scores = prioritize_scores(index, options, names)
    return [{"host": n, "score": s} for n, s in zip(names, scores, strict=True)]
