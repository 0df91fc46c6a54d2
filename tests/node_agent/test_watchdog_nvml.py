"""The watchdog's NVML probe against drivers that lack entry points: it falls back to older
process-list versions, goes on without utilisation, and never crashes; the agent still catches
a memory breach on such a driver."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from watchdog_rig import MIB, Breaches, WatchEnv, admit, make_env, wait_exit, watched_rig

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process

HERE = Path(__file__).parent


def build_variant(out: Path, *defines: str) -> Path:
    """fake_nvml.c built without some entry points (another file, so another library copy)."""
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "libnvidia-ml.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *[f"-D{d}" for d in defines],
         "-Wl,-soname,libnvidia-ml.so.1", "-Wl,-Bsymbolic", "-o", str(lib),
         str(HERE / "fake_nvml.c")],
        check=True,
    )
    return lib


@pytest.fixture
def env(
    short_dir: Path, fake_nvml_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WatchEnv]:
    watch_env = make_env(short_dir, fake_nvml_lib, monkeypatch)
    try:
        yield watch_env
    finally:
        watch_env.cleanup()


@pytest.mark.parametrize(("defines", "entry_point"), [
    ((), "nvmlDeviceGetComputeRunningProcesses_v3"),
    (("FAKE_NVML_NO_PROCESSES_V3",), "nvmlDeviceGetComputeRunningProcesses_v2"),
    (("FAKE_NVML_NO_PROCESSES_V3", "FAKE_NVML_NO_PROCESSES_V2"),
     "nvmlDeviceGetComputeRunningProcesses"),
])
def test_process_list_falls_back_to_the_versions_the_driver_has(env, defines, entry_point):
    lib = build_variant(env.base / "_".join(defines or ("all",)), *defines)
    a, b = env.spawn(None), env.spawn(None)
    env.gpu_holds((0, a, 700, 20), (1, b, 3000, 0), (1, a, 5, 1))
    probe = env.probe(lib)
    try:
        assert probe.list_entry_point == entry_point
        seen = sorted((p.uuid, p.pid, p.used_bytes, p.sm_pct) for p in probe.poll())
    finally:
        probe.close()
    # each layout read right (the v1 struct is 16 bytes, v2/v3 24): pids and bytes intact
    assert seen == sorted([(env.uuids[0], a.pid, 700 * MIB, 20.0),
                           (env.uuids[1], b.pid, 3000 * MIB, 0.0),
                           (env.uuids[1], a.pid, 5 * MIB, 1.0)])
    assert not probe.errors


def test_no_utilisation_entry_point_degrades_with_a_logged_error(env, caplog):
    lib = build_variant(env.base / "noutil", "FAKE_NVML_NO_PROCESS_UTILIZATION")
    a = env.spawn(None)
    env.gpu_holds((0, a, 700, 90))
    with caplog.at_level(logging.ERROR, logger="tessera.node_agent.watchdog"):
        probe = env.probe(lib)
    try:
        assert not probe.has_utilization
        (proc,) = probe.poll()
        assert (proc.pid, proc.used_bytes, proc.sm_pct) == (a.pid, 700 * MIB, None)
        probe.poll()
    finally:
        probe.close()
    assert probe.errors["missing:process_utilization"] == 1  # counted (and logged) once
    assert any("compute is not judged" in getattr(r, "err", "") for r in caplog.records)


def test_no_process_list_at_all_polls_nothing_and_never_crashes(env):
    lib = build_variant(env.base / "nolist", "FAKE_NVML_NO_PROCESSES_V3",
                        "FAKE_NVML_NO_PROCESSES_V2", "FAKE_NVML_NO_PROCESSES_V1",
                        "FAKE_NVML_NO_PROCESS_UTILIZATION")
    a = env.spawn(None)
    env.gpu_holds((0, a, 700, 90))
    probe = env.probe(lib)
    try:
        assert probe.list_entry_point is None
        assert probe.poll() == [] and probe.poll() == []
    finally:
        probe.close()
    assert probe.errors["missing:process_list"] == 1


async def test_agent_on_an_old_driver_still_kills_a_memory_breach(env, nc, buckets):
    """_v2 only and no utilisation: memory is still judged (compute cannot be)."""
    lib = build_variant(env.base / "old", "FAKE_NVML_NO_PROCESSES_V3",
                        "FAKE_NVML_NO_PROCESS_UTILIZATION")
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, probe=env.probe(lib), enforcement="kill") as rig:
        pod_uid, _ = await admit(rig, "old-driver", 1000)
        tenant = env.spawn_in_pod(pod_uid)
        env.gpu_holds((0, tenant, 1800, 100))
        assert await wait_exit(tenant, timeout=15) is not None
        event = await breaches.next()
        while event.breach != "memory":
            event = await breaches.next()
        assert event.action == "killed" and event.pids == [tenant.pid]
        watchdog = rig.agent.watchdog
        assert watchdog.probe.errors["missing:process_utilization"] == 1
        # a kill after the grace period takes two polls at least (the first sighting, one the
        # grace later); more at 0.6 s a poll, fewer than 4 when a busy host holds polls up
        assert watchdog.stats["poll_failed"] == 0 and watchdog.stats["polls"] >= 2
    await breaches.close()
