"""Elastic memory in the metrics service and the dashboard (issue 33): guaranteed, burst limit,
used and borrowed per container; reclaim events counted and listed."""

from __future__ import annotations

from metrics_testkit import MIB, allocation, ledger, registration, usage
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView
from test_view import NOW, expose

from tessera.models import ContainerUsage, DeviceUsage, MemoryReclaimEvent

GIB = 1 << 30


def _view() -> ClusterView:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=1, memory_mib=16384))
    burst = allocation("n1", "team-a", "train", [[("GPU-n1-0", 4096, 20)]], names=["main"])
    burst.containers[0][0] = burst.containers[0][0].model_copy(update={"memory_limit_mib": 12288})
    hard = allocation("n1", "team-b", "infer", [[("GPU-n1-0", 4096, 20)]], names=["main"])
    view.put_ledger("n1", ledger("n1", burst, hard))
    view.put_usage(usage("n1", NOW, [
        ContainerUsage(pod_uid=burst.pod_uid, namespace="team-a", pod="train", container="main",
                       devices=[DeviceUsage(uuid="GPU-n1-0", used_bytes=10 * GIB,
                                            limit_bytes=4 * GIB, burst_limit_bytes=12 * GIB,
                                            borrowed_bytes=6 * GIB)]),
        ContainerUsage(pod_uid=hard.pod_uid, namespace="team-b", pod="infer", container="main",
                       devices=[DeviceUsage(uuid="GPU-n1-0", used_bytes=GIB,
                                            limit_bytes=4 * GIB)]),
    ]), NOW)  # fmt: skip
    return view


def test_borrowed_and_guaranteed_per_container() -> None:
    m = expose(_view())
    train = {"namespace": "team-a", "pod": "train", "container": "main"}
    assert m.value("tessera_container_memory_bytes", kind="guaranteed", **train) == 4 * GIB
    assert m.value("tessera_container_memory_bytes", kind="burst_limit", **train) == 12 * GIB
    assert m.value("tessera_container_memory_bytes", kind="borrowed", **train) == 6 * GIB
    assert m.value("tessera_container_memory_bytes", kind="used", **train) == 10 * GIB
    infer = {"namespace": "team-b", "pod": "infer", "container": "main"}
    assert m.value("tessera_container_memory_bytes", kind="guaranteed", **infer) == 4 * GIB
    assert m.value("tessera_container_memory_bytes", kind="borrowed", **infer) is None  # hard


def test_the_dashboard_shows_the_limit_and_what_is_borrowed() -> None:
    state = dashboard_state(_view(), NOW)
    slices = {s["pod"]: s for n in state["nodes"] for g in n["gpus"] for s in g["slices"]}
    assert slices["train"]["memory_limit_mib"] == 12288
    assert slices["train"]["borrowed_mib"] == 6 * GIB / MIB
    assert slices["infer"]["memory_limit_mib"] is None and slices["infer"]["borrowed_mib"] is None


def test_reclaims_are_counted_and_listed() -> None:
    view = _view()
    view.apply_event(MemoryReclaimEvent(
        event_id="r1", action="reclaimed", node="n1", device_uuid="GPU-n1-0",
        pod_uid="uid-team-a-train", namespace="team-a", pod="train",
        borrowed_bytes=6 * GIB, short_bytes=GIB, for_pod="team-b/infer", at=NOW))  # fmt: skip
    view.apply_event(MemoryReclaimEvent(
        event_id="r2", action="evicted", node="n1", device_uuid="GPU-n1-0",
        pod_uid="uid-team-a-train", namespace="team-a", pod="train",
        borrowed_bytes=6 * GIB, for_pod="team-b/infer", at=NOW))  # fmt: skip
    m = expose(view)
    assert m.value("tessera_memory_reclaim_events_total", node="n1", action="reclaimed") == 1
    assert m.value("tessera_memory_reclaim_events_total", node="n1", action="evicted") == 1
    texts = [e["text"] for e in dashboard_state(view, NOW)["events"]]
    assert any("team-a/train evicted" in t and "team-b/infer" in t for t in texts), texts
