"""The metrics service applies only values that pass validation, and stops counting a dead or
forged node as registered promptly (real nats-server, real HTTP)."""

from __future__ import annotations

import asyncio
import time

import httpx
from metrics_testkit import GIB_MIB, Bus, registration, scrape, start_service

from tessera.bus import publish_event
from tessera.codec import encode
from tessera.models import NodeEvent


async def wait_for(service, check, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        exposition = await scrape(service)
        if check(exposition):
            return exposition
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached:\n{exposition.text[-2000:]}")
        await asyncio.sleep(0.05)


async def test_forged_registration_is_counted_not_applied(bus: Bus) -> None:
    service = await start_service(bus)
    try:
        real = registration("gpu-r", gpus=1, memory_mib=80 * GIB_MIB)
        await bus.buckets.nodes.put("gpu-r", encode(real))
        limit = dict(node="gpu-r", device_uuid="GPU-gpu-r-0")
        await wait_for(service, lambda e: e.value("hami_gpu_memory_limit_bytes", **limit))
        forged = real.model_copy(deep=True)
        forged.devices[0].memory_mib = forged.devices[0].physical_memory_mib = 800 * GIB_MIB
        await bus.buckets.nodes.put("gpu-r", encode(forged))
        exposition = await wait_for(service, lambda e: e.value(
            "tessera_bus_rejected_total", source="registration", reason="memory_out_of_range"
        ))  # fmt: skip
        assert exposition.value("hami_gpu_memory_limit_bytes", **limit) == 80 * GIB_MIB * 2**20
    finally:
        await service.stop()


async def test_dead_or_lost_nodes_stop_counting_as_registered(bus: Bus) -> None:
    service = await start_service(bus)
    try:
        live = registration("gpu-live", gpus=1)
        dead = registration("gpu-dead", gpus=1)
        dead.heartbeat_at = time.time() - 10 * bus.settings.node_ttl_s  # stopped long ago
        lost = registration("gpu-lost", gpus=1)
        for reg in (live, dead, lost):
            await bus.buckets.nodes.put(reg.node, encode(reg))
        exposition = await wait_for(
            service, lambda e: e.value("tessera_node_registered", node="gpu-lost") == 1
        )
        assert exposition.value("tessera_node_registered", node="gpu-live") == 1
        assert exposition.value("tessera_node_registered", node="gpu-dead") == 0
        # The scheduler announces a node whose entry expired (no delete reaches watchers).
        await publish_event(bus.js, NodeEvent(action="lost", node="gpu-lost", reason="ttl"))
        exposition = await wait_for(
            service, lambda e: not e.value("tessera_node_registered", node="gpu-lost")
        )
        assert exposition.value("tessera_node_registered", node="gpu-live") == 1
    finally:
        await service.stop()


async def test_post_metrics_is_405(bus: Bus) -> None:
    service = await start_service(bus)
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{service.url}/metrics", content=b"x", timeout=5)
        assert response.status_code == 405
    finally:
        await service.stop()
