"""A deleted pending pod leaves the pending list (dashboard, tessera_pods_pending) at once, and a
restarted metrics service replaying the stream does not bring it back."""

from __future__ import annotations

from metrics_testkit import Exposition
from prometheus_client import generate_latest
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.models import Event, PodGoneEvent, SchedulingFailedEvent
from tessera.settings import TesseraSettings

NOW = 1_800_000_000.0


def pending(view: ClusterView) -> tuple[float | None, list[str]]:
    text = generate_latest(build_registry(view, TesseraSettings(), lambda: NOW)).decode()
    metric = Exposition(text).value("tessera_pods_pending", namespace="team-a")
    names = [p["name"] for p in dashboard_state(view, NOW)["pending"]]
    return metric, names


def stream() -> list[Event]:
    failed = {"n1": "1/1 CardInsufficientMemory"}
    return [
        SchedulingFailedEvent(event_id="f1", namespace="team-a", name="big", pod_uid="u1",
                              at=NOW - 30, node_reasons=failed),
        SchedulingFailedEvent(event_id="f2", namespace="team-a", name="other", pod_uid="u2",
                              at=NOW - 20, node_reasons=failed),
        PodGoneEvent(event_id="u1:gone", namespace="team-a", name="big", pod_uid="u1",
                     at=NOW - 10),
    ]


def test_deleted_pending_pod_leaves_every_pending_list_and_stays_gone_on_replay() -> None:
    view = ClusterView()
    events = stream()
    for sequence, event in enumerate(events[:2], 1):
        view.apply_event(event, sequence)
    assert pending(view) == (2, ["big", "other"])
    view.apply_event(events[2], 3)
    assert pending(view) == (1, ["other"])
    replayed = ClusterView()  # a restarted service folds the stream from its start
    for sequence, event in enumerate(events, 1):
        replayed.apply_event(event, sequence)
    assert pending(replayed) == (1, ["other"])


def test_gone_for_an_older_pod_of_the_same_name_keeps_the_new_one() -> None:
    view = ClusterView()
    view.apply_event(SchedulingFailedEvent(event_id="f", namespace="team-a", name="big",
                                           pod_uid="new", at=NOW - 5,
                                           node_reasons={"n1": "1/1 CardInsufficientMemory"}), 1)
    view.apply_event(PodGoneEvent(event_id="old:gone", namespace="team-a", name="big",
                                  pod_uid="old", at=NOW - 1), 2)
    assert pending(view) == (1, ["big"])
