"""The metrics service's picture of the cluster, built only from bus messages. Pure: no I/O.

Current values (nodes, ledgers, quotas) come from the KV buckets and replace what was there.
Everything counted (events by kind, refusals by reason, OOMs, latency histograms) is folded from
the event stream in order, so replaying the stream from its start rebuilds the same numbers.
Usage samples are the latest per node, dropped when they get old.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from tessera.gpuid import short_uuid
from tessera.models import (
    AdmissionEvent,
    Allocation,
    AllocationEvent,
    ComputeReclaimEvent,
    Event,
    LimitBreachedEvent,
    MemoryReclaimEvent,
    NodeEvent,
    NodeLedger,
    NodeRegistration,
    OomEvent,
    PodGoneEvent,
    QuotaEvent,
    QuotaState,
    SchedulingFailedEvent,
    UsageSample,
)
from tessera.validation import Bounds, ledger_problem, quota_problem, registration_problem

from .latency import LatencyTracker

RECENT_EVENTS = 200
MAX_SEEN_EVENT_IDS = 200_000
# A node that stopped publishing usage for this long has no usage figures.
USAGE_MAX_AGE_S = 30.0
# kube-scheduler retries an unschedulable pod at least every 5 minutes; a pod not refused again
# for longer than this was deleted or placed by someone else.
PENDING_STALE_S = 900.0
MAX_PENDING = 10_000
BAD_MESSAGE_SOURCES = ("nodes", "ledger", "quota", "events", "usage")
BREACH_REASONS = ("memory", "compute", "tampered", "unattested", "unleased")

# HAMi writes node reasons as "3/8 CardInsufficientMemory"; several may be joined by ", " or "; ".
_REASON = re.compile(r"^\s*(?:\d+/\d+\s+)?([A-Z][A-Za-z0-9]*)(?=$|[\s:])")

# How the dashboard shows a node event: a (re)configuration is routine, a refused one needs the
# operator's eye, losing a node or a GPU is an error.
NODE_EVENT_SEVERITY = {"registered": "info", "configured": "info", "config_refused": "warning"}


def reason_codes(text: str) -> list[str]:
    """The machine-readable reason names in one node's refusal text (bounded label values)."""
    codes = []
    for part in re.split(r"[;,]", text):
        if not part.strip():
            continue
        match = _REASON.match(part)
        codes.append(match.group(1) if match else "Other")
    return codes or ["Other"]


@dataclass
class PendingPod:
    namespace: str
    name: str
    pod_uid: str
    since: float
    last_at: float
    summary: str
    node_reasons: dict[str, str]
    attempts: int = 1
    # admitted with a resource no node offers (a misspelt GPU resource): no scheduler ever
    # refuses it again, so it stays pending until placed or deleted, never stale
    sticky: bool = False


@dataclass
class RecentEvent:
    at: float
    kind: str
    action: str
    scope: str
    text: str
    reason: str = ""
    severity: str = "info"


@dataclass
class UsageView:
    sample: UsageSample
    received_at: float


@dataclass
class ClusterView:
    """Everything the exposition and the dashboard are computed from."""

    nodes: dict[str, NodeRegistration] = field(default_factory=dict)
    ledgers: dict[str, NodeLedger] = field(default_factory=dict)
    quotas: dict[str, QuotaState] = field(default_factory=dict)
    usage: dict[str, UsageView] = field(default_factory=dict)
    latency: LatencyTracker = field(default_factory=LatencyTracker)
    pending: dict[tuple[str, str], PendingPod] = field(default_factory=dict)  # (ns, name)
    recent: deque[RecentEvent] = field(default_factory=lambda: deque(maxlen=RECENT_EVENTS))
    # Counters folded from the stream (label tuples -> count).
    alloc_events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (node, action)
    node_events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (node, action)
    admission_events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (ns, action)
    quota_events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (ns, action)
    sched_failures: Counter[str] = field(default_factory=Counter)  # namespace
    refusals: Counter[str] = field(default_factory=Counter)  # reason code
    ooms: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)  # node, ns, pod, c
    memory_reclaims: Counter[tuple[str, str]] = field(default_factory=Counter)  # node, action
    compute_reclaims: Counter[str] = field(default_factory=Counter)  # node: reclaims reported
    limit_breaches: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(
        BREACH_REASONS, 0)))  # watchdog breach reason
    # pod uid -> GPU uuid -> the latest watchdog breach reason (the dashboard marks the slice;
    # forgotten when the pod's allocation is released)
    breached: dict[str, dict[str, str]] = field(default_factory=dict)
    bad_messages: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(
        BAD_MESSAGE_SOURCES, 0)))
    # Values refused by validation (tessera.validation), by (source, reason): never applied.
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    bounds: Bounds = field(default_factory=Bounds)
    # A registration whose heartbeat is older than this no longer counts as registered (KV TTL
    # expiry reaches no watcher); the service sets 2 × the nodes bucket TTL.
    node_stale_s: float = 30.0
    events_applied: int = 0
    last_event_sequence: int = 0
    kv_synced: set[str] = field(default_factory=set)
    events_synced: bool = False
    _seen_event_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)

    # --- KV current values --------------------------------------------------------------------

    def put_node(self, key: str, value: NodeRegistration | None) -> None:
        if value is None:
            self.nodes.pop(key, None)
            self.usage.pop(key, None)
        elif not self._rejects("registration", registration_problem(key, value, self.bounds)):
            self.nodes[key] = value

    def node_registered(self, name: str, now: float) -> bool:
        """Registered and heartbeating (a forged or dead node drops out within node_stale_s)."""
        registration = self.nodes.get(name)
        return registration is not None and now - registration.heartbeat_at <= self.node_stale_s

    def _rejects(self, source: str, problem: object) -> bool:
        if problem is None:
            return False
        self.rejected[(source, getattr(problem, "code", "invalid"))] += 1
        return True

    def put_ledger(self, key: str, value: NodeLedger | None) -> None:
        if value is None:
            self.ledgers.pop(key, None)
        elif self._rejects(
            "ledger", ledger_problem(key, value, self.nodes.get(key), self.bounds)
        ):
            return  # the last valid value stays
        else:
            self.ledgers[key] = value
            for allocation in value.allocations.values():
                if allocation.state in ("bound", "allocated"):
                    self._clear_pending(allocation.namespace, allocation.name)

    def put_quota(self, key: str, value: QuotaState | None) -> None:
        if value is None:
            self.quotas.pop(key, None)
        elif not self._rejects("quota", quota_problem(key, value)):
            self.quotas[key] = value

    # --- usage samples ------------------------------------------------------------------------

    def put_usage(self, sample: UsageSample, received_at: float) -> None:
        self.usage[sample.node] = UsageView(sample, received_at)
        for container in sample.containers:
            if container.pod_uid:
                self.latency.running(container.pod_uid, sample.at)

    def fresh_usage(self, now: float) -> dict[str, UsageSample]:
        """The latest sample of every node that still published recently."""
        return {
            node: view.sample
            for node, view in self.usage.items()
            if now - view.received_at <= USAGE_MAX_AGE_S
        }

    # --- bad input ----------------------------------------------------------------------------

    def bad_message(self, source: str) -> None:
        self.bad_messages[source] += 1

    # --- the event stream ---------------------------------------------------------------------

    def apply_event(self, event: Event, sequence: int = 0) -> bool:
        """Fold one event into the counters; False when it was a duplicate (already applied)."""
        if sequence and sequence <= self.last_event_sequence:
            return False
        if event.event_id in self._seen_event_ids:
            return False
        self._seen_event_ids[event.event_id] = None
        while len(self._seen_event_ids) > MAX_SEEN_EVENT_IDS:
            self._seen_event_ids.popitem(last=False)
        if sequence:
            self.last_event_sequence = sequence
        self.events_applied += 1
        if isinstance(event, AllocationEvent):
            self._on_allocation(event)
        elif isinstance(event, SchedulingFailedEvent):
            self._on_sched_failed(event)
        elif isinstance(event, OomEvent):
            self._on_oom(event)
        elif isinstance(event, MemoryReclaimEvent):
            self._on_memory_reclaim(event)
        elif isinstance(event, ComputeReclaimEvent):
            self._on_compute_reclaim(event)
        elif isinstance(event, LimitBreachedEvent):
            self._on_limit_breached(event)
        elif isinstance(event, AdmissionEvent):
            self._on_admission(event)
        elif isinstance(event, QuotaEvent):
            self._on_quota(event)
        elif isinstance(event, NodeEvent):
            self._on_node(event)
        elif isinstance(event, PodGoneEvent):
            self._on_pod_gone(event)
        return True

    def _on_allocation(self, event: AllocationEvent) -> None:
        self.alloc_events[(event.node, event.action)] += 1
        self.latency.allocation(event.action, event.namespace, event.name, event.pod_uid, event.at)
        if event.action in ("bound", "allocated", "released"):
            self._clear_pending(event.namespace, event.name)
        if event.action == "released":
            self.breached.pop(event.pod_uid, None)
        grants = [g for container in event.containers for g in container]
        detail = ""
        if grants:
            detail = ": " + ", ".join(
                f"{g.memory_mib} MiB + {g.cores}% of {short_uuid(g.uuid)}" for g in grants[:4])
            if len(grants) > 4:
                detail += f" and {len(grants) - 4} more"
        severity = {"failed": "error", "mismatch": "error", "released": "muted"}.get(
            event.action, "info")
        self._remember(event, "alloc", event.action, event.node,
                       f"{event.namespace}/{event.name} {event.action} on {event.node}{detail}",
                       severity)

    def _on_sched_failed(self, event: SchedulingFailedEvent) -> None:
        self.sched_failures[event.namespace] += 1
        for text in event.node_reasons.values():
            for code in reason_codes(text):
                self.refusals[code] += 1
        key = (event.namespace, event.name)
        summary = event.reason or _summarise(event.node_reasons)
        previous = self.pending.get(key)
        if previous and previous.pod_uid and event.pod_uid and previous.pod_uid != event.pod_uid:
            previous = None  # a new pod under an old name
        if len(self.pending) >= MAX_PENDING:
            self._forget_stale_pending(event.at)
        self.pending[key] = PendingPod(
            namespace=event.namespace,
            name=event.name,
            pod_uid=event.pod_uid,
            since=previous.since if previous else event.at,
            last_at=event.at,
            summary=summary,
            node_reasons=dict(event.node_reasons),
            attempts=(previous.attempts + 1) if previous else 1,
        )
        self.recent.append(RecentEvent(event.at, "sched", "failed", event.namespace,
                                       f"{event.namespace}/{event.name} unschedulable", summary,
                                       "warning"))

    def _on_oom(self, event: OomEvent) -> None:
        self.ooms[(event.node, event.namespace, event.pod, event.container)] += 1
        where = f"{event.namespace}/{event.pod}" + (f" ({event.container})" if event.container
                                                    else "")
        self._remember(event, "oom", "oom", event.node,
                       f"{where} out of GPU memory on {event.node}", "error")

    def _on_memory_reclaim(self, event: MemoryReclaimEvent) -> None:
        """Elastic memory taken back from a borrower (docs/elastic.md)."""
        self.memory_reclaims[(event.node, event.action)] += 1
        where = f"{event.namespace}/{event.pod}" if event.pod else event.pod_uid
        gib = event.borrowed_bytes / (1 << 30)
        text = (f"{where} evicted: {gib:.1f} GiB borrowed on {short_uuid(event.device_uuid)} "
                f"needed by {event.for_pod or 'a guarantee'}" if event.action == "evicted" else
                f"{gib:.1f} GiB borrowed by {where} on {short_uuid(event.device_uuid)} reclaimed "
                f"for {event.for_pod or 'a guarantee'}")  # fmt: skip
        self._remember(event, "memory", event.action, event.node, text,
                       "error" if event.action == "evicted" else "warning")

    def _on_compute_reclaim(self, event: ComputeReclaimEvent) -> None:
        """Lent compute taken back (docs/elastic.md); one event may sum several reclaims."""
        self.compute_reclaims[event.node] += event.reclaims
        where = f"{event.namespace}/{event.pod}" if event.pod else event.pod_uid
        times = "" if event.reclaims == 1 else f" ({event.reclaims} times)"
        self._remember(event, "compute", event.action, event.node,
                       f"compute lent to {where} on {short_uuid(event.device_uuid)} taken back "
                       f"for {', '.join(event.for_pods) or 'busy neighbours'}{times}: up to "
                       f"{event.max_taken_pct:g}% at once", "info")

    def _on_limit_breached(self, event: LimitBreachedEvent) -> None:
        self.limit_breaches[event.breach] += 1
        self.breached.setdefault(event.pod_uid, {})[event.device_uuid] = event.breach
        where = f"{event.namespace}/{event.pod}" if event.pod else event.pod_uid
        self._remember(event, "limit", event.action, event.node,
                       f"{where} breached its {event.breach} limit on "
                       f"{short_uuid(event.device_uuid)} ({event.action})", "error")

    def _on_admission(self, event: AdmissionEvent) -> None:
        self.admission_events[(event.namespace, event.action)] += 1
        if event.action in ("allowed", "mutated"):
            self.latency.admitted(event.namespace, event.name, event.pod_uid, event.at)
        if event.action != "denied" and event.never_placed and event.name:
            self.pending[(event.namespace, event.name)] = PendingPod(
                namespace=event.namespace, name=event.name, pod_uid=event.pod_uid,
                since=event.at, last_at=event.at, summary=event.never_placed, node_reasons={},
                sticky=True)
        self._remember(event, "admission", event.action, event.namespace,
                       f"{event.namespace}/{event.name or '?'} {event.action} by admission",
                       "warning" if event.action == "denied" else "muted")

    def _on_quota(self, event: QuotaEvent) -> None:
        self.quota_events[(event.namespace, event.action)] += 1
        self._remember(event, "quota", event.action, event.namespace,
                       f"quota of {event.namespace} {event.action}",
                       "warning" if event.action == "exceeded" else "info")

    def _on_node(self, event: NodeEvent) -> None:
        self.node_events[(event.node, event.action)] += 1
        registration = self.nodes.get(event.node)
        if event.action == "lost" and registration and registration.heartbeat_at <= event.at:
            # The scheduler saw it go (its KV entry expired): not registered any more.
            self.nodes.pop(event.node, None)
        gpus = f" ({', '.join(map(short_uuid, event.device_uuids))})" if event.device_uuids else ""
        self._remember(event, "node", event.action, event.node,
                       f"node {event.node} {event.action}{gpus}",
                       NODE_EVENT_SEVERITY.get(event.action, "error"))

    def _remember(
        self, event: Event, kind: str, action: str, scope: str, text: str, severity: str
    ) -> None:
        self.recent.append(RecentEvent(event.at, kind, action, scope, text, event.reason,
                                       severity))

    def _on_pod_gone(self, event: PodGoneEvent) -> None:
        """A deleted pod leaves the pending list at once (and, on replay, after a restart)."""
        pending = self.pending.get((event.namespace, event.name))
        if pending is not None and (not event.pod_uid or not pending.pod_uid
                                    or pending.pod_uid == event.pod_uid):
            self._clear_pending(event.namespace, event.name)

    def _clear_pending(self, namespace: str, name: str) -> None:
        self.pending.pop((namespace, name), None)

    def _forget_stale_pending(self, now: float) -> None:
        for key, pod in list(self.pending.items()):
            if now - pod.last_at > PENDING_STALE_S:
                del self.pending[key]

    # --- derived ------------------------------------------------------------------------------

    def snapshot(self) -> ClusterView:
        """A copy that later bus messages do not change, cheap enough to take per scrape, so
        a large exposition can be rendered off the event loop. KV values and usage samples are
        replaced, never mutated, so copying the dicts is enough; the snapshot cannot fold
        events (it keeps no dedupe memory or timelines)."""
        return ClusterView(
            nodes=dict(self.nodes),
            ledgers=dict(self.ledgers),
            quotas=dict(self.quotas),
            usage=dict(self.usage),
            latency=self.latency.histograms_copy(),
            pending=dict(self.pending),
            recent=deque(self.recent, maxlen=RECENT_EVENTS),
            alloc_events=Counter(self.alloc_events),
            node_events=Counter(self.node_events),
            admission_events=Counter(self.admission_events),
            quota_events=Counter(self.quota_events),
            sched_failures=Counter(self.sched_failures),
            refusals=Counter(self.refusals),
            ooms=Counter(self.ooms),
            memory_reclaims=Counter(self.memory_reclaims),
            compute_reclaims=Counter(self.compute_reclaims),
            limit_breaches=Counter(self.limit_breaches),
            breached={pod: dict(gpus) for pod, gpus in self.breached.items()},
            bad_messages=Counter(self.bad_messages),
            rejected=Counter(self.rejected),
            bounds=self.bounds,
            node_stale_s=self.node_stale_s,
            events_applied=self.events_applied,
            last_event_sequence=self.last_event_sequence,
            kv_synced=set(self.kv_synced),
            events_synced=self.events_synced,
        )

    @property
    def synced(self) -> bool:
        return self.events_synced and {"nodes", "ledger", "quota"} <= self.kv_synced

    def pending_pods(self, now: float) -> list[PendingPod]:
        """Pods still waiting: not placed since their last failure, and failing recently."""
        placed = {
            (a.namespace, a.name)
            for ledger in self.ledgers.values()
            for a in ledger.allocations.values()
            if a.state in ("bound", "allocated")
        }
        return sorted(
            (
                pod
                for pod in self.pending.values()
                if (pod.namespace, pod.name) not in placed
                and (pod.sticky or now - pod.last_at <= PENDING_STALE_S)
            ),
            key=lambda pod: pod.since,
        )

    def active_allocations(self, node: str) -> list[Allocation]:
        ledger = self.ledgers.get(node)
        if ledger is None:
            return []
        return sorted(
            (a for a in ledger.allocations.values() if a.active),
            key=lambda a: (a.namespace, a.name),
        )


def counted_containers(allocation: Allocation) -> list[tuple[int, list]]:
    """(container index, grants) that hold capacity: init containers stop once init is done."""
    return [
        (index, grants)
        for index, grants in enumerate(allocation.containers)
        if not (allocation.init_done and index < allocation.init_count
                and index not in allocation.sidecars)
    ]


def _summarise(node_reasons: dict[str, str]) -> str:
    if not node_reasons:
        return "no node fits"
    counts: Counter[str] = Counter()
    for text in node_reasons.values():
        for code in set(reason_codes(text)):
            counts[code] += 1
    top = ", ".join(f"{n} node(s) {code}" for code, n in counts.most_common(3))
    return f"0/{len(node_reasons)} nodes fit: {top}"
