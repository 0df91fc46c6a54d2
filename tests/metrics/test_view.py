"""The pure view: bus messages in, metrics and dashboard JSON out (no NATS, no HTTP)."""

from __future__ import annotations

from metrics_testkit import (
    MIB,
    Exposition,
    allocation,
    container_usage,
    ledger,
    registration,
    usage,
)
from prometheus_client import generate_latest
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView, reason_codes
from tessera.metrics.web import build_registry

from tessera.models import (
    AdmissionEvent,
    AllocationEvent,
    AllocationState,
    Event,
    OomEvent,
    QuotaAmount,
    QuotaCharge,
    QuotaState,
    SchedulingFailedEvent,
)
from tessera.settings import TesseraSettings

NOW = 1_800_000_000.0


def expose(view: ClusterView, now: float = NOW) -> Exposition:
    return Exposition(generate_latest(build_registry(view, TesseraSettings(), lambda: now))
                      .decode())


def pod_events(uid: str, ns: str, name: str, node: str, t0: float) -> list[Event]:
    """A pod admitted at t0, reserved +0.1 s, bound +0.3 s, allocated +1.3 s."""
    return [
        AdmissionEvent(event_id=f"{uid}:adm", action="mutated", namespace=ns, name=name, at=t0),
        AllocationEvent(event_id=f"{uid}:r", action="reserved", node=node, pod_uid=uid,
                        namespace=ns, name=name, at=t0 + 0.1),
        AllocationEvent(event_id=f"{uid}:b", action="bound", node=node, pod_uid=uid,
                        namespace=ns, name=name, at=t0 + 0.3),
        AllocationEvent(event_id=f"{uid}:a", action="allocated", node=node, pod_uid=uid,
                        namespace=ns, name=name, at=t0 + 1.3),
    ]


def test_gpu_metrics_split_by_pods_and_hami_labels() -> None:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=2))
    a = allocation("n1", "team-a", "train", [[("GPU-n1-0", 20_000, 30)]])
    b = allocation("n1", "team-b", "infer", [[("GPU-n1-0", 10_000, 20), ("GPU-n1-1", 4_000, 0)]])
    view.put_ledger("n1", ledger("n1", a, b))
    m = expose(view)
    gpu0 = {"node": "n1", "device_uuid": "GPU-n1-0", "device_index": "0",
            "device_type": "NVIDIA-H200"}
    assert m.value("hami_gpu_memory_limit_bytes", **gpu0) == 80 * 1024 * MIB
    assert m.value("hami_gpu_memory_allocated_bytes", **gpu0) == 30_000 * MIB
    assert m.value("hami_gpu_core_allocated_ratio", **gpu0) == 50  # percent, as HAMi
    assert m.value("hami_gpu_core_limit_ratio", **gpu0) == 100
    assert m.value("hami_gpu_shared_count", **gpu0) == 2
    assert m.value("hami_node_gpu_memory_allocated_ratio", **gpu0) == 30_000 / (80 * 1024)
    assert m.value("hami_gpu_shared_count", device_uuid="GPU-n1-1") == 1
    assert m.value("hami_vgpu_memory_allocated_bytes", namespace="team-b", pod="infer",
                   container_index="0", device_uuid="GPU-n1-1", device_index="1") == 4_000 * MIB
    assert m.value("hami_vgpu_core_allocated_ratio", pod="train", device_uuid="GPU-n1-0") == 30
    assert m.value("tessera_gpu_memory_bytes", kind="allocated", device_uuid="GPU-n1-0") == (
        30_000 * MIB)
    assert m.value("tessera_gpu_memory_bytes", kind="physical", device_uuid="GPU-n1-0") == (
        80 * 1024 * MIB)


def test_released_allocations_and_finished_init_containers_hold_nothing() -> None:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=1))
    gone = allocation("n1", "ns", "gone", [[("GPU-n1-0", 9_000, 50)]],
                      state=AllocationState.RELEASED)
    with_init = allocation("n1", "ns", "web", [[("GPU-n1-0", 5_000, 10)],
                                                [("GPU-n1-0", 2_000, 10)]],
                           names=["setup", "app"], init_count=1, init_done=True)
    view.put_ledger("n1", ledger("n1", gone, with_init))
    m = expose(view)
    assert m.value("hami_gpu_memory_allocated_bytes", device_uuid="GPU-n1-0") == 2_000 * MIB
    assert m.value("hami_gpu_shared_count", device_uuid="GPU-n1-0") == 1
    assert m.value("tessera_allocations", node="n1", state="released") == 1
    view.put_ledger("n1", None)
    assert expose(view).value("hami_gpu_memory_allocated_bytes", device_uuid="GPU-n1-0") == 0


def test_latency_histograms_from_event_timestamps_and_duplicates_ignored() -> None:
    view = ClusterView()
    events = pod_events("u1", "ns", "p1", "n1", 100.0) + pod_events("u2", "ns", "p2", "n1", 200.0)
    for seq, event in enumerate(events, start=1):
        assert view.apply_event(event, seq)
    # A publisher retry after the dedupe window: same event_id, new sequence.
    assert not view.apply_event(events[2], len(events) + 1)
    m = expose(view)
    bound = {"stage": "admission_to_bound"}
    assert m.value("tessera_scheduling_latency_seconds_count", **bound) == 2
    assert abs(m.value("tessera_scheduling_latency_seconds_sum", **bound) - 0.6) < 1e-9
    assert m.value("tessera_scheduling_latency_seconds_bucket", le="0.25", **bound) == 0
    assert m.value("tessera_scheduling_latency_seconds_bucket", le="0.5", **bound) == 2
    assert m.value("tessera_scheduling_latency_seconds_count", stage="bound_to_allocated") == 2
    assert m.value("tessera_scheduling_latency_seconds_bucket", stage="bound_to_allocated",
                   le="1.0") == 2
    assert m.value("tessera_scheduling_latency_seconds_count", stage="reserved_to_bound") == 2
    assert m.value("tessera_allocation_events_total", node="n1", action="bound") == 2


def test_running_observed_only_when_sampling_was_watched_before_allocation() -> None:
    view = ClusterView()
    view.latency.usage_since = 150.0
    view.put_node("n1", registration("n1", gpus=1))
    for seq, event in enumerate(
        pod_events("uid-ns-old", "ns", "old", "n1", 100.0)
        + pod_events("uid-ns-new", "ns", "new", "n1", 200.0), start=1
    ):
        view.apply_event(event, seq)
    old = allocation("n1", "ns", "old", [[("GPU-n1-0", 1000, 10)]])
    new = allocation("n1", "ns", "new", [[("GPU-n1-0", 1000, 10)]])
    sample = usage("n1", 205.3, [container_usage(old, "c0", "GPU-n1-0", 10, 1000, 5, 10),
                                 container_usage(new, "c0", "GPU-n1-0", 10, 1000, 5, 10)])
    view.put_usage(sample, received_at=NOW)
    view.put_usage(sample.model_copy(update={"at": 300.0}), received_at=NOW)  # not first: ignored
    m = expose(view)
    assert m.value("tessera_scheduling_latency_seconds_count", stage="allocated_to_running") == 1
    assert abs(m.value("tessera_scheduling_latency_seconds_sum", stage="allocated_to_running")
               - 4.0) < 1e-9
    assert abs(m.value("tessera_scheduling_latency_seconds_sum", stage="admission_to_running")
               - 5.3) < 1e-9


def test_replaying_the_same_events_gives_the_same_counters() -> None:
    def build() -> ClusterView:
        view = ClusterView()
        events: list[Event] = pod_events("u1", "ns", "p1", "n1", 10.0)
        events.append(SchedulingFailedEvent(event_id="f1", namespace="ns", name="big", at=11.0,
                                            node_reasons={"n1": "2/2 CardInsufficientMemory"}))
        events.append(OomEvent(event_id="o1", node="n1", namespace="ns", pod="p1",
                               container="c0", at=12.0))
        for seq, event in enumerate(events, start=1):
            view.apply_event(event, seq)
        return view

    first, second = expose(build()), expose(build())
    assert first.text == second.text
    assert first.value("tessera_oom_events_total", pod="p1", container="c0") == 1


def test_pending_pods_keep_their_reasons_until_placed() -> None:
    view = ClusterView()
    failed = SchedulingFailedEvent(
        event_id="f1", namespace="ml", name="huge", pod_uid="u9", at=NOW - 30,
        node_reasons={"n1": "2/2 CardInsufficientMemory", "n2": "1/4 CardInsufficientCore, "
                      "3/4 CardInsufficientMemory", "n3": "node unregistered"},
    )
    view.apply_event(failed, 1)
    view.apply_event(failed.model_copy(update={"event_id": "f2", "at": NOW - 10}), 2)
    state = dashboard_state(view, NOW)
    [pod] = state["pending"]
    assert pod["name"] == "huge" and pod["attempts"] == 2 and pod["waiting_s"] == 30
    assert pod["node_reasons"]["n1"] == "2/2 CardInsufficientMemory"
    assert "CardInsufficientMemory" in pod["summary"]
    m = expose(view)
    assert m.value("tessera_pods_pending", namespace="ml") == 1
    assert m.value("tessera_scheduling_refusals_total", reason="CardInsufficientMemory") == 4
    assert m.value("tessera_scheduling_refusals_total", reason="CardInsufficientCore") == 2
    assert m.value("tessera_scheduling_refusals_total", reason="Other") == 2
    view.apply_event(AllocationEvent(event_id="b", action="bound", node="n1", pod_uid="u9",
                                     namespace="ml", name="huge", at=NOW), 3)
    assert dashboard_state(view, NOW)["pending"] == []
    assert expose(view).value("tessera_pods_pending", namespace="ml") is None


def test_reason_codes_are_bounded_names() -> None:
    assert reason_codes("3/8 CardInsufficientMemory") == ["CardInsufficientMemory"]
    assert reason_codes("1/2 CardTypeMismatch; 1/2 CardUuidMismatch") == [
        "CardTypeMismatch", "CardUuidMismatch"]
    assert reason_codes("") == ["Other"]
    assert reason_codes("!!! 42") == ["Other"]
    assert reason_codes("RequestInvalid: gpumem must be an integer") == ["RequestInvalid"]


def test_quota_metrics_in_hami_and_tessera_units() -> None:
    view = ClusterView()
    view.put_quota("team-a", QuotaState(
        namespace="team-a", limits=QuotaAmount(memory_mib=40_000, cores=200),
        charges={"u1": QuotaCharge(pod_uid="u1", memory_mib=10_000, cores=50, gpus=1)},
    ))
    m = expose(view)
    assert m.value("hami_resource_quota_used", namespace="team-a",
                   quota_name="nvidia.com/gpumem", limit="40000", zone="vGPU") == 10_000
    assert m.value("hami_resource_quota_limit", namespace="team-a",
                   quota_name="nvidia.com/gpucores") == 200
    assert m.value("hami_resource_quota_used", namespace="team-a",
                   quota_name="nvidia.com/gpucores") == 50
    # Unlimited resources have no HAMi quota series (HAMi reports ResourceQuota entries only).
    assert m.value("hami_resource_quota_limit", quota_name="nvidia.com/gpu") is None
    assert m.value("hami_resource_quota_used", quota_name="nvidia.com/gpu") is None
    assert m.value("tessera_quota_used", namespace="team-a", resource="memory_bytes") == (
        10_000 * MIB)
    assert m.value("tessera_quota_limit", namespace="team-a", resource="cores") == 2.0


def test_usage_samples_feed_node_metrics_and_expire() -> None:
    from tessera.models import HostDeviceUsage

    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=1))
    a = allocation("n1", "ns", "p", [[("GPU-n1-0", 8_000, 40)]], names=["main"])
    view.put_ledger("n1", ledger("n1", a))
    sample = usage("n1", NOW - 1, [container_usage(a, "main", "GPU-n1-0", 3_000, 8_000, 37.5,
                                                   40, last_kernel_at=NOW - 3)],
                   [HostDeviceUsage(uuid="GPU-n1-0", used_bytes=3_500 * MIB,
                                    total_bytes=80 * 1024 * MIB, utilization=42.0)])
    view.put_usage(sample, received_at=NOW - 1)
    m = expose(view)
    labels = {"namespace": "ns", "pod": "p", "container": "main", "vdevice_index": "0",
              "device_uuid": "GPU-n1-0"}
    assert m.value("hami_vgpu_memory_used_bytes", **labels) == 3_000 * MIB
    assert m.value("hami_vgpu_memory_limit_bytes", **labels) == 8_000 * MIB
    assert m.value("hami_container_device_utilization_ratio", **labels) == 37.5
    assert m.value("hami_container_last_kernel_elapsed_seconds", **labels) == 2.0
    assert m.value("tessera_container_compute_ratio", kind="limit", **labels) == 0.4
    assert m.value("hami_host_gpu_memory_used_bytes", device_uuid="GPU-n1-0",
                   device_index="0") == 3_500 * MIB
    assert m.value("hami_host_gpu_utilization_ratio", device_uuid="GPU-n1-0") == 42
    assert m.value("tessera_gpu_memory_bytes", kind="used", device_uuid="GPU-n1-0") == 3_500 * MIB
    gpu = dashboard_state(view, NOW)["nodes"][0]["gpus"][0]
    assert gpu["slices"][0]["used_mib"] == 3_000 and gpu["host_used_mib"] == 3_500
    stale = expose(view, now=NOW + 120)
    assert stale.value("hami_vgpu_memory_used_bytes", **labels) is None
    assert stale.value("hami_gpu_memory_allocated_bytes", device_uuid="GPU-n1-0") == 8_000 * MIB


def test_usage_joins_slices_even_when_the_ledger_lacks_container_names() -> None:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=1))
    a = allocation("n1", "ns", "p", [[("GPU-n1-0", 8_000, 40)]])
    a.container_names = []
    view.put_ledger("n1", ledger("n1", a))
    view.put_usage(usage("n1", NOW, [container_usage(a, "main", "GPU-n1-0", 3_000, 8_000, 20, 40)]),
                   received_at=NOW)
    [piece] = dashboard_state(view, NOW)["nodes"][0]["gpus"][0]["slices"]
    assert piece["container"] == "#0" and piece["used_mib"] == 3_000 and piece["sm_util"] == 20
    assert expose(view).value("tessera_gpu_memory_bytes", kind="containers_used",
                              device_uuid="GPU-n1-0") == 3_000 * MIB


def test_pending_pods_age_out_and_a_recreated_pod_starts_over() -> None:
    view = ClusterView()
    first = SchedulingFailedEvent(event_id="f1", namespace="ml", name="job", pod_uid="old",
                                  at=NOW - 2000, node_reasons={"n1": "1/1 CardInsufficientCore"})
    view.apply_event(first, 1)
    assert dashboard_state(view, NOW)["pending"] == []  # not refused again for 33 minutes
    view.apply_event(first.model_copy(update={"event_id": "f2", "pod_uid": "new",
                                              "at": NOW - 5}), 2)
    [pod] = dashboard_state(view, NOW)["pending"]
    assert pod["pod_uid"] == "new" and pod["attempts"] == 1 and pod["waiting_s"] == 5


def test_node_configuration_events_are_not_shown_as_errors() -> None:
    """An applied per-node config is routine, a refused one a warning; a lost node an error."""
    from tessera.models import NodeEvent

    view = ClusterView()
    for action in ("configured", "config_refused", "lost"):
        view.apply_event(NodeEvent(node="gpu-1", action=action, reason="r", at=NOW))
    shown = {e.action: e.severity for e in view.recent}
    assert shown == {"configured": "info", "config_refused": "warning", "lost": "error"}
