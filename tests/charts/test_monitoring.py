"""Prometheus scrapes every service that has metrics: the monitors point at a port the
workload really exposes, at /metrics, with the job names the shipped alerts read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

CHARTS = Path(__file__).resolve().parents[2] / "charts"


def render(chart: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHARTS / chart) as loaded:
        files = loaded.render(values, name="tessera", namespace="tessera-system")
    return [d for p, t in sorted(files.items()) if not p.endswith("NOTES.txt")
            for d in yaml.safe_load_all(t) if d]


@pytest.mark.parametrize(("chart", "values", "kind", "job"), [
    ("tessera-scheduler", {"serviceMonitor": {"enabled": True}}, "ServiceMonitor",
     "tessera-scheduler"),
    ("tessera-admission", {"serviceMonitor": {"enabled": True}}, "ServiceMonitor",
     "tessera-admission"),
    ("tessera-node-agent", {"podMonitor": {"enabled": True}}, "PodMonitor",
     "tessera-node-agent"),
    ("tessera-quota", {"podMonitor": {"enabled": True}}, "PodMonitor", "tessera-quota"),
    ("tessera-metrics", {"serviceMonitor": {"enabled": True}}, "ServiceMonitor", None),
])
def test_monitor_scrapes_a_real_port_at_metrics(chart, values, kind, job) -> None:
    manifests = render(chart, values)
    (monitor,) = [m for m in manifests if m["kind"] == kind]
    endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
    (endpoint,) = endpoints
    assert endpoint["path"] == "/metrics"
    workload = next(m for m in manifests if m["kind"] in ("Deployment", "DaemonSet"))
    ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    if kind == "ServiceMonitor":
        service = next(m for m in manifests if m["kind"] == "Service")
        by_name = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
        assert by_name[endpoint["port"]] in ports
    else:
        assert endpoint["port"] in ports
    selector = monitor["spec"]["selector"]["matchLabels"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    if job:
        assert {"targetLabel": "job", "replacement": job} in endpoint["relabelings"]
    assert not [m for m in render(chart, {}) if m["kind"] == kind], "off by default"
