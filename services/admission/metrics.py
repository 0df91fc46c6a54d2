"""The webhook's Prometheus metrics, in a registry of its own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# Reviews take well under a millisecond without quota, a few with it; the apiserver gives up at
# the webhook's timeoutSeconds (10 s by default).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class AdmissionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "tessera_admission_review_duration_seconds",
            "Time to answer one AdmissionReview, quota check included",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reviews = Counter(
            "tessera_admission_reviews_total",
            "AdmissionReviews answered, by result (allowed, mutated, denied, rejected = HTTP 4xx)",
            ["result"],
            registry=self.registry,
        )
        self.denials = Counter(
            "tessera_admission_denials_total",
            "Pods denied, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "tessera_admission_events_dropped_total",
            "Admission events not published (queue full or NATS unavailable)",
            registry=self.registry,
        )
        # Pre-create the children the hot path uses, so it does no label lookups.
        results = ("allowed", "mutated", "denied", "rejected")
        self.result = {r: self.reviews.labels(r) for r in results}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
