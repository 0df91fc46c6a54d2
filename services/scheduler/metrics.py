"""The scheduler's own Prometheus metrics (tessera_scheduler_*), on a registry per instance.

HAMi's scheduler metric names (hami_gpu_memory_allocated_bytes, ...) describe the ledger, not this
process; the metrics service derives them from the bus so that they stay single-valued with any
number of scheduler replicas (see README).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tessera import __version__

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.filter_seconds = Histogram(
            "tessera_scheduler_filter_seconds", "Filter call latency (HTTP handler)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.fit_seconds = Histogram(
            "tessera_scheduler_fit_seconds", "Pure placement decision latency per pod",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.bind_seconds = Histogram(
            "tessera_scheduler_bind_seconds", "Bind call latency, including claim waits",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "tessera_scheduler_refusals_total",
            "Nodes refusing an unschedulable pod, by HAMi reason (a node counts once per reason)",
            ["reason"],
            registry=r,
        )  # fmt: skip
        self.unschedulable = Counter(
            "tessera_scheduler_unschedulable_total", "Pods that fit no candidate node", registry=r
        )
        self.backlog_deferred = Counter(
            "tessera_scheduler_backlog_deferred_total",
            "Retries of refused pods answered without an evaluation: the backlog was over its "
            "share of the scheduler (backlog.py)", registry=r,
        )  # fmt: skip
        self.backlog_cpu = Counter(
            "tessera_scheduler_backlog_cpu_seconds_total",
            "CPU the filter spent on calls that refused the pod", registry=r,
        )  # fmt: skip
        self.placed = Counter(
            "tessera_scheduler_reservations_total", "Reservations written to the ledger",
            registry=r,
        )  # fmt: skip
        self.bound = Counter("tessera_scheduler_binds_total", "Successful binds", registry=r)
        self.bind_errors = Counter(
            "tessera_scheduler_bind_errors_total", "Binds answered with an error", registry=r
        )
        self.claim_waits = Counter(
            "tessera_scheduler_claim_waits_total", "Binds that waited for another pod's claim",
            registry=r,
        )  # fmt: skip
        self.expired = Counter(
            "tessera_scheduler_reservations_expired_total", "Reservations dropped unbound",
            registry=r,
        )  # fmt: skip
        self.released = Counter(
            "tessera_scheduler_releases_total", "Allocations released for ended/deleted pods",
            registry=r,
        )  # fmt: skip
        self.inflight_claims = Gauge(
            "tessera_scheduler_inflight_claims", "Nodes whose in-flight claim is held",
            registry=r,
        )  # fmt: skip
        self.nodes = Gauge("tessera_scheduler_nodes", "Registered nodes in the index", registry=r)
        self.ready = Gauge("tessera_scheduler_ready", "1 once the index is synced", registry=r)
        self.ledger_restored = Counter(
            "tessera_scheduler_ledger_restored_total",
            "Allocations the ledger had lost, restored from bound pods' annotations", registry=r,
        )  # fmt: skip
        self._hami_compatible(r)

    def _hami_compatible(self, r: CollectorRegistry) -> None:
        """HAMi's scheduler counters, so its dashboards and alerts find them.

        Names from HAMi's issues #2341/#3083 and its monitoring docs; HAMi documents no label
        set for them, so the labels are bounded ones of ours: `result` (success|failure) and,
        for allocation failures, the HAMi fit reason (CardInsufficientMemory, ...).
        """
        self.hami_filter_total = Counter(
            "hami_scheduler_filter", "Filter calls by result (success: some node fits)",
            ["result"], registry=r,
        )  # fmt: skip
        self.hami_filter_duration = Histogram(
            "hami_scheduler_filter_duration_seconds", "Filter call latency",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.hami_bind_total = Counter(
            "hami_scheduler_bind", "Bind calls by result", ["result"], registry=r
        )
        self.hami_allocation_failures = Counter(
            "hami_scheduler_allocation_failures", "Pods no node could hold, by HAMi fit reason",
            ["reason"], registry=r,
        )  # fmt: skip
        build = Gauge(
            "hami_build_info", "Build of the running scheduler (value 1)",
            ["version", "implementation"], registry=r,
        )  # fmt: skip
        build.labels(version=__version__, implementation="tessera").set(1)
        for result in ("success", "failure"):
            self.hami_filter_total.labels(result=result)
            self.hami_bind_total.labels(result=result)

    def filtered(self, seconds: float, fits: bool) -> None:
        self.hami_filter_duration.observe(seconds)
        self.hami_filter_total.labels(result="success" if fits else "failure").inc()

    def bound_result(self, ok: bool) -> None:
        self.hami_bind_total.labels(result="success" if ok else "failure").inc()
