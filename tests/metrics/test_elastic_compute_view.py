"""Elastic compute in the metrics service and the dashboard (issue 33): each slice's compute
guarantee, burst limit and what is lent now; compute reclaim events counted and listed."""

from __future__ import annotations

from metrics_testkit import allocation, ledger, registration, usage
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView
from test_view import NOW, expose

from tessera.models import ComputeReclaimEvent, ContainerUsage, DeviceUsage


def _view(allowance: float) -> ClusterView:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=1, memory_mib=16384))
    burst = allocation("n1", "team-a", "train", [[("GPU-n1-0", 4096, 30)]], names=["main"])
    burst.containers[0][0] = burst.containers[0][0].model_copy(update={"cores_limit": 100})
    hard = allocation("n1", "team-b", "infer", [[("GPU-n1-0", 4096, 30)]], names=["main"])
    view.put_ledger("n1", ledger("n1", burst, hard))
    view.put_usage(usage("n1", NOW, [
        ContainerUsage(pod_uid=burst.pod_uid, namespace="team-a", pod="train", container="main",
                       devices=[DeviceUsage(uuid="GPU-n1-0", sm_limit=30, sm_burst_limit=100,
                                            sm_allowance=allowance, sm_util=allowance)]),
        ContainerUsage(pod_uid=hard.pod_uid, namespace="team-b", pod="infer", container="main",
                       devices=[DeviceUsage(uuid="GPU-n1-0", sm_limit=30)]),
    ]), NOW)  # fmt: skip
    return view


def _slices(view: ClusterView) -> dict[str, dict]:
    state = dashboard_state(view, NOW)
    return {s["pod"]: s for n in state["nodes"] for g in n["gpus"] for s in g["slices"]}


def test_the_dashboard_shows_the_compute_limit_and_what_is_lent() -> None:
    slices = _slices(_view(100.0))
    assert slices["train"]["cores"] == 30 and slices["train"]["cores_limit"] == 100
    assert slices["train"]["lent_pct"] == 70  # alone and busy: the whole card
    assert slices["infer"]["cores_limit"] is None and slices["infer"]["lent_pct"] is None
    assert _slices(_view(30.0))["train"]["lent_pct"] == 0  # back at its guarantee


def test_compute_reclaims_are_counted_and_listed() -> None:
    view = _view(70.0)
    view.apply_event(ComputeReclaimEvent(
        event_id="c1", node="n1", device_uuid="GPU-n1-0", pod_uid="uid-team-a-train",
        namespace="team-a", pod="train", container="main", reclaims=1, max_taken_pct=30,
        allowance_pct=70, for_pods=["team-b/infer"], at=NOW))  # fmt: skip
    view.apply_event(ComputeReclaimEvent(
        event_id="c2", node="n1", device_uuid="GPU-n1-0", pod_uid="uid-team-a-train",
        namespace="team-a", pod="train", container="main", reclaims=12, max_taken_pct=40,
        allowance_pct=60, for_pods=["team-b/infer"], at=NOW + 60))  # fmt: skip
    m = expose(view)
    assert m.value("tessera_compute_reclaims_total", node="n1") == 13
    texts = [e["text"] for e in dashboard_state(view, NOW + 60)["events"]]
    assert any("team-a/train" in t and "team-b/infer" in t and "12 times" in t
               for t in texts), texts
