"""The PrometheusRule the metrics chart ships: every alert a HAMi operator expects is there, and
every expression reads metrics (and labels) the services really publish."""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from metrics_testkit import allocation, container_usage, ledger, registration, usage
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry
from tessera.scheduler.metrics import SchedulerMetrics

from tessera.models import (
    HostDeviceUsage,
    OomEvent,
    QuotaAmount,
    QuotaState,
    SchedulingFailedEvent,
)
from tessera.settings import TesseraSettings

CHARTS = Path(__file__).resolve().parents[2] / "charts"
EXPECTED = {
    "TesseraGPUMemoryNearLimit", "TesseraGPUOutOfMemoryFrequent", "TesseraNodeAgentDown",
    "TesseraSchedulerDown", "TesseraGPUPodsPendingTooLong", "TesseraGPUFragmentation",
    "TesseraGPUQuotaNearLimit",
}
PROMQL_WORDS = {"sum", "by", "and", "or", "on", "increase", "absent", "rate", "unless",
                "without", "max", "min", "count", "avg", "ignoring", "bool"}


def published() -> dict[str, set[str]]:
    """Sample name -> label names, from the metrics service and the scheduler."""
    view = ClusterView()
    view.put_node("n", registration("n", gpus=1))
    a = allocation("n", "ns", "p", [[("GPU-n-0", 1000, 10)]])
    view.put_ledger("n", ledger("n", a))
    view.put_quota("ns", QuotaState(namespace="ns", limits=QuotaAmount(memory_mib=10)))
    view.put_usage(usage("n", 100.0, [container_usage(a, "c0", "GPU-n-0", 1, 2, 3, 4)],
                         [HostDeviceUsage(uuid="GPU-n-0")]), received_at=100.0)
    view.apply_event(OomEvent(node="n", namespace="ns", pod="p", container="c0"), 1)
    view.apply_event(SchedulingFailedEvent(namespace="ns", name="q", at=100.0,
                                           node_reasons={"n": "1/1 CardInsufficientMemory"}), 2)
    texts = [generate_latest(build_registry(view, TesseraSettings(), lambda: 101.0)).decode(),
             generate_latest(SchedulerMetrics().registry).decode()]
    out: dict[str, set[str]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


@functools.cache
def metrics_chart() -> Path:
    """A copy of the chart with its library chart in place, as `helm dependency update` leaves
    it."""
    root = Path(tempfile.mkdtemp(prefix="tessera-charts-"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(CHARTS, root / "charts", ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    helm.dependency_update(root / "charts" / "tessera-metrics")
    return root / "charts" / "tessera-metrics"


def rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(metrics_chart()) as chart:
        files = chart.render({"prometheusRule": {"enabled": True}, **(values or {})},
                             name="tessera", namespace="tessera-system")
    (text,) = [t for p, t in files.items() if p.endswith("prometheusrule.yaml")]
    doc = yaml.safe_load(text)
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return [r for group in doc["spec"]["groups"] for r in group["rules"]]


def test_every_alert_expression_reads_published_metrics_and_labels() -> None:
    names = published()
    found = rules()
    assert {r["alert"] for r in found} == EXPECTED
    for rule in found:
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\([^()]*\)\s*(?=\()", " ", expr)
        metrics = {w for w in re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*\b", stripped)
                   if w not in PROMQL_WORDS and ("_" in w)}
        assert metrics, rule["alert"]
        missing = metrics - set(names)
        assert not missing, f"{rule['alert']} reads unpublished metrics {sorted(missing)}"
        # Labels grouped by, and labels the annotations print, exist on the metrics read.
        labels = set().union(*(names[m] for m in metrics))
        for group in re.findall(r"by \(([^)]*)\)", expr):
            assert {g.strip() for g in group.split(",")} <= labels, (rule["alert"], group)
        printed = set(re.findall(r"\$labels\.([a-z_]+)", yaml.safe_dump(rule["annotations"])))
        assert printed <= labels | {"job"}, (rule["alert"], printed - labels)


def test_alert_thresholds_follow_values() -> None:
    found = {r["alert"]: r for r in rules({"prometheusRule": {
        "enabled": True, "thresholds": {"memoryNearLimitPercent": 80, "pendingFor": "30m"}}})}
    assert found["TesseraGPUMemoryNearLimit"]["expr"].endswith("> 80")
    assert found["TesseraGPUPodsPendingTooLong"]["for"] == "30m"
