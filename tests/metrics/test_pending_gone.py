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


def test_a_pod_admitted_with_a_misspelt_gpu_resource_counts_pending_until_it_goes() -> None:
    """No scheduler ever refuses it (no node offers `nvidia.com/gpumen`, so the extender is never
    asked): the webhook's event says why it can never be placed, and it stays pending (the
    PendingTooLong alert fires) until it is deleted."""
    from tessera.metrics.view import PENDING_STALE_S

    from tessera.models import AdmissionEvent

    why = ("container c: resource nvidia.com/gpumen (did you mean nvidia.com/gpumem?) is "
           "offered by no node")
    view = ClusterView()
    view.apply_event(AdmissionEvent(event_id="a", action="mutated", namespace="team-a",
                                    name="typo", at=NOW - 2 * PENDING_STALE_S,
                                    never_placed=why), 1)
    assert pending(view) == (1, ["typo"])
    assert dashboard_state(view, NOW)["pending"][0]["summary"] == why
    view.apply_event(PodGoneEvent(event_id="typo:gone", namespace="team-a", name="typo",
                                  at=NOW - 1), 2)
    assert pending(view) == (None, [])
