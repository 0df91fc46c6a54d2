"""Prometheus scrapes every service that has metrics: the monitors point at a port the
workload really exposes, at /metrics, with the job names the shipped alerts read."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_charts import charts_dir, render  # noqa: F401 - the fixture (dependencies built)


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
def test_monitor_scrapes_a_real_port_at_metrics(charts_dir: Path,  # noqa: F811
                                                chart, values, kind, job) -> None:
    manifests = render(charts_dir, chart, values)
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
    assert not [m for m in render(charts_dir, chart, {}) if m["kind"] == kind], "off by default"
