"""Metrics service: scrape cost at cluster scale, event folding rate, restart replay over NATS.

    .venv/bin/python bench/metrics.py
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client import generate_latest
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.service import MetricsService
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.bus import connect, ensure_bus, publish_event
from tessera.codec import encode
from tessera.events import decode_event
from tessera.models import (
    AdmissionEvent,
    Allocation,
    AllocationEvent,
    ContainerUsage,
    DeviceGrant,
    DeviceInfo,
    DeviceUsage,
    Event,
    HostDeviceUsage,
    NodeLedger,
    NodeRegistration,
    UsageSample,
)
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats, free_port

sys.path.insert(0, str(Path(__file__).parent))
from record import record_section

NODES, GPUS, PODS_PER_GPU = 500, 8, 4
NOW = time.time()


def cluster_view() -> ClusterView:
    view = ClusterView()
    for n in range(NODES):
        node = f"node-{n:04d}"
        devices = [DeviceInfo(uuid=f"GPU-{n}-{g}", index=g, type="NVIDIA-H200",
                              memory_mib=81_920, physical_memory_mib=81_920)
                   for g in range(GPUS)]
        view.put_node(node, NodeRegistration(node=node, devices=devices))
        allocations, containers = {}, []
        for g in range(GPUS):
            for p in range(PODS_PER_GPU):
                uid = f"u-{n}-{g}-{p}"
                allocations[uid] = Allocation(
                    pod_uid=uid, namespace=f"ns-{p}", name=f"pod-{n}-{g}-{p}", node=node,
                    containers=[[DeviceGrant(uuid=f"GPU-{n}-{g}", type="NVIDIA-H200",
                                             memory_mib=10_000, cores=20)]],
                    container_names=["main"], state="allocated")
                containers.append(ContainerUsage(
                    pod_uid=uid, namespace=f"ns-{p}", pod=f"pod-{n}-{g}-{p}", container="main",
                    devices=[DeviceUsage(uuid=f"GPU-{n}-{g}", used_bytes=5 << 30,
                                         limit_bytes=10_000 << 20, sm_util=15, sm_limit=20,
                                         last_kernel_at=NOW - 1)]))
        view.put_ledger(node, NodeLedger(node=node, allocations=allocations))
        view.put_usage(UsageSample(node=node, at=NOW, containers=containers, devices=[
            HostDeviceUsage(uuid=f"GPU-{n}-{g}", used_bytes=20 << 30, utilization=60)
            for g in range(GPUS)]), received_at=NOW)
    return view


def timed(fn, repeat: int = 5) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def pod_events(count: int) -> list[Event]:
    events: list[Event] = []
    for i in range(count // 4):
        uid, t = f"u{i}", NOW - 3600 + i * 0.01
        events.append(AdmissionEvent(event_id=f"{uid}:a", action="mutated", namespace="ns",
                                     name=f"p{i}", at=t))
        for k, action in enumerate(("reserved", "bound", "allocated")):
            events.append(AllocationEvent(event_id=f"{uid}:{action}", action=action,
                                          node=f"node-{i % NODES}", pod_uid=uid, namespace="ns",
                                          name=f"p{i}", at=t + 0.05 * (k + 1)))
    return events


async def loop_lag_during_scrape(service: MetricsService, big: ClusterView) -> tuple[float, float]:
    """(scrape seconds over HTTP, worst event-loop stall meanwhile) with the big cluster loaded."""
    service.view.nodes.update(big.nodes)
    service.view.ledgers.update(big.ledgers)
    service.view.usage.update(big.usage)
    worst = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        loop = asyncio.get_running_loop()
        while not done.is_set():
            before = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - before - 0.001)

    tick = asyncio.create_task(ticker())
    start = time.perf_counter()
    # The client runs in its own thread: only the service's own work counts as a stall.
    response = await asyncio.to_thread(httpx.get, f"{service.url}/metrics", timeout=120)
    elapsed = time.perf_counter() - start
    done.set()
    await tick
    assert response.status_code == 200
    return elapsed, worst


async def replay_over_nats(
    events: list[Event], big: ClusterView
) -> tuple[float, int, float, float]:
    server = EmbeddedNats().start()
    try:
        nc = await connect(NatsSettings(NATS_URL=server.url), name="bench")
        settings = TesseraSettings()
        buckets = await ensure_bus(nc.jetstream(), settings)
        js = nc.jetstream()
        for batch in range(0, len(events), 500):
            await asyncio.gather(*(publish_event(js, e) for e in events[batch:batch + 500]))
        start = time.perf_counter()
        service = MetricsService(nc, js, buckets, settings, listen=f"127.0.0.1:{free_port()}")
        await service.start()
        await service.feeds.wait_synced(timeout=300)
        elapsed = time.perf_counter() - start
        applied = service.view.events_applied
        scrape_s, worst_lag = await loop_lag_during_scrape(service, big)
        await service.stop()
        await nc.close()
        return elapsed, applied, scrape_s, worst_lag
    finally:
        server.cleanup()


def main() -> None:
    load_before = os.getloadavg()[0]
    view = cluster_view()
    registry = build_registry(view, TesseraSettings(), lambda: NOW)
    scrape_s, text = timed(lambda: generate_latest(registry))
    state_s, state = timed(lambda: json.dumps(dashboard_state(view, NOW)))
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))

    events = pod_events(40_000)
    payloads = [encode(e) for e in events]
    fold_view = ClusterView()
    start = time.perf_counter()
    for seq, payload in enumerate(payloads, start=1):
        fold_view.apply_event(decode_event(payload), seq)
    fold_rate = len(payloads) / (time.perf_counter() - start)

    nats_events = pod_events(20_000)
    replay_s, applied, http_scrape_s, worst_lag = asyncio.run(
        replay_over_nats(nats_events, view))

    gpus, pods = NODES * GPUS, NODES * GPUS * PODS_PER_GPU
    lines = [
        f"Cluster: {NODES} nodes × {GPUS} GPUs ({gpus} GPUs), {pods} pods with usage samples.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| /metrics render, plain generate_latest (cyclic GC on) | "
        f"{scrape_s * 1000:.0f} ms, {series} series, "
        f"{len(text) / 1e6:.1f} MB |",
        f"| /metrics over HTTP in the service (snapshot rendered in a thread) | "
        f"{http_scrape_s * 1000:.0f} ms; worst event-loop stall meanwhile "
        f"{worst_lag * 1000:.0f} ms |",
        f"| /api/state (JSON) | {state_s * 1000:.0f} ms, {len(state) / 1e6:.1f} MB |",
        f"| event fold (decode + apply, pure) | {fold_rate:,.0f} events/s |",
        f"| restart replay over NATS ({len(nats_events)} events) | {replay_s:.2f} s to ready "
        f"({applied} applied, {applied / replay_s:,.0f} events/s) |",
    ]
    lines += ["", f"Load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
              "(2 shared cores: figures move by 2-3× with the load)."]
    markdown = "\n".join(lines)
    print(markdown)
    record_section("metrics", markdown)


if __name__ == "__main__":
    main()
