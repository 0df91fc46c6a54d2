"""The watchdog on the node agent's /metrics: breach episodes by reason and action, processes
ended, NVML errors and missing NVML entry points, region files by state — read from a running
agent whose watchdog polls a fake NVML on an old driver and really kills a tenant process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from node_agent_rig import running_rig
from test_agent_metrics import value
from test_watchdog_nvml import build_variant
from watchdog_rig import Breaches, WatchEnv, admit, make_env, wait_exit, watched_rig

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process


@pytest.fixture
def env(
    short_dir: Path, fake_nvml_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WatchEnv]:
    watch_env = make_env(short_dir, fake_nvml_lib, monkeypatch)
    try:
        yield watch_env
    finally:
        watch_env.cleanup()


async def test_watchdog_actions_missing_entry_points_and_regions_are_scraped(env, nc, buckets):
    lib = build_variant(env.base / "old", "FAKE_NVML_NO_PROCESSES_V3",
                        "FAKE_NVML_NO_PROCESS_UTILIZATION")
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, probe=env.probe(lib), enforcement="kill") as rig:
        render = rig.agent.metrics.render
        assert value(render(), "tessera_node_agent_watchdog_up") == 1
        # The driver lacks utilisation: said once, by capability.
        assert value(render(), "tessera_node_agent_watchdog_missing_entry_points",
                     entry_point="process_utilization") == 1
        assert value(render(), "tessera_node_agent_watchdog_missing_entry_points",
                     entry_point="process_list") is None
        pod_uid, region = await admit(rig, "greedy", 1000)
        tenant = env.spawn_in_pod(pod_uid)
        env.gpu_holds((0, tenant, 1800, 0))
        assert await wait_exit(tenant, timeout=15) is not None
        event = await breaches.next()
        while event.breach != "memory":
            event = await breaches.next()
        text = render()
        assert value(text, "tessera_node_agent_watchdog_actions_total", reason="memory",
                     action="killed") == 1
        assert value(text, "tessera_node_agent_watchdog_killed_processes_total") >= 1
        assert value(text, "tessera_node_agent_watchdog_polls_total") > 0
        assert value(text, "tessera_node_agent_watchdog_failures_total", stage="poll") == 0
        # tampered (libvgpu never wrote the region) is observed, never killed.
        tampered = value(text, "tessera_node_agent_watchdog_actions_total", reason="tampered",
                         action="observed")
        assert tampered in (None, 1.0)
        assert value(text, "tessera_node_agent_watchdog_actions_total", reason="tampered",
                     action="killed") is None
        # A region file overwritten with junk: the agent no longer knows the usage, and says so.
        assert value(text, "tessera_node_agent_regions", state="damaged") == 0
        Path(region).write_bytes(b"junk" * 10)
        assert value(render(), "tessera_node_agent_regions", state="damaged") == 1
    await breaches.close()


async def test_without_a_watchdog_up_is_zero(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:  # static GPUs: no NVML, no watchdog
        text = rig.agent.metrics.render()
        assert value(text, "tessera_node_agent_watchdog_up") == 0
        assert value(text, "tessera_node_agent_watchdog_polls_total") == 0
