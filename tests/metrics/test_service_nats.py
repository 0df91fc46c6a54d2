"""The service against a real nats-server: KV values, events and usage in; /metrics out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from metrics_testkit import (
    MIB,
    Bus,
    Exposition,
    allocation,
    container_usage,
    envelope,
    ledger,
    registration,
    scrape,
    start_service,
    usage,
)
from tessera.metrics.service import MetricsService

from tessera.bus import alloc_event_subject, publish_event, usage_subject
from tessera.codec import encode
from tessera.models import (
    AdmissionEvent,
    AllocationEvent,
    HostDeviceUsage,
    OomEvent,
    QuotaAmount,
    QuotaCharge,
    QuotaState,
    SchedulingFailedEvent,
)


async def until(service: MetricsService, check: Callable[[Exposition], bool],
                timeout: float = 5.0) -> Exposition:
    deadline = time.monotonic() + timeout
    while True:
        exposition = await scrape(service)
        if check(exposition) or time.monotonic() > deadline:
            return exposition
        await asyncio.sleep(0.05)


async def publish_cluster(bus: Bus, t0: float) -> None:
    """Two nodes, two pods placed (with their event history), one pod refused, one OOM."""
    await bus.buckets.nodes.put("gpu-a", encode(registration("gpu-a", gpus=2)))
    await bus.buckets.nodes.put("gpu-b", encode(registration("gpu-b", gpus=1)))
    train = allocation("gpu-a", "team-a", "train", [[("GPU-gpu-a-0", 40_960, 50)]],
                       names=["trainer"])
    infer = allocation("gpu-a", "team-b", "infer",
                       [[("GPU-gpu-a-0", 8_192, 20), ("GPU-gpu-a-1", 8_192, 20)]])
    await bus.buckets.ledger.put("gpu-a", encode(ledger("gpu-a", train, infer)))
    await bus.buckets.quota.put("team-a", encode(QuotaState(
        namespace="team-a", limits=QuotaAmount(memory_mib=81_920),
        charges={train.pod_uid: QuotaCharge(pod_uid=train.pod_uid, memory_mib=40_960,
                                            cores=50, gpus=1)})))
    for alloc in (train, infer):
        uid, ns, name = alloc.pod_uid, alloc.namespace, alloc.name
        await publish_event(bus.js, AdmissionEvent(event_id=f"{uid}:adm", action="mutated",
                                                   namespace=ns, name=name, at=t0))
        for action, dt in (("reserved", 0.05), ("bound", 0.2), ("allocated", 2.0)):
            await publish_event(bus.js, AllocationEvent(
                event_id=f"{uid}:{action}", action=action, node="gpu-a", pod_uid=uid,
                namespace=ns, name=name, containers=alloc.containers, at=t0 + dt))
    await publish_event(bus.js, SchedulingFailedEvent(
        event_id="huge:1", namespace="team-a", name="huge", pod_uid="uid-huge", at=t0 + 3,
        reason="0/2 nodes fit", node_reasons={"gpu-a": "2/2 CardInsufficientMemory",
                                              "gpu-b": "1/1 CardInsufficientMemory"}))
    await publish_event(bus.js, OomEvent(event_id="oom:1", node="gpu-a", namespace="team-a",
                                         pod="train", container="trainer", at=t0 + 4))


async def publish_stored_garbage(bus: Bus) -> None:
    """Bad values in the KV buckets and the stream: seen again by every replay."""
    await bus.buckets.nodes.put("broken-node", b"\x00 not msgpack at all")
    await bus.buckets.ledger.put("future-node", envelope("NodeLedger", 99, {"node": "x"}))
    await bus.js.publish(alloc_event_subject("gpu-a", "bound"), b"garbage")
    await bus.js.publish(alloc_event_subject("gpu-a", "bound"),
                         envelope("AllocationEvent", 42, {"action": "bound"}))


async def publish_usage_garbage(bus: Bus) -> None:
    """Core NATS is not stored: only a running service sees these."""
    await bus.nc.publish(usage_subject("gpu-a"), b"\xc1")  # 0xc1 is never valid msgpack
    await bus.nc.publish(usage_subject("gpu-a"), envelope("UsageSample", 1, {"node": 5}))


async def test_exposition_names_labels_and_values_from_the_bus(bus: Bus) -> None:
    t0 = time.time() - 60
    await publish_cluster(bus, t0)
    await publish_stored_garbage(bus)
    service = await start_service(bus)
    try:
        await publish_usage_garbage(bus)
        train = allocation("gpu-a", "team-a", "train", [[("GPU-gpu-a-0", 40_960, 50)]])
        sampled_at = time.time()  # one clock read: the elapsed figure is exact on a busy host
        await bus.nc.publish(usage_subject("gpu-a"), encode(usage(
            "gpu-a", sampled_at,
            [container_usage(train, "trainer", "GPU-gpu-a-0", 30_000, 40_960, 48.0, 50,
                             last_kernel_at=sampled_at - 0.5)],
            [HostDeviceUsage(uuid="GPU-gpu-a-0", used_bytes=31_000 * MIB,
                             total_bytes=81_920 * MIB, utilization=61.0)])))
        m = await until(service, lambda m: m.value("tessera_bus_bad_messages_total",
                                                   source="usage") == 2
                        and m.value("hami_vgpu_memory_used_bytes") is not None)
        gpu_a0 = {"node": "gpu-a", "device_uuid": "GPU-gpu-a-0", "device_index": "0",
                  "device_type": "NVIDIA-H200"}
        # HAMi's scheduler metrics, with HAMi's label names.
        assert m.value("hami_gpu_memory_limit_bytes", **gpu_a0) == 81_920 * MIB
        assert m.value("hami_gpu_memory_allocated_bytes", **gpu_a0) == 49_152 * MIB
        assert m.value("hami_gpu_core_allocated_ratio", **gpu_a0) == 70
        assert m.value("hami_gpu_shared_count", **gpu_a0) == 2
        assert m.value("hami_node_gpu_overview", **gpu_a0) == 49_152 * MIB
        assert m.value("hami_node_gpu_memory_allocated_ratio", **gpu_a0) == 0.6
        assert m.value("hami_gpu_shared_count", node="gpu-b", device_uuid="GPU-gpu-b-0") == 0
        assert m.value("hami_vgpu_memory_allocated_bytes", namespace="team-b", pod="infer",
                       container_index="0", device_uuid="GPU-gpu-a-1") == 8_192 * MIB
        assert m.value("hami_resource_quota_used", namespace="team-a",
                       quota_name="nvidia.com/gpumem") == 40_960
        assert m.value("hami_resource_quota_limit", namespace="team-a",
                       quota_name="nvidia.com/gpumem", limit="81920") == 81_920
        # HAMi's node metrics, from the usage sample.
        ctr = {"namespace": "team-a", "pod": "train", "container": "trainer",
               "vdevice_index": "0", "device_uuid": "GPU-gpu-a-0"}
        assert m.value("hami_vgpu_memory_used_bytes", **ctr) == 30_000 * MIB
        assert m.value("hami_vgpu_memory_limit_bytes", **ctr) == 40_960 * MIB
        assert m.value("hami_container_device_utilization_ratio", **ctr) == 48
        elapsed = m.value("hami_container_last_kernel_elapsed_seconds", **ctr)
        assert elapsed == pytest.approx(0.5, abs=1e-3)
        assert m.value("hami_host_gpu_memory_used_bytes", **gpu_a0) == 31_000 * MIB
        assert m.value("hami_host_gpu_utilization_ratio", **gpu_a0) == 61
        # Tessera's own: the memory ledgers side by side, latency, refusals, OOMs, bad input.
        for kind, mib in (("physical", 81_920), ("allocated", 49_152), ("used", 31_000),
                          ("containers_used", 30_000)):
            assert m.value("tessera_gpu_memory_bytes", kind=kind, **gpu_a0) == mib * MIB, kind
        assert m.value("tessera_container_compute_ratio", kind="achieved", **ctr) == 0.48
        assert m.value("tessera_container_compute_ratio", kind="limit", **ctr) == 0.5
        latency = {"stage": "admission_to_bound"}
        assert m.value("tessera_scheduling_latency_seconds_count", **latency) == 2
        assert m.value("tessera_scheduling_latency_seconds_bucket", le="0.1", **latency) == 0
        assert m.value("tessera_scheduling_latency_seconds_bucket", le="0.25", **latency) == 2
        assert m.value("tessera_scheduling_latency_seconds_count",
                       stage="bound_to_allocated") == 2
        assert m.value("tessera_scheduling_refusals_total", reason="CardInsufficientMemory") == 2
        assert m.value("tessera_pods_pending", namespace="team-a") == 1
        assert m.value("tessera_oom_events_total", node="gpu-a", namespace="team-a", pod="train",
                       container="trainer") == 1
        assert m.value("tessera_quota_limit", namespace="team-a", resource="memory_bytes") == (
            81_920 * MIB)
        for source, count in (("nodes", 1), ("ledger", 1), ("events", 2), ("usage", 2)):
            assert m.value("tessera_bus_bad_messages_total", source=source) == count, source
        assert m.value("tessera_metrics_synced") == 1
        # The bad node key did not become a node; the service still serves.
        assert m.value("tessera_node_registered", node="broken-node") is None
        async with httpx.AsyncClient(base_url=service.url) as client:
            state = (await client.get("/api/state")).json()
            page = await client.get("/")
            script = await client.get("/static/app.js")
            ready = await client.get("/readyz")
        # Neither undecodable value became a node.
        assert [n["name"] for n in state["nodes"]] == ["gpu-a", "gpu-b"]
        assert state["pending"][0]["name"] == "huge"
        assert page.status_code == 200 and "static/app.js" in page.text
        assert script.status_code == 200 and "api/state" in script.text
        assert ready.status_code == 200
    finally:
        await service.stop()


def _replayed(m: Exposition) -> dict[tuple[str, tuple], float]:
    """Every counter and histogram sample: what must survive a restart."""
    keep = ("tessera_scheduling_latency_seconds", "tessera_scheduling_refusals",
            "tessera_scheduling_failures", "tessera_oom_events", "tessera_allocation_events",
            "tessera_admission_events", "tessera_metrics_events_applied")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for name, family in m.families.items() if name in keep
        for s in family.samples if not s.name.endswith("_created")
    }


async def test_restart_rebuilds_counters_and_histograms_from_the_stream(bus: Bus) -> None:
    t0 = time.time() - 60
    await publish_cluster(bus, t0)
    first = await start_service(bus)
    try:
        before = await scrape(first)
    finally:
        await first.stop()
    values = _replayed(before)
    assert values[("tessera_allocation_events_total",
                   (("action", "bound"), ("node", "gpu-a")))] == 2
    assert values[("tessera_scheduling_latency_seconds_count",
                   (("stage", "bound_to_allocated"),))] == 2

    second = await start_service(bus)
    try:
        after = await scrape(second)
        assert _replayed(after) == values
        assert after.value("hami_gpu_memory_allocated_bytes", device_uuid="GPU-gpu-a-0") == (
            before.value("hami_gpu_memory_allocated_bytes", device_uuid="GPU-gpu-a-0"))
        # It keeps counting from there: one more pod bound.
        await publish_event(bus.js, AllocationEvent(
            event_id="late:bound", action="bound", node="gpu-a", pod_uid="late",
            namespace="team-a", name="late", at=time.time()))
        later = await until(second, lambda m: m.value(
            "tessera_allocation_events_total", node="gpu-a", action="bound") == 3)
        assert later.value("tessera_allocation_events_total", node="gpu-a", action="bound") == 3
    finally:
        await second.stop()


async def test_broker_restart_the_view_heals(bus: Bus) -> None:
    await bus.buckets.nodes.put("gpu-a", encode(registration("gpu-a", gpus=1)))
    service = await start_service(bus)
    try:
        bus.server.kill()
        await asyncio.sleep(0.3)
        bus.server.start()
        for _ in range(100):
            try:  # JetStream may need a moment to recover its streams
                await bus.buckets.nodes.put("gpu-c", encode(registration("gpu-c", gpus=1)))
                break
            except Exception:
                await asyncio.sleep(0.1)
        await publish_event(bus.js, AllocationEvent(
            event_id="after:bound", action="bound", node="gpu-c", pod_uid="p",
            namespace="ns", name="p", at=time.time()))
        m = await until(service, lambda m: m.value("tessera_node_registered", node="gpu-c") == 1
                        and m.value("tessera_allocation_events_total", node="gpu-c") == 1,
                        timeout=15.0)
        assert m.value("tessera_node_registered", node="gpu-c") == 1
        assert m.value("tessera_allocation_events_total", node="gpu-c", action="bound") == 1
    finally:
        await service.stop()


async def test_resync_drops_keys_deleted_while_not_watching(bus: Bus) -> None:
    await bus.buckets.nodes.put("gpu-a", encode(registration("gpu-a", gpus=1)))
    await bus.buckets.nodes.put("gpu-gone", encode(registration("gpu-gone", gpus=1)))
    service = await start_service(bus)
    try:
        assert (await scrape(service)).value("tessera_node_registered", node="gpu-gone") == 1
        # What a reconnect does: the watches stop, the world changes, the watches start again.
        await service.feeds._stop_streams()
        await bus.buckets.nodes.delete("gpu-gone")
        service.feeds._start_streams()
        m = await until(service, lambda m: m.value("tessera_node_registered",
                                                   node="gpu-gone") is None)
        assert m.value("tessera_node_registered", node="gpu-gone") is None
        assert m.value("tessera_node_registered", node="gpu-a") == 1
    finally:
        await service.stop()
