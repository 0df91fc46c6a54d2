"""Watchdog breaches (limit.breached events) in the metrics: the counter by reason, the
dashboard's mark on the breached slice, replay without double counting."""

from __future__ import annotations

from metrics_testkit import Exposition, allocation, ledger, registration
from prometheus_client import generate_latest
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.models import AllocationEvent, LimitBreachedEvent
from tessera.settings import TesseraSettings

NOW = 1_800_000_000.0
MIB = 1 << 20


def expose(view: ClusterView) -> Exposition:
    return Exposition(generate_latest(build_registry(view, TesseraSettings(), lambda: NOW))
                      .decode())


def breach(uid: str, reason: str, n: int) -> LimitBreachedEvent:
    return LimitBreachedEvent(
        event_id=f"b{n}", node="n1", pod_uid=uid, namespace="ns", pod="train",
        container="main", device_uuid="GPU-n1-0", breach=reason,
        unit="percent" if reason == "compute" else "bytes", limit=1000 * MIB,
        seen=1200 * MIB, since=NOW - 3, at=NOW, action="killed", policy="kill",
    )


def test_breaches_count_by_reason_and_mark_the_slice() -> None:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=2))
    train = allocation("n1", "ns", "train", [[("GPU-n1-0", 1000, 30)]])
    other = allocation("n1", "ns", "other", [[("GPU-n1-0", 1000, 30)]])
    view.put_ledger("n1", ledger("n1", train, other))
    assert expose(view).value("tessera_limit_breaches_total", reason="memory") == 0
    events = [breach(train.pod_uid, "memory", 1), breach(train.pod_uid, "tampered", 2),
              breach(train.pod_uid, "memory", 3)]
    for seq, event in enumerate(events, 1):
        assert view.apply_event(event, seq)
    assert not view.apply_event(events[0])  # a re-delivery counts once
    m = expose(view)
    assert m.value("tessera_limit_breaches_total", reason="memory") == 2
    assert m.value("tessera_limit_breaches_total", reason="tampered") == 1
    assert m.value("tessera_limit_breaches_total", reason="compute") == 0
    state = dashboard_state(view, NOW)
    slices = {s["pod"]: s for s in state["nodes"][0]["gpus"][0]["slices"]}
    assert slices["train"]["breach"] == "memory" and slices["other"]["breach"] is None
    assert state["totals"]["limit_breaches"] == 3
    assert any("breached its memory limit" in e["text"] for e in state["events"])
    # the pod goes away: the mark with it, the counter stays
    view.apply_event(AllocationEvent(event_id="rel", action="released", node="n1",
                                     pod_uid=train.pod_uid, namespace="ns", name="train"), 10)
    assert view.breached == {}
    assert expose(view).value("tessera_limit_breaches_total", reason="memory") == 2
