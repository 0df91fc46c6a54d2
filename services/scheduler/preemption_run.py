"""Preemption at work: nominate, evict, wait for the GPU memory to come back, hand over.

The decision is pure (preemption.py) and the ledger writes are CAS mutates (preemption_ledger.py);
this module does the I/O around them:

1. `preempt` (a pod fit no node): pick the victims, nominate the pod on the node (one CAS that
   reserves its grants and marks the victims), set `status.nominatedNodeName`, evict each victim
   through the Eviction API (so its grace period runs; a PodDisruptionBudget refusal abandons the
   nomination), publish `preemption.<ns>.started`.
2. While any victim is still marked, the pod's filter answers "waiting for preemption of …" (it
   is never bound onto memory still in use), and so do explain and the pod's events.
3. A victim whose pod is deleted is *not* released at once (`defer_release`): its allocation stays
   (the node agent keeps reporting its containers) until a usage sample from its node, received
   after the deletion, shows NVML's free memory on each card the nominee needs covers the
   nominee's grant there. Then it is released (ledger, quota, `alloc.released`).
4. When no victim is marked any more the pod's own reservation is an ordinary one: the next filter
   passes it to bind, and `preemption.<ns>.done` (outcome `placed`) is published.
5. A nomination whose victims are not gone by its deadline (largest victim grace period + margin)
   lapses: the reservation expires (the sweeper drops it), the marks stop counting, victims still
   deferred are released as before, and the pod is re-evaluated from scratch (`done`, outcome
   `re-evaluated`). A nominee deleted meanwhile gives its nomination up at once (`pod-deleted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tessera import bus
from tessera.bus import CasConflictError
from tessera.cluster.port import (
    ClusterError,
    ClusterPort,
    DisruptionRefusedError,
    NotFoundError,
    ObjectRef,
    WatchEvent,
)
from tessera.hami import RequestError
from tessera.models import Allocation, NodeLedger, PreemptionEvent, UsageSample
from tessera.settings import TesseraSettings
from tessera.validation import MAX_GRACE_S

from .background import EventPublisher
from .cards import allocation_usage
from .config import SchedulerSettings
from .index import ClusterIndex
from .indexed_ledger import IndexedLedger
from .kube_events import PodEventRecorder
from .ledger import NodeFullError
from .pods import PodIdentity, container_names, parse_pod
from .preemption import (
    ClusterView,
    DisruptionBudget,
    NodeBlock,
    NodeState,
    PreemptionQuery,
    VictimSet,
    may_preempt,
    pod_priority,
    select_victims,
)
from .preemption_ledger import (
    NominationRequest,
    VictimGoneError,
    abandon,
    hand_over,
    marked_victims,
    nominate,
)
from .quota_client import QuotaClient, grants_charge
from .release import AllocationReleaser
from .rules import FitContext, QuotaBudget
from .wire_fast import LedgerWire

log = logging.getLogger("tessera.scheduler")
DEFAULT_GRACE_S = 30
MIB = 1 << 20
FULL_SCAN_S = 30.0


@dataclass
class PodFacts:
    """What preemption needs to know of a pod, from the pod watch."""

    namespace: str
    name: str
    priority: int
    labels: dict[str, str]
    grace_s: int
    deleting: bool


def pod_facts(pod: dict[str, Any]) -> PodFacts:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    grace = spec.get("terminationGracePeriodSeconds")
    labels = meta.get("labels") or {}
    return PodFacts(
        namespace=str(meta.get("namespace") or "default"), name=str(meta.get("name") or ""),
        priority=pod_priority(pod),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
        grace_s=grace if isinstance(grace, int) and 0 <= grace <= MAX_GRACE_S else DEFAULT_GRACE_S,
        deleting=bool(meta.get("deletionTimestamp")),
    )  # fmt: skip


def budgets_of(pdbs: list[dict[str, Any]], pods: dict[str, PodFacts]) -> list[DisruptionBudget]:
    """PodDisruptionBudgets (policy/v1) as victim selection counts them: matchLabels selectors
    (a budget with matchExpressions protects every pod of its namespace: fail safe)."""
    out = []
    for pdb in pdbs:
        meta, spec = pdb.get("metadata") or {}, pdb.get("spec") or {}
        namespace = meta.get("namespace") or "default"
        selector = spec.get("selector") or {}
        wanted = selector.get("matchLabels") or {}
        expressions = bool(selector.get("matchExpressions"))
        allowed = (pdb.get("status") or {}).get("disruptionsAllowed", 0)
        covered = frozenset(
            uid for uid, facts in pods.items()
            if facts.namespace == namespace
            and (expressions or all(facts.labels.get(k) == v for k, v in wanted.items()))
        )  # fmt: skip
        name = f"{namespace}/{meta.get('name', '')}"
        out.append(DisruptionBudget(name, allowed if isinstance(allowed, int) else 0, covered))
    return out


def memory_returned(sample: UsageSample, nominee: Allocation | None, victim: Allocation) -> bool:
    """Does NVML (the agent's host view) show, on every card the victim held that the nominee
    will use, at least the nominee's grant free?"""
    need: dict[str, int] = {}
    if nominee is not None:
        for uuid, usage in allocation_usage(nominee).items():
            need[uuid] = usage.memory_mib * MIB
    host = {d.uuid: d for d in sample.devices}
    for uuid in allocation_usage(victim):
        if uuid not in need:
            continue
        device = host.get(uuid)
        if device is None or device.total_bytes - device.used_bytes < need[uuid]:
            return False
    return True


@dataclass
class Nomination:
    """A nomination in progress, started by this replica or seen in the ledger (for its `done`
    event, which every replica that sees the end publishes under one event id)."""

    node: str
    namespace: str
    name: str
    priority: int
    victims: list[str]
    victim_uids: list[str]
    deadline: float
    priority_seen: bool = True  # False: adopted before the pod watch told its priority


@dataclass
class Preemptor:
    settings: TesseraSettings
    config: SchedulerSettings
    ledger: IndexedLedger
    cluster: ClusterPort | None
    releaser: AllocationReleaser
    quota: QuotaClient
    publisher: EventPublisher
    instance: str
    clock: Callable[[], float] = time.time
    pods: dict[str, PodFacts] = field(default_factory=dict)
    gone: dict[str, float] = field(default_factory=dict)  # victim uid -> when its pod was gone
    usage: dict[str, tuple[float, UsageSample]] = field(default_factory=dict)
    attempts: dict[str, float] = field(default_factory=dict)
    started: dict[str, Nomination] = field(default_factory=dict)
    marked_nodes: set[str] = field(default_factory=set)
    blocks: dict[str, tuple[int, NodeBlock]] = field(default_factory=dict)
    view: tuple[tuple[int, ...], ClusterView] | None = None
    priority_map: dict[str, int] | None = None
    last_full_scan: float = 0.0
    # Set once the pod watch has replayed its first listing (runtime.py); until then `pods` is
    # not every pod of the cluster. None: no watch says otherwise (the pods are taken as known).
    pods_listed: asyncio.Event | None = None
    pod_events: PodEventRecorder | None = None  # the victims' `Preempted` events
    # how many of `pods` have each priority (kept by `observe_pod`): whether anyone could be
    # evicted for a pod is a min over the distinct priorities, not a scan of every pod per
    # refusal (a backlog of unschedulable pods asks on every retry)
    priority_counts: Counter[int] = field(default_factory=Counter)
    _counted: int = 0  # len(pods) when priority_counts was last made whole

    @property
    def index(self) -> ClusterIndex:
        return self.ledger.index

    @property
    def listed(self) -> bool:
        """Is `pods` the cluster's pods (a pod missing from it gone)? Not before the pod watch
        has replayed its first listing, which a restart lets run once it serves."""
        return self.pods_listed is None or self.pods_listed.is_set()

    # --- what the watches tell it -----------------------------------------------------------

    def observe_pod(self, event: WatchEvent) -> None:
        uid = (event.object.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        if event.type == "DELETED":
            self._count(self.pods.pop(uid, None), None)
            self.attempts.pop(uid, None)
            self.priority_map = None
            return
        facts = pod_facts(event.object)
        old = self.pods.get(uid)
        if old != facts:
            self.priority_map = None
        self._count(old, facts)
        self.pods[uid] = facts

    def _count(self, old: PodFacts | None, new: PodFacts | None) -> None:
        counts = self.priority_counts
        if old is not None:
            counts[old.priority] -= 1
            if counts[old.priority] <= 0:
                del counts[old.priority]
            self._counted -= 1
        if new is not None:
            counts[new.priority] += 1
            self._counted += 1

    def _lowest_priority(self) -> int | None:
        """The lowest priority among `pods` (None: no pod)."""
        if self._counted != len(self.pods):  # (pods set other than through observe_pod)
            self.priority_counts = Counter(f.priority for f in self.pods.values())
            self._counted = len(self.pods)
        return min(self.priority_counts, default=None)

    def observe_ledger(self, node: str, ledger: NodeLedger | LedgerWire | None) -> None:
        """A ledger entry the watch applied: nominations in it are followed by the tick (any
        replica, so the `done` event survives the loss of the one that started it). An entry
        read at start-up whose allocations are known to be unmarked (`LedgerWire.holding`) is
        not scanned."""
        if ledger is None or node in self.marked_nodes or (
            type(ledger) is LedgerWire and ledger.holding
        ):  # fmt: skip
            return
        if any(a.preempted_by for a in ledger.allocations.values()):
            self.marked_nodes.add(node)

    def observe_usage(self, sample: UsageSample) -> None:
        self.usage[sample.node] = (self.clock(), sample)

    # --- the nominee's view ---------------------------------------------------------------------

    def waiting(self, uid: str) -> tuple[str, list[Allocation]] | None:
        """(node, victims still being evicted) when the pod is a nominee that must wait."""
        node = self.index.pod_nodes.get(uid)
        entry = self.index.entries.get(node) if node else None
        if node is None or entry is None:
            return None
        victims = marked_victims(entry.ledger, uid, self.clock())
        return (node, victims) if victims else None

    @staticmethod
    def describe(node: str, victims: list[Allocation]) -> str:
        names = ", ".join(f"{v.namespace}/{v.name}" for v in victims)
        return f"waiting for preemption of {names} on {node}"

    def waiting_summary(self, uid: str) -> tuple[str, str] | None:
        waiting = self.waiting(uid)
        return None if waiting is None else (waiting[0], self.describe(*waiting))

    # --- the victims' release ---------------------------------------------------------------

    async def defer_release(self, node: str, uid: str) -> bool:
        """A victim's pod ended: keep its allocation until its GPU memory is seen returned.

        The mark is written (by whichever replica nominated) before the eviction, so the ledger
        itself always shows it by the time the pod is gone; this replica's index may not yet
        (its watch lags): then the key is read."""
        now = self.clock()
        if not self._under_mark(self._indexed(node, uid), now):
            if not self.config.preemption:
                return False
            try:
                current = await bus.read(self.ledger.writer.kv, node, NodeLedger)
            except Exception as exc:  # cannot tell: released as before this check existed
                log.warning("preemption: ledger unreadable", extra={"node": node, "err": str(exc)})
                return False
            held = current.value.allocations.get(uid) if current is not None else None
            if not self._under_mark(held, now):
                return False
        self.gone.setdefault(uid, now)
        self.marked_nodes.add(node)
        return True

    def _indexed(self, node: str, uid: str) -> Allocation | None:
        entry = self.index.entries.get(node)
        return entry.ledger.allocations.get(uid) if entry and entry.ledger else None

    @staticmethod
    def _under_mark(held: Allocation | None, now: float) -> bool:
        return held is not None and held.preempted_until is not None and now < held.preempted_until

    async def forget_nominee(self, node: str, uid: str) -> None:
        """The nominee's pod is gone: give the nomination up (reservation and marks)."""
        entry = self.index.entries.get(node)
        if entry is None or not marked_victims(entry.ledger, uid, self.clock()):
            return
        held = entry.ledger.allocations.get(uid) if entry.ledger else None
        await self._abandon(node, uid, held, outcome="pod-deleted", why="the pod was deleted")

    async def _abandon(
        self, node: str, uid: str, held: Allocation | None, *, outcome: str, why: str
    ) -> None:
        entry = self.index.entries.get(node)
        victims = [a.pod_uid for a in marked_victims(entry.ledger if entry else None, uid,
                                                       self.clock())]  # fmt: skip
        # Taken out first: the sweep's tick must not report this nomination's end differently
        # while the CAS below is in flight.
        nomination = self.started.pop(uid, None)
        try:
            async with self.ledger.lock(node):
                result = await abandon(self.ledger.writer.kv, node, uid, self.clock())
        except CasConflictError:
            if nomination is not None:
                self.started[uid] = nomination  # not ended: the tick or a retry will end it
            return
        self.ledger.apply(node, result)
        for victim in victims:  # already gone: no nomination holds them back any more
            if self.gone.pop(victim, None) is not None:
                await self.releaser.release(node, victim, why="evicted; its nomination ended")
        if held is not None and held.quota_held:
            self.quota.release_soon(held.namespace, uid, held.name)
        self._done(uid, outcome, why, nomination)

    def _done(self, uid: str, outcome: str, why: str, nomination: Nomination | None = None) -> None:
        """Publish `done` for a nomination this replica follows. Every replica that follows it
        publishes the same event id (pod uid + deadline): the stream keeps the first."""
        nomination = nomination or self.started.pop(uid, None)
        if nomination is None:
            return
        self.publisher.publish_soon(PreemptionEvent(
            event_id=f"{uid}:preemption:{nomination.deadline}:done", action="done",
            namespace=nomination.namespace, name=nomination.name, pod_uid=uid,
            node=nomination.node, priority=nomination.priority, victims=nomination.victims,
            victim_uids=nomination.victim_uids, deadline=nomination.deadline,
            outcome=outcome, reason=why, source=self.instance,  # type: ignore[arg-type]
        ))  # fmt: skip

    async def tick(self) -> None:
        """Release victims whose memory is back; close nominations that ended."""
        now = self.clock()
        if now - self.last_full_scan >= FULL_SCAN_S:  # after a restart: find marks we did not set
            self.last_full_scan = now
            for name, entry in self.index.entries.items():
                view = entry.view  # read as it is: building every node's models is costly
                if view and any(a.preempted_by for a in view.allocations.values()):
                    self.marked_nodes.add(name)
        for node in list(self.marked_nodes):
            entry = self.index.entries.get(node)
            ledger = entry.ledger if entry else None
            marked = [a for a in (ledger.allocations.values() if ledger else ())
                      if a.preempted_by and a.preempted_until is not None]  # fmt: skip
            if not marked:
                self.marked_nodes.discard(node)
                continue
            self._adopt(node, ledger, marked, now)
            for victim in marked:
                await self._settle_victim(node, victim, now)
        for uid, nomination in list(self.started.items()):
            entry = self.index.entries.get(nomination.node)
            ledger = entry.ledger if entry else None
            if marked_victims(ledger, uid, now):
                continue
            held = ledger.allocations.get(uid) if ledger else None
            facts = self.pods.get(uid)
            if not nomination.priority_seen and facts is not None:
                nomination.priority, nomination.priority_seen = facts.priority, True
            if held is not None and held.active and now < nomination.deadline:
                await self._hand_over(nomination.node, uid, now)
                self._done(uid, "placed", "the victims' GPU memory is free")
            elif now < nomination.deadline and not self.listed:
                continue  # the pod may exist, not seen yet: decided once the watch has listed
            elif now < nomination.deadline and uid not in self.pods:
                self._done(uid, "pod-deleted", "the pod was deleted")
            else:
                why = ("the victims did not go before the deadline" if now >= nomination.deadline
                       else "the nomination was given up")  # fmt: skip
                self._done(uid, "re-evaluated", why)
                await self._clear_nomination(nomination.namespace, nomination.name)

    def _adopt(
        self, node: str, ledger: NodeLedger | None, marked: list[Allocation], now: float
    ) -> None:
        """Follow nominations seen in the ledger that another replica (or this one before a
        restart) started: each is known by its nominee's reservation and its victims' marks."""
        if ledger is None:
            return
        for uid in {a.preempted_by for a in marked} - self.started.keys():
            victims = marked_victims(ledger, uid, now)
            nominee = ledger.allocations.get(uid)
            if not victims or nominee is None or not nominee.active:
                continue
            facts = self.pods.get(uid)
            self.started[uid] = Nomination(
                node, nominee.namespace, nominee.name, facts.priority if facts else 0,
                [f"{v.namespace}/{v.name}" for v in victims], [v.pod_uid for v in victims],
                max(v.preempted_until or 0.0 for v in victims), priority_seen=facts is not None,
            )  # fmt: skip

    async def _hand_over(self, node: str, uid: str, now: float) -> None:
        """Every victim is gone: the nominee's reservation becomes an ordinary one, with the
        usual time to be bound from now (the nomination's deadline may be close)."""
        try:
            async with self.ledger.lock(node):
                result = await hand_over(self.ledger.writer.kv, node, uid, now,
                                         self.settings.reservation_ttl_s)  # fmt: skip
        except CasConflictError:
            return
        self.ledger.apply(node, result)

    async def _settle_victim(self, node: str, victim: Allocation, now: float) -> None:
        uid = victim.pod_uid
        assert victim.preempted_until is not None
        if now >= victim.preempted_until:  # the nomination lapsed: an ordinary release again
            if uid in self.gone:
                self.gone.pop(uid, None)
                await self.releaser.release(node, uid, why="evicted; nomination lapsed")
            return
        gone_at = self.gone.get(uid)
        if gone_at is None:
            return
        seen = self.usage.get(node)
        if seen is None or seen[0] <= gone_at:
            return  # no usage report since the pod went: its memory is not known to be back
        entry = self.index.entries.get(node)
        ledger = entry.ledger if entry else None
        nominee = ledger.allocations.get(victim.preempted_by) if ledger else None
        if not memory_returned(seen[1], nominee, victim):
            return
        self.gone.pop(uid, None)
        await self.releaser.release(
            node, uid, why="evicted for a higher-priority pod; its GPU memory is free"
        )

    async def _clear_nomination(self, namespace: str, name: str) -> None:
        if self.cluster is None:
            return
        with contextlib.suppress(ClusterError):
            await self.cluster.set_nominated_node(namespace, name, None)

    # --- starting a preemption ----------------------------------------------------------------

    async def preempt(self, pod: dict[str, Any], names: list[str]) -> str | None:
        """Called when the pod fits none of `names`. Returns the sentence for its refusal when a
        preemption is under way (or started now), None when preemption cannot help."""
        if not self.config.preemption or self.cluster is None:
            return None
        if not self.listed:  # victims and budgets are chosen among pods the watch has seen
            return None
        ident = PodIdentity.of(pod)
        if not ident.uid or not may_preempt(pod):
            return None
        priority = pod_priority(pod)
        lowest = self._lowest_priority()
        if lowest is None or lowest >= priority:
            return None  # nobody to evict (e.g. no PriorityClasses in use): cost nothing
        now = self.clock()
        last = self.attempts.get(ident.uid)
        if last is not None and now - last < self.config.preemption_retry_s:
            return None
        self.attempts[ident.uid] = now
        try:
            request, options = parse_pod(pod, self.settings)
        except RequestError:
            return None
        blocks = self._blocks(names, now)
        if not blocks:
            return None
        try:
            pdbs = await self.cluster.list_disruption_budgets()
        except ClusterError as exc:
            log.warning("preemption: cannot read disruption budgets", extra={"err": str(exc)})
            return None
        live = {u: f for u, f in self.pods.items() if not f.deleting}
        if self.priority_map is None:  # rebuilt only after a pod event (kept: the view caches)
            self.priority_map = {u: f.priority for u, f in live.items()}
        query = PreemptionQuery(
            pod_uid=ident.uid, request=request, options=options, priority=pod_priority(pod),
            priorities=self.priority_map,
            budgets=tuple(budgets_of(pdbs, live)), now=now,
        )  # fmt: skip
        key = tuple(id(b) for b in blocks)
        if self.view is None or self.view[0] != key:  # kept while no candidate node changed
            self.view = (key, ClusterView.of_blocks(blocks))
        choice = select_victims(self.view[1], query)
        if choice is None:
            return None
        return await self._nominate(pod, ident, choice, request, options, query)

    def _blocks(self, names: list[str], now: float) -> list[NodeBlock]:
        """The candidate nodes' rows, kept per node while its ledger revision, registration and
        cordon stay the same and no reservation or mark in it expires."""
        out = []
        for name in names:
            entry = self.index.entries.get(name)
            if entry is None or entry.registration is None or entry.ledger is None:
                continue
            cordon = self.index.cordon_of(entry)
            cached = self.blocks.get(name)
            if (
                cached is None or cached[0] != entry.ledger_revision or now >= cached[1].valid_until
                or cached[1].node.registration is not entry.registration
                or cached[1].node.cordoned != cordon
            ):
                state = NodeState(name, entry.registration, entry.ledger.allocations, cordon)
                cached = (entry.ledger_revision, NodeBlock.of(state, now))
                self.blocks[name] = cached
            out.append(cached[1])
        return out

    async def _nominate(
        self, pod: dict[str, Any], ident: PodIdentity, choice: VictimSet, request: Any,
        options: Any, query: PreemptionQuery,
    ) -> str | None:
        now = query.now
        grace = max((self.pods[v.pod_uid].grace_s for v in choice.victims
                     if v.pod_uid in self.pods), default=DEFAULT_GRACE_S)  # fmt: skip
        deadline = now + grace + self.config.preemption_margin_s
        held_quota = False
        if self.settings.quota_enabled:
            charge = grants_charge(choice.containers, len(request.init), request.sidecars)
            if await self.quota.reserve(ident, charge):
                return None  # the namespace's quota refuses it anyway: evicting will not help
            held_quota = True
        entry = self.index.entries[choice.node]
        assert entry.registration is not None
        template = Allocation(
            pod_uid=ident.uid, namespace=ident.namespace, name=ident.name, node=choice.node,
            containers=[], init_count=len(request.init), sidecars=sorted(request.sidecars),
            priority=next((r.priority for r in request.all if r and r.priority is not None), 1),
            core_policy=self.settings.core_policy, scrub_on_free=options.scrub_on_free,
            memory_reclaim=options.memory_reclaim, memory_wait_s=options.memory_wait_s,
            container_names=container_names(pod), quota_held=held_quota,
        )  # fmt: skip
        nomination = NominationRequest(
            registration=entry.registration, cordoned=self.index.cordon_of(entry),
            request=request, ctx_factory=lambda: FitContext(options, QuotaBudget()),
            template=template, victims=frozenset(v.pod_uid for v in choice.victims),
            now=now, deadline=deadline,
        )  # fmt: skip
        try:
            async with self.ledger.lock(choice.node):
                result = await nominate(self.ledger.writer.kv, nomination)
        except (NodeFullError, VictimGoneError, CasConflictError) as exc:
            log.info("preemption: nomination lost a race", extra={"pod": ident.name,
                                                                  "err": str(exc)})  # fmt: skip
            if held_quota:
                self.quota.release_soon(ident.namespace, ident.uid, ident.name)
            return None
        self.ledger.apply(choice.node, result)
        self.marked_nodes.add(choice.node)
        victims = choice.names()
        self.started[ident.uid] = Nomination(
            choice.node, ident.namespace, ident.name, query.priority, victims,
            [v.pod_uid for v in choice.victims], deadline,
        )  # fmt: skip
        self.publisher.publish_soon(PreemptionEvent(
            event_id=f"{ident.uid}:preemption:{deadline}:started", action="started",
            namespace=ident.namespace, name=ident.name, pod_uid=ident.uid, node=choice.node,
            priority=query.priority, victims=victims,
            victim_uids=[v.pod_uid for v in choice.victims], deadline=deadline,
            reason=f"fits no node; evicting {len(victims)} lower-priority pod(s) on "
                   f"{choice.node}", source=self.instance,
        ))  # fmt: skip
        assert self.cluster is not None
        try:
            await self.cluster.set_nominated_node(ident.namespace, ident.name, choice.node)
        except ClusterError as exc:
            log.warning("preemption: nominatedNodeName not set", extra={"err": str(exc)})
        for victim in choice.victims:
            try:
                await self.cluster.evict_pod(victim.namespace, victim.name, victim.pod_uid)
                if self.pod_events is not None:
                    self.pod_events.preempted(
                        ObjectRef(namespace=victim.namespace, name=victim.name,
                                  uid=victim.pod_uid),
                        ObjectRef(namespace=ident.namespace, name=ident.name, uid=ident.uid),
                        choice.node,
                    )  # fmt: skip
            except NotFoundError:
                self.gone.setdefault(victim.pod_uid, self.clock())  # already gone
            except DisruptionRefusedError as exc:
                await self._abandon(choice.node, ident.uid, result.value.allocations.get(ident.uid),
                                    outcome="re-evaluated", why=str(exc))  # fmt: skip
                await self._clear_nomination(ident.namespace, ident.name)
                return f"preemption on {choice.node} refused: {exc}"
            except ClusterError as exc:  # the deadline re-evaluates it if it never goes
                log.warning("preemption: eviction failed", extra={"victim": victim.name,
                                                                  "err": str(exc)})  # fmt: skip
        return self.describe(choice.node, list(choice.victims))
