"""The scheduler: filter, prioritize and bind, composed from small parts that each own one concern.

- `filtering`: the pure decision joined to a reservation in the ledger (and quota held),
- `binding`: claim wait, cluster bind, mark bound,
- `release`: ended pods, expired reservations and lapsed claims (the sweep),
- `quota_client`, `failures`, `background`: quota calls, refusal memory, events.

The HTTP layer (api.py) only translates JSON; the watch loops (runtime.py) feed the index and the
quota states and call `release` / `sweep`. Everything is passed in (no globals).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from tessera import hami
from tessera.cluster.port import ClusterPort
from tessera.models import QuotaState
from tessera.settings import TesseraSettings
from tessera.signing import process_signer

from .acks import JetStreamAcks
from .background import BackgroundTasks, EventPublisher
from .binding import PodBinder
from .config import SchedulerSettings
from .failures import FailureLog
from .filtering import FilterOutcome, PodFilter, prioritize
from .index import ClusterIndex
from .indexed_ledger import IndexedLedger
from .kube_events import PodEventRecorder
from .ledger import ClaimAhead, LedgerWriter
from .metrics import SchedulerMetrics
from .node_reasons import NodeReasons
from .pods import PodIdentity
from .preemption_run import Preemptor
from .quota_client import QuotaClient
from .release import AllocationReleaser
from .rules import RESOURCE_QUOTA_NOT_FIT


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
        self.cluster = cluster
        self.metrics = metrics
        self.instance = instance
        self.clock = clock
        # namespace -> quota state; the runtime's quota watch writes it, filter reads it.
        self.quotas: dict[str, QuotaState] = {}
        self.tasks = BackgroundTasks()
        # A reservation also puts the pod in flight when its bind could (one write fewer).
        ledger.claim_ahead = ClaimAhead(instance, config.claim_ttl_s, config.max_in_flight_per_node)
        acks = JetStreamAcks(nc)  # ledger writes and events wait for their acks there
        ledger.acks = acks
        publisher = EventPublisher(js, self.tasks, acks=acks)
        indexed = IndexedLedger(ledger, index, clock)
        quota = QuotaClient(nc, settings, self.tasks,
                            process_signer(settings.command_key_file, clock))
        self.failures = FailureLog(metrics, publisher, instance, clock)
        self.pod_events = PodEventRecorder(cluster, self.tasks, clock)
        self.releaser = AllocationReleaser(
            ledger=indexed, cluster=cluster, quota=quota, publisher=publisher, metrics=metrics,
            config=config, instance=instance, clock=clock,
        )  # fmt: skip
        self.pod_filter = PodFilter(
            settings=settings, config=config, ledger=indexed, quota=quota, quotas=self.quotas,
            releaser=self.releaser, failures=self.failures, publisher=publisher,
            metrics=metrics, instance=instance, clock=clock,
        )  # fmt: skip
        self.preemption = Preemptor(
            settings=settings, config=config, ledger=indexed, cluster=cluster,
            releaser=self.releaser, quota=quota, publisher=publisher, instance=instance,
            clock=clock, pod_events=self.pod_events,
        )  # fmt: skip
        self.binder = PodBinder(
            config=config, ledger=indexed, cluster=cluster, pod_filter=self.pod_filter,
            releaser=self.releaser, publisher=publisher, metrics=metrics, instance=instance,
            clock=clock,
        )  # fmt: skip

    async def filter(
        self, pod: dict[str, Any], names: list[str], *, dry_run: bool = False
    ) -> FilterOutcome:
        if not dry_run:
            waiting = self._waiting_for_preemption(pod, names)
            if waiting is not None:
                return waiting
        outcome = await self.pod_filter.filter(pod, names, dry_run=dry_run)
        if not dry_run and not (outcome.passed_all or outcome.nodenames or outcome.error):
            await self._preempt(pod, names, outcome)
        if not dry_run and not outcome.passed_all:
            self.pod_events.filtered(pod, outcome.nodenames or [], outcome.failed, outcome.error,
                                     outcome.unresolvable)
        return outcome

    def _waiting_for_preemption(
        self, pod: dict[str, Any], names: list[str]
    ) -> FilterOutcome | None:
        """A nominee whose victims are still going: refused everywhere, saying whom it waits
        for (never bound onto GPU memory still in use)."""
        uid = (pod.get("metadata") or {}).get("uid") if isinstance(pod, dict) else None
        waiting = self.preemption.waiting_summary(uid) if isinstance(uid, str) and uid else None
        if waiting is None:
            return None
        _node, sentence = waiting
        failed = NodeReasons.uniform(names, sentence)
        self.failures.remember(PodIdentity.of(pod), failed, sentence)
        self.pod_events.filtered(pod, [], failed, "")
        return FilterOutcome(failed=failed)

    async def _preempt(self, pod: dict[str, Any], names: list[str], outcome: FilterOutcome) -> None:
        """The pod fit no node: try preemption (not when quota or the request itself refused)."""
        failed = outcome.failed
        texts = failed.texts() if isinstance(failed, NodeReasons) else failed.values()
        if outcome.unresolvable or any(r.startswith(RESOURCE_QUOTA_NOT_FIT) for r in texts):
            return
        sentence = await self.preemption.preempt(pod, names)
        if sentence is None:
            return
        outcome.failed = {n: f"{r}; {sentence}" if r else sentence
                          for n, r in {**dict.fromkeys(names, ""), **outcome.failed}.items()}
        self.failures.remember(PodIdentity.of(pod), outcome.failed, sentence)

    def prioritize(self, pod: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
        return prioritize(self.index, self.settings, pod, names)

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """'' on success, else the error text kube-scheduler shows."""
        error = await self.binder.bind(namespace, name, uid, node)
        self.pod_events.bound(namespace, name, uid, node, error)
        return error

    async def release(self, node: str, uid: str, *, why: str) -> bool:
        """Remove the pod's allocation (ledger, quota, event). True when this call removed it.
        A preemption victim stays until its GPU memory is seen free (preemption_run.py); a
        nominee gives its nomination up."""
        if await self.preemption.defer_release(node, uid):
            return False
        await self.preemption.forget_nominee(node, uid)
        return await self.releaser.release(node, uid, why=why)

    async def sweep(self) -> int:
        """Drop every expired reservation and lapsed claim; returns how many pods were dropped.
        Also moves preemptions on (victims whose memory is back, lapsed nominations)."""
        dropped = await self.releaser.sweep()
        await self.preemption.tick()
        return dropped

    async def drain(self, timeout: float = 3.0) -> None:
        """Wait (bounded) for background publishes and quota releases to finish."""
        await self.tasks.drain(timeout)

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
