"""The quota service's own Prometheus metrics, served at /metrics beside the probes, on a
registry per service. Namespace limits and usage are published by the metrics service from
the KV bucket (hami_resource_quota_*); this is about the service itself: what it was asked and
how it answered."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "tessera_quota_requests", "requests by endpoint (reserve, release, status, set) and "
            "result (ok, refused: the quota does not fit, error: the caller got an ErrorReply)",
            ["op", "result"], registry=self.registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "tessera_quota_request_seconds", "time to answer a request, by endpoint", ["op"],
            buckets=_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def answered(self, op: str, result: str, seconds: float) -> None:
        self.requests.labels(op=op, result=result).inc()
        self.seconds.labels(op=op).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
