"""The dashboard in headless Chromium: GPU bars and pending reasons appear as events arrive."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from metrics_testkit import (
    MIB,
    Bus,
    allocation,
    container_usage,
    ledger,
    registration,
    start_service,
    usage,
)

from tessera.bus import publish_event, usage_subject
from tessera.codec import encode
from tessera.models import (
    AllocationEvent,
    AllocationState,
    HostDeviceUsage,
    NodeEvent,
    OomEvent,
    QuotaAmount,
    QuotaCharge,
    QuotaState,
    SchedulingFailedEvent,
)

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed (`make browser` installs it)"
)


async def test_dashboard_shows_gpu_bars_and_pending_reasons(bus: Bus, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    await bus.buckets.nodes.put("gpu-node-1", encode(registration("gpu-node-1", gpus=2)))
    await bus.buckets.quota.put("ml-team", encode(QuotaState(
        namespace="ml-team", limits=QuotaAmount(memory_mib=49_152, cores=100),
        charges={"uid-ml-team-trainer-0": QuotaCharge(pod_uid="uid-ml-team-trainer-0",
                                                      memory_mib=40_960, cores=50, gpus=1)})))
    await bus.buckets.nodes.put("gpu-node-2", encode(registration("gpu-node-2", gpus=1,
                                                                  memory_mib=24_576)))
    service = await start_service(bus)
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--headless", "--no-sandbox", "--disable-gpu",
                      "--disable-background-networking"],
            )
            try:
                page = await browser.new_page(viewport={"width": 1440, "height": 1000})
                await page.goto(service.url + "/")
                gpu = page.locator('.gpu[data-uuid="GPU-gpu-node-1-0"]')
                await gpu.wait_for(timeout=10_000)
                assert await gpu.locator(".bar.mem .seg").count() == 0  # idle so far

                # Pods get placed and a big one is refused: the open page updates by itself.
                train = allocation("gpu-node-1", "ml-team", "trainer-0",
                                   [[("GPU-gpu-node-1-0", 40_960, 50)]], names=["pytorch"])
                infer = allocation("gpu-node-1", "web", "infer-api",
                                   [[("GPU-gpu-node-1-0", 16_384, 25)]], names=["server"])
                notebook = allocation("gpu-node-1", "research", "notebook",
                                      [[("GPU-gpu-node-1-1", 12_288, 30)]],
                                      state=AllocationState.BOUND, names=["jupyter"])
                await bus.buckets.ledger.put("gpu-node-1", encode(
                    ledger("gpu-node-1", train, infer, notebook)))
                t0 = time.time() - 5
                for alloc in (train, infer):
                    await publish_event(bus.js, AllocationEvent(
                        action="allocated", node="gpu-node-1", pod_uid=alloc.pod_uid,
                        namespace=alloc.namespace, name=alloc.name,
                        containers=alloc.containers, at=t0))
                await publish_event(bus.js, SchedulingFailedEvent(
                    namespace="ml-team", name="trainer-big", pod_uid="uid-big", at=t0 + 1,
                    reason="0/2 nodes fit: 2 node(s) CardInsufficientMemory",
                    node_reasons={"gpu-node-1": "2/2 CardInsufficientMemory",
                                  "gpu-node-2": "1/1 CardInsufficientMemory"}))
                await publish_event(bus.js, OomEvent(node="gpu-node-1", namespace="web",
                                                     pod="infer-api", container="server",
                                                     at=t0 + 2))
                await publish_event(bus.js, NodeEvent(node="gpu-node-2", action="registered",
                                                      at=t0 - 60))
                await bus.nc.publish(usage_subject("gpu-node-1"), encode(usage(
                    "gpu-node-1", time.time(),
                    [container_usage(train, "pytorch", "GPU-gpu-node-1-0", 31_000, 40_960,
                                     47.0, 50)],
                    [HostDeviceUsage(uuid="GPU-gpu-node-1-0", used_bytes=45_000 * MIB,
                                     total_bytes=81_920 * MIB, utilization=63.0)])))

                segments = gpu.locator(".bar.mem .seg")
                await page.wait_for_function(
                    """() => document.querySelectorAll(
                        '.gpu[data-uuid="GPU-gpu-node-1-0"] .bar.mem .seg').length === 2""",
                    timeout=10_000,
                )
                pods = sorted([await segments.nth(i).get_attribute("data-pod") for i in range(2)])
                assert pods == ["ml-team/trainer-0", "web/infer-api"]
                widths = {
                    await segments.nth(i).get_attribute("data-pod"):
                        await segments.nth(i).evaluate("e => e.style.width")
                    for i in range(2)
                }
                assert widths["ml-team/trainer-0"] == "50%"  # 40 GiB of 80 GiB
                assert widths["web/infer-api"] == "20%"
                core_segment = gpu.locator('.bar.cores .seg[data-pod="ml-team/trainer-0"]')
                assert await core_segment.evaluate("e => e.style.width") == "50%"
                assert await gpu.locator(".used-mark").count() == 1
                bound = page.locator('.gpu[data-uuid="GPU-gpu-node-1-1"] .bar.mem .seg.bound')
                assert await bound.get_attribute("data-pod") == "research/notebook"

                pending = page.locator('.pending-pod[data-pod="ml-team/trainer-big"]')
                await pending.wait_for(timeout=10_000)
                reasons = await pending.locator(".reasons li").all_inner_texts()
                assert any("gpu-node-1" in r and "2/2 CardInsufficientMemory" in r
                           for r in reasons)
                assert "CardInsufficientMemory" in await pending.locator(".summary").inner_text()
                quota = page.locator('.quota[data-namespace="ml-team"]')
                assert "40 GiB of 48 GiB" in await quota.inner_text()
                events = await page.locator("#events li").all_inner_texts()
                assert any("out of GPU memory" in e for e in events)
                await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

                # The pending pod is placed: its reasons go away without a reload.
                await publish_event(bus.js, AllocationEvent(
                    action="bound", node="gpu-node-2", pod_uid="uid-big",
                    namespace="ml-team", name="trainer-big", at=time.time()))
                await pending.wait_for(state="detached", timeout=10_000)
                assert (tmp_path / "dashboard.png").stat().st_size > 10_000
            finally:
                await browser.close()
    finally:
        await service.stop()
