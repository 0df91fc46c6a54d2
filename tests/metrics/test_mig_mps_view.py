"""The dashboard's MIG and MPS views: a card's MIG instances (static ones as its node registered
them, dynamic ones from the ledger) at their placement with the pod holding each, and a card's
MPS clients (each pod's own server with its limits) — in the view's JSON and in the page."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from metrics_testkit import Bus, allocation, ledger, start_service
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView

from tessera.codec import encode
from tessera.models import (
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    MigCapability,
    MigInstanceGrant,
    MigState,
    NodeRegistration,
    StaticMigInstance,
)

A100 = "NVIDIA-NVIDIA A100-SXM4-80GB"
NOW = 1_800_000_000.0
CHROMIUM = Path("/usr/bin/chromium")


def _cards(node: str, at: float) -> NodeRegistration:
    static = DeviceInfo(uuid="GPU-static", index=0, type=A100, memory_mib=81920, cores=100,
                        split_count=1, mode="mig", mig_instances=[
                            StaticMigInstance(uuid="MIG-s1", profile="1g.10gb", start=0, size=1,
                                              pod="serve/vllm"),
                            StaticMigInstance(uuid="MIG-s2", profile="3g.40gb", start=4, size=4)])
    dynamic = DeviceInfo(uuid="GPU-dynamic", index=1, type=A100, memory_mib=81920, cores=100,
                         split_count=7, mode="mig", mig=MigCapability(model="A100-SXM4-80GB"))
    shared = DeviceInfo(uuid="GPU-mps", index=2, type="NVIDIA-H200", memory_mib=143_771,
                        cores=100, split_count=10, mode="mps")
    plain = DeviceInfo(uuid="GPU-plain", index=3, type="NVIDIA-H200", memory_mib=143_771,
                       cores=100, split_count=10)
    return NodeRegistration(node=node, devices=[static, dynamic, shared, plain], heartbeat_at=at)


def _allocations(node: str):
    dyn = allocation(node, "ml", "finetune", [[("GPU-dynamic", 40_960, 42)]], names=["trainer"])
    dyn.containers[0][0] = DeviceGrant(
        uuid="GPU-dynamic", type=A100, memory_mib=40_960, cores=42,
        mig=MigInstanceGrant(profile="3g.40gb", start=4, size=4, mig_uuid="MIG-d1",
                             state=MigState.CREATED))
    small = allocation(node, "web", "embed", [[("GPU-mps", 4096, 30)]], names=["server"])
    large = allocation(node, "web", "rerank", [[("GPU-mps", 16_384, 0)]], names=["server"],
                       state=AllocationState.BOUND)
    plain = allocation(node, "lab", "notebook", [[("GPU-plain", 2048, 10)]], names=["jupyter"])
    return dyn, small, large, plain


def test_cards_show_their_mig_instances_and_mps_servers() -> None:
    view = ClusterView()
    view.put_node("n1", _cards("n1", NOW))
    view.put_ledger("n1", ledger("n1", *_allocations("n1")))
    assert view.rejected == {}  # every value was valid and applied
    state = dashboard_state(view, NOW)
    gpus = {g["uuid"]: g for g in state["nodes"][0]["gpus"]}

    static = gpus["GPU-static"]
    assert static["mig_slices"] == 8
    assert [(i["source"], i["profile"], i["start"], i["size"], i["pod"])
            for i in static["mig_instances"]] == [
        ("static", "1g.10gb", 0, 1, "serve/vllm"), ("static", "3g.40gb", 4, 4, "")]
    [dyn] = gpus["GPU-dynamic"]["mig_instances"]
    assert (dyn["source"], dyn["uuid"], dyn["profile"], dyn["start"], dyn["size"], dyn["pod"],
            dyn["container"], dyn["state"]) == (
        "dynamic", "MIG-d1", "3g.40gb", 4, 4, "ml/finetune", "trainer", "created")
    assert gpus["GPU-static"]["mps_clients"] == [] and gpus["GPU-dynamic"]["mps_clients"] == []

    # Each MPS pod's own server limits: its memory, its cores as thread % (0 = 100 %).
    assert [(c["pod"], c["container"], c["memory_mib"], c["thread_pct"], c["state"])
            for c in gpus["GPU-mps"]["mps_clients"]] == [
        ("web/embed", "server", 4096, 30, "allocated"),
        ("web/rerank", "server", 16_384, 100, "bound")]
    assert gpus["GPU-mps"]["mig_instances"] == []
    assert gpus["GPU-plain"]["mps_clients"] == [] and gpus["GPU-plain"]["mig_instances"] == []

    # A released pod leaves the card's MPS clients and its dynamic instance.
    dyn_alloc, small, large, plain = _allocations("n1")
    small.state = AllocationState.RELEASED
    dyn_alloc.state = AllocationState.RELEASED
    view.put_ledger("n1", ledger("n1", dyn_alloc, small, large, plain))
    gpus = {g["uuid"]: g for g in dashboard_state(view, NOW)["nodes"][0]["gpus"]}
    assert [c["pod"] for c in gpus["GPU-mps"]["mps_clients"]] == ["web/rerank"]
    assert gpus["GPU-dynamic"]["mig_instances"] == []


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed")
async def test_the_page_draws_instances_at_their_placement_and_mps_servers(
    bus: Bus, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright

    await bus.buckets.nodes.put("n1", encode(_cards("n1", time.time())))
    service = await start_service(bus)
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--headless", "--no-sandbox", "--disable-gpu",
                      "--disable-background-networking"])
            try:
                page = await browser.new_page(viewport={"width": 1440, "height": 1000})
                await page.goto(service.url + "/")
                static = page.locator('.gpu[data-uuid="GPU-static"]')
                await static.wait_for(timeout=10_000)
                held = static.locator('.mig-instance[data-uuid="MIG-s1"]')
                assert await held.get_attribute("data-pod") == "serve/vllm"
                assert "held" in (await held.get_attribute("class") or "")
                free = static.locator('.mig-instance[data-uuid="MIG-s2"]')
                assert "free" in (await free.get_attribute("class") or "")
                # at its placement: slices 4-7 of 8 are the right half of the strip
                assert await free.evaluate("e => [e.style.left, e.style.width]") == [
                    "50%", "50%"]
                assert "3g.40gb" in await free.inner_text()
                assert await page.locator('.gpu[data-uuid="GPU-mps"] .mps-none').count() == 1

                # pods arrive: the page follows without a reload
                await bus.buckets.ledger.put("n1", encode(ledger("n1", *_allocations("n1"))))
                dyn = page.locator('.gpu[data-uuid="GPU-dynamic"] .mig-instance')
                await dyn.wait_for(timeout=10_000)
                assert await dyn.get_attribute("data-pod") == "ml/finetune"
                assert await dyn.get_attribute("data-source") == "dynamic"
                assert await dyn.evaluate("e => e.style.left") == "50%"
                clients = page.locator('.gpu[data-uuid="GPU-mps"] .mps-client')
                await page.wait_for_function(
                    """() => document.querySelectorAll(
                        '.gpu[data-uuid="GPU-mps"] .mps-client').length === 2""",
                    timeout=10_000)
                texts = await clients.all_inner_texts()
                assert any("web/embed" in t and "4.0 GiB pinned" in t and "30% threads" in t
                           for t in texts), texts
                assert any("web/rerank" in t and "16 GiB pinned" in t and "100% threads" in t
                           for t in texts), texts
                assert "MPS" in await page.locator(
                    '.gpu[data-uuid="GPU-mps"] .badge.mode').inner_text()
                assert await page.locator('.gpu[data-uuid="GPU-plain"] .mig-strip').count() == 0
                await page.screenshot(path=str(tmp_path / "mig-mps.png"), full_page=True)
            finally:
                await browser.close()
    finally:
        await service.stop()
