"""A HAMi operator's day on a running stack: the metrics service and the scheduler publish HAMi's
names, units and labels (table in tests/metrics/hami_table.py, from HAMi's docs; legacyNames on);
the scheduler records HAMi's Events on the pod; pods carry hami.io/vgpu-devices-allocated;
`tessera describe pod` shows both."""

from __future__ import annotations

import json
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tessera.hami import ANN_DEVICES_ALLOCATED, ANN_DEVICES_TO_ALLOCATE, decode_pod_devices
from tessera_cli.app import build_app
from tessera_cli.stack import EXTENDER_CLIENT_NAME, SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, start_stack

sys.path.insert(0, str(Path(__file__).parents[1] / "metrics"))
from hami_table import (
    HAMI,
    LEGACY,
    SCHEDULER,
    TWINS,
    check_labels,
    label_sets,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE = "hm-a"
NODES = [SimNode(name=NODE, gpus=2, gpu_memory_mib=24576, gpu_model="NVIDIA A10")]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES, env={"TESSERA_LEGACY_NAMES": "true"})


def scrape(url: str, verify: ssl.SSLContext | bool = True) -> dict[str, list[dict[str, str]]]:
    return label_sets(httpx.get(f"{url}/metrics", timeout=10, verify=verify).text)


def as_kube_scheduler(sim: RunningStack) -> ssl.SSLContext:
    """The extender answers only mutual TLS, as Prometheus with kube-scheduler's client
    certificate would scrape it (the chart's plain probe port serves the same /metrics)."""
    certs = sim.stack.state_dir / "certs"
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(certs / f"{EXTENDER_CLIENT_NAME}.crt",
                            certs / f"{EXTENDER_CLIENT_NAME}.key")  # fmt: skip
    return context


def test_scrape_matches_hami_table(sim: RunningStack, namespace: str, tmp_path: Path) -> None:
    ns = namespace
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu"},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "40000"}},
    }))
    result = CliRunner().invoke(build_app(), ["apply", "-f", str(quota), "-n", ns,
                                              "--kubeconfig", str(sim.stack.kubeconfig)])
    assert result.exit_code == 0, result.output
    target = gpu_uuid(NODE, 0)
    pin = {"nvidia.com/use-gpuuuid": target}
    sim.kube.create_pod_retrying(gpu_pod("half", mem=3000, cores=50, annotations=pin), ns)
    sim.kube.create_pod_retrying(gpu_pod("quarter", mem=2000, cores=25, annotations=pin), ns)
    sim.kube.wait_running(ns, "half", 30)
    sim.kube.wait_running(ns, "quarter", 30)
    metrics_url = f"http://127.0.0.1:{sim.stack.ports.metrics}"

    def placed() -> dict[str, list[dict[str, str]]] | None:
        samples = scrape(metrics_url)
        ours = [s for s in samples.get("hami_vgpu_core_allocated_ratio", [])
                if s.get("namespace") == ns]
        quota_seen = [s for s in samples.get("hami_resource_quota_used", [])
                      if s.get("namespace") == ns and s["__value__"] == 5000]
        return samples if len(ours) == 2 and quota_seen else None

    samples = sim.kube.wait_for("both slices and the quota in /metrics", placed, 30, 0.5)
    gpu = [s for s in samples["hami_gpu_core_allocated_ratio"] if s["device_uuid"] == target]
    assert [s["__value__"] for s in gpu] == [75]  # percent: 50 % + 25 %
    limit = [s for s in samples["hami_gpu_core_limit_ratio"] if s["device_uuid"] == target]
    assert [s["__value__"] for s in limit] == [100]
    alloc = [s for s in samples["hami_gpu_memory_allocated_bytes"] if s["device_uuid"] == target]
    assert [(s["device_cores"], s["__value__"]) for s in alloc] == [("75", 5000 * MIB)]
    cores = {s["pod"]: s["__value__"] for s in samples["hami_vgpu_core_allocated_ratio"]
             if s.get("namespace") == ns}
    assert cores == {"half": 50, "quarter": 25}
    used = [s for s in samples["hami_resource_quota_used"] if s["namespace"] == ns]
    assert [(s["quota_name"], s["limit"], s["__value__"]) for s in used] == [
        ("nvidia.com/gpumem", "40000", 5000)]
    legacy = [s for s in samples["GPUDeviceCoreAllocated"] if s["deviceuuid"] == target]
    assert [(s["nodeid"], s["__value__"]) for s in legacy] == [(NODE, 75)]
    problems = check_labels(samples, HAMI) + check_labels(samples, LEGACY)
    assert not problems, problems
    for hami_name, legacy_name in TWINS.items():
        assert len(samples.get(hami_name, [])) == len(samples.get(legacy_name, [])), hami_name

    # A pod no card can hold (30 000 MiB on 24 GiB cards): counted by HAMi's fit reason.
    sim.kube.create_pod_retrying(gpu_pod("too-big", mem=30_000, cores=10), ns)
    scheduler_url = f"https://127.0.0.1:{sim.stack.ports.scheduler}"
    tls = as_kube_scheduler(sim)

    def refused() -> dict[str, list[dict[str, str]]] | None:
        samples = scrape(scheduler_url, tls)
        failures = samples.get("hami_scheduler_allocation_failures_total", [])
        return samples if any(s["reason"] == "CardInsufficientMemory" for s in failures) else None

    scheduler = sim.kube.wait_for("the refusal counted", refused, 30, 0.5)
    for name, labels in SCHEDULER.items():
        assert name in scheduler, f"scheduler does not publish {name}"
        for sample in scheduler[name]:
            assert set(sample) - {"__value__"} == labels, (name, sample)
    filtered = {s["result"]: s["__value__"] for s in scheduler["hami_scheduler_filter_total"]}
    binds = {s["result"]: s["__value__"] for s in scheduler["hami_scheduler_bind_total"]}
    assert filtered["success"] >= 2 and binds["success"] >= 2
    assert scheduler["hami_build_info"][0]["__value__"] == 1


def test_events_annotations_and_describe(sim: RunningStack, namespace: str) -> None:
    ns = namespace
    placed = sim.kube.create_pod_retrying(gpu_pod("fits", mem=2000, cores=10), ns)
    sim.kube.wait_running(ns, "fits", 30)
    sim.kube.create_pod_retrying(gpu_pod("never", mem=30_000, cores=10), ns)

    def allocated() -> dict[str, Any] | None:
        pod = sim.kube.pod(ns, "fits")
        annotations = pod["metadata"].get("annotations") or {}
        return pod if annotations.get(ANN_DEVICES_ALLOCATED) else None

    pod = sim.kube.wait_for("hami.io/vgpu-devices-allocated", allocated, 20, 0.3)
    annotations = pod["metadata"]["annotations"]
    assert decode_pod_devices(annotations[ANN_DEVICES_ALLOCATED]) == decode_pod_devices(
        annotations[ANN_DEVICES_TO_ALLOCATE])
    assert annotations["hami.io/bind-phase"] == "success"

    def reasons(name: str) -> dict[str, dict[str, Any]]:
        items = sim.kube.http.get(f"/api/v1/namespaces/{ns}/events").json()["items"]
        return {e["reason"]: e for e in items if e["involvedObject"]["name"] == name}

    sim.kube.wait_for("the scheduler's events", lambda: {"FilteringSucceed", "BindingSucceed"}
                      <= set(reasons("fits")) and "FilteringFailed" in reasons("never"), 20, 0.5)
    failed = reasons("never")["FilteringFailed"]
    assert failed["type"] == "Warning" and NODE in failed["message"]
    assert "CardInsufficientMemory" in failed["message"]
    assert reasons("fits")["BindingSucceed"]["involvedObject"]["uid"] == placed["metadata"]["uid"]

    result = CliRunner().invoke(build_app(), ["describe", "pod", "never", "-n", ns,
                                              "--kubeconfig", str(sim.stack.kubeconfig)])
    assert result.exit_code == 0, result.output
    assert "FilteringFailed" in result.output and "CardInsufficientMemory" in result.output
    result = CliRunner().invoke(build_app(), ["describe", "pod", "fits", "-n", ns,
                                              "--kubeconfig", str(sim.stack.kubeconfig)])
    assert "BindingSucceed" in result.output and ANN_DEVICES_ALLOCATED in result.output


def test_deleted_pending_pod_leaves_pending_lists_also_after_restart(
    sim: RunningStack, namespace: str
) -> None:
    ns = namespace
    metrics_url = f"http://127.0.0.1:{sim.stack.ports.metrics}"
    sim.kube.create_pod_retrying(gpu_pod("stuck", mem=30_000, cores=10), ns)

    def pending_count() -> float | None:
        samples = scrape(metrics_url).get("tessera_pods_pending", [])
        values = [s["__value__"] for s in samples if s.get("namespace") == ns]
        return values[0] if values else None

    def dashboard_pending() -> list[str]:
        state = httpx.get(f"{metrics_url}/api/state", timeout=10).json()
        return [p["name"] for p in state["pending"] if p["namespace"] == ns]

    sim.kube.wait_for("the pod pending", lambda: pending_count() == 1
                      and dashboard_pending() == ["stuck"], 30, 0.5)
    sim.kube.delete_pod(ns, "stuck")
    sim.kube.wait_for("the pod off the pending lists", lambda: pending_count() is None
                      and dashboard_pending() == [], 15, 0.3)
    sim.stack.restart_service("metrics")

    def replayed() -> bool:
        try:
            return httpx.get(f"{metrics_url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    sim.kube.wait_for("metrics replayed the stream", replayed, 30, 0.3)
    assert pending_count() is None and dashboard_pending() == []
