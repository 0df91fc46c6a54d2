"""The shipped Grafana dashboard charts only metrics the service really exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from metrics_testkit import allocation, container_usage, ledger, registration, usage
from prometheus_client.parser import text_string_to_metric_families
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.models import (
    AllocationEvent,
    HostDeviceUsage,
    OomEvent,
    QuotaAmount,
    QuotaState,
    SchedulingFailedEvent,
)
from tessera.settings import TesseraSettings

DASHBOARD = Path(__file__).parents[2] / "charts" / "tessera-metrics" / "dashboards" / "tessera.json"


def exposed_sample_names() -> set[str]:
    from prometheus_client import generate_latest

    view = ClusterView()
    view.put_node("n", registration("n", gpus=1))
    a = allocation("n", "ns", "p", [[("GPU-n-0", 1000, 10)]])
    view.put_ledger("n", ledger("n", a))
    view.put_quota("ns", QuotaState(namespace="ns", limits=QuotaAmount(memory_mib=10)))
    view.put_usage(usage("n", 100.0, [container_usage(a, "c0", "GPU-n-0", 1, 2, 3, 4, 99.0)],
                         [HostDeviceUsage(uuid="GPU-n-0")]), received_at=100.0)
    view.apply_event(OomEvent(node="n", namespace="ns", pod="p"), 1)
    view.apply_event(AllocationEvent(action="bound", node="n", pod_uid=a.pod_uid,
                                     namespace="ns", name="p"), 3)
    view.apply_event(SchedulingFailedEvent(namespace="ns", name="q", at=100.0,
                                           node_reasons={"n": "1/1 CardInsufficientMemory"}), 4)
    text = generate_latest(build_registry(view, TesseraSettings(), lambda: 101.0)).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_expression_uses_exposed_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"\b(?:hami|tessera)_[a-z_]+", e)}
    missing = used - exposed_sample_names()
    assert not missing, f"dashboard queries metrics nobody exposes: {sorted(missing)}"
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Memory per GPU: the ledgers side by side", "Placement latency (p50 / p95 / p99)",
            "Node refusals by reason"} <= titles
