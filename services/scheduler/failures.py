"""Why pods were refused: remembered for explain, counted in metrics, announced as events."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import islice

from tessera.models import SchedulingFailedEvent

from .background import EventPublisher
from .metrics import SchedulerMetrics
from .node_reasons import NodeReasons
from .pods import PodIdentity

_FAILURE_MEMORY = 10_000
_REPUBLISH_SAME_FAILURE_S = 30.0


@dataclass
class FailureRecord:
    node_reasons: Mapping[str, str]  # (a NodeReasons builds its dict when explain reads it)
    summary: str
    at: float
    published: bool = False  # its event reached the stream
    pending: bool = False  # its event is being published (retried until it lands)


class FailureLog:
    """The latest refusal per pod (by uid and by namespace/name), bounded, oldest forgotten.

    The same reasons again within 30 s are not published again (kube-scheduler retries often)."""

    def __init__(
        self,
        metrics: SchedulerMetrics,
        publisher: EventPublisher,
        instance: str,
        clock: Callable[[], float],
    ) -> None:
        self.metrics = metrics
        self.publisher = publisher
        self.instance = instance
        self.clock = clock
        self.records: OrderedDict[str, FailureRecord] = OrderedDict()

    def get(self, key: str) -> FailureRecord | None:
        """The record for a pod uid or a `namespace/name`."""
        return self.records.get(key)

    def forget(self, uid: str) -> None:
        self.records.pop(uid, None)

    def forget_pod(self, uid: str, namespace: str, name: str) -> bool:
        """Drop a deleted pod's refusal (by uid and by name); True when one was remembered."""
        by_uid = self.records.pop(uid, None) if uid else None
        key = f"{namespace}/{name}"
        by_name = self.records.get(key)
        if by_name is not None and (by_uid is None or by_name is by_uid):
            del self.records[key]
        return by_uid is not None or by_name is not None

    def count_refusal(self, counts: dict[str, int]) -> None:
        """One unschedulable pod; per reason, how many nodes refused it for that reason."""
        self.metrics.unschedulable.inc()
        for reason, nodes in counts.items():
            self.metrics.refusals.labels(reason=reason).inc(nodes)
            self.metrics.hami_allocation_failures.labels(reason=reason).inc()

    def remember(self, ident: PodIdentity, reasons: Mapping[str, str], summary: str) -> None:
        now = self.clock()
        key = ident.uid or f"{ident.namespace}/{ident.name}"
        previous = self.records.pop(key, None)
        repeat = (
            previous is not None
            and previous.node_reasons == reasons
            and now - previous.at < _REPUBLISH_SAME_FAILURE_S
        )
        # A repeat keeps the same record, so the callback of a publish still in flight
        # (or retried) lands on the record explain and later repeats read.
        record = previous if repeat and previous is not None else FailureRecord(
            reasons, summary, now
        )
        record.summary = summary
        self.records[key] = record
        self.records[f"{ident.namespace}/{ident.name}"] = record
        while len(self.records) > _FAILURE_MEMORY:
            self.records.popitem(last=False)
        if repeat and (record.published or record.pending):
            # Suppressed only once the earlier one is known to have reached the stream (or is
            # still being retried): a repeat must never hide a lost event.
            return
        record.pending = True

        def published(landed: bool) -> None:
            record.published, record.pending = landed, False

        self.publisher.publish_soon(SchedulingFailedEvent(
            namespace=ident.namespace, name=ident.name, pod_uid=ident.uid, reason=summary,
            node_reasons=(reasons.head(200) if isinstance(reasons, NodeReasons)
                          else dict(islice(reasons.items(), 200))), source=self.instance,
        ), published)  # fmt: skip
