"""MIG through NVML: the test NVML's MIG part (fake_nvml_mig.c) as pynvml sees it, and the node
agent's discovery / create / destroy (nvml_mig.py) on top of it. The fake's profile table is
generated from tessera/mig.py (fake_nvml_mig.py), so both sides use NVIDIA's numbers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from pathlib import Path

import pynvml
import pytest
from fake_nvml_mig import gpu_lines, instance_line, profile_id

from tessera import mig
from tessera.device_kinds.nvidia.nvml_backend import bind_nvml_library

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process

A100 = mig.MODELS["A100-SXM4-80GB"]
A30 = mig.MODELS["A30"]
U = [f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(3)]
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _config(extra: str = "") -> str:
    return (
        f"gpu {U[0]} 81920 0 00000000:17:00.0 1 NVIDIA A100-SXM4-80GB\n"
        f"gpu {U[1]} 24576 0 00000000:18:00.0 1 NVIDIA A30\n"
        f"gpu {U[2]} 81920 0 00000000:19:00.0 0 NVIDIA A100-SXM4-80GB\n"
        + gpu_lines(0, A100) + gpu_lines(1, A30) + gpu_lines(2, A100) + extra
    )


@pytest.fixture
def nvml(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """pynvml on the fake; returns a function (re)starting NVML with extra config lines.

    pynvml is bound to the fake by path, as the node agent binds it: left to its own
    dlopen("libnvidia-ml.so.1"), it gets whichever library of that soname this process loaded
    first (an earlier test's fake driver, e.g. the native suite's watchdog probe). Its binding
    is restored afterwards, so no later test inherits this one."""
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    bind_nvml_library(str(fake_nvml_lib))
    config = tmp_path / "nvml.conf"
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(config))
    monkeypatch.setenv("FAKE_NVML_MIG_STATE", str(tmp_path / "mig.state"))
    monkeypatch.setenv("FAKE_NVML_PROCESSES", str(tmp_path / "procs"))
    started = []

    def start(extra: str = "") -> None:
        config.write_text(_config(extra))
        pynvml.nvmlInit()
        started.append(1)

    yield start
    for _ in started:  # NVML counts inits; a test may have shut one down itself
        with contextlib.suppress(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlShutdown()


def _handle(i: int) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(i)


@pytest.mark.parametrize(("gpu", "model"), [(0, A100), (1, A30)], ids=["A100-80GB", "A30"])
def test_profiles_and_placements_are_nvidias(nvml, gpu: int, model: mig.MigModel) -> None:
    """Every profile answers with the documented id, compute slices, memory and placements."""
    nvml()
    h = _handle(gpu)
    for profile in model.profiles:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, mig.nvml_profile_index(model, profile))
        assert info.id == profile_id(model, profile)
        assert info.sliceCount == profile.compute_slices
        assert info.memorySizeMB == model.profile_memory_mib(profile)
        assert info.instanceCount == profile.max_instances
        assert _text(info.name) == f"MIG {profile.name}"  # the v2 struct (pynvml's default)
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(count))
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, placements,
                                                          ctypes.byref(count))
        assert [(p.start, p.size) for p in placements] == [
            (s, profile.memory_slices) for s in profile.starts]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def test_existing_instances_are_discovered_with_mig_uuids(nvml) -> None:
    from tessera.node_agent import nvml_mig

    nvml(instance_line(0, A100, "3g.40gb", 4) + instance_line(0, A100, "1g.10gb", 0)
         + instance_line(1, A30, "2g.12gb", 2))
    a100 = nvml_mig.list_devices(_handle(0), 0)
    assert sorted((d.profile, d.start, d.memory_mib) for d in a100) == [
        ("1g.10gb", 0, 10240), ("3g.40gb", 4, 40960)]
    assert all(MIG_UUID.match(d.uuid) and d.parent_uuid == U[0] for d in a100)
    assert len({d.uuid for d in a100}) == 2
    a30 = nvml_mig.list_devices(_handle(1), 1)
    assert [(d.profile, d.start) for d in a30] == [("2g.12gb", 2)]
    assert nvml_mig.list_devices(_handle(2), 2) == []  # MIG mode off
    # MIG device handles as NVML documents them
    dev = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(_handle(0), 0)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(dev).value == 1
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(dev)
    assert _text(pynvml.nvmlDeviceGetUUID(parent)) == U[0]
    assert "MIG" in _text(pynvml.nvmlDeviceGetName(dev))
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(_handle(0)) == 7
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(_handle(0), 2)


def test_create_follows_placement_rules_with_nvidias_errors(nvml) -> None:
    from tessera.node_agent import nvml_mig

    nvml()
    h = _handle(0)
    big = nvml_mig.create(h, 0, "4g.40gb", 0)
    assert (big.profile, big.start, big.memory_mib) == ("4g.40gb", 0, 40960)
    assert MIG_UUID.match(big.uuid)
    with pytest.raises(nvml_mig.MigNvmlError) as overlap:
        nvml_mig.create(h, 0, "2g.20gb", 2)  # slices 2-3 belong to the 4g instance
    assert overlap.value.no_room
    with pytest.raises(nvml_mig.MigNvmlError) as wrong:
        nvml_mig.create(h, 0, "3g.40gb", 2)  # 3g may start only at 0 or 4
    assert wrong.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT
    small = nvml_mig.create(h, 0, "2g.20gb", 4)
    assert {d.uuid for d in nvml_mig.list_devices(h, 0)} == {big.uuid, small.uuid}
    # a MIG-disabled card refuses instances
    with pytest.raises(nvml_mig.MigNvmlError):
        nvml_mig.create(_handle(2), 2, "1g.10gb", 0)
    # compute slices run out: 4g + 2g + 1g = 7 of 7; slice 7 is free but takes no 1g
    nvml_mig.create(h, 0, "1g.10gb", 6)
    with pytest.raises(nvml_mig.MigNvmlError) as full:
        nvml_mig.create(h, 0, "1g.10gb", 6)
    assert full.value.no_room
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id) == 0


def test_instances_outlive_a_restart_and_busy_ones_are_not_destroyed(
        nvml, tmp_path: Path) -> None:
    from tessera.node_agent import nvml_mig

    nvml()
    h = _handle(0)
    dev = nvml_mig.create(h, 0, "1g.10gb", 3)
    pynvml.nvmlShutdown()
    nvml()  # the agent restarted: the driver still has the instance
    h = _handle(0)
    assert [d.uuid for d in nvml_mig.list_devices(h, 0)] == [dev.uuid]
    # a GPU instance with a compute instance in it cannot go first
    gi = pynvml.nvmlDeviceGetGpuInstanceById(h, dev.gi_id)
    with pytest.raises(pynvml.NVMLError) as busy_gi:
        pynvml.nvmlGpuInstanceDestroy(gi)
    assert busy_gi.value.value == pynvml.NVML_ERROR_IN_USE
    # a process runs in it (this test's own pid, alive)
    procs = tmp_path / "procs"
    procs.write_text(f"0 {os.getpid()} 512 10 {dev.gi_id} {dev.ci_id}\n")
    with pytest.raises(nvml_mig.MigNvmlError) as busy:
        nvml_mig.destroy(h, dev.gi_id)
    assert busy.value.in_use
    assert [d.uuid for d in nvml_mig.list_devices(h, 0)] == [dev.uuid]
    running = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in running] == [
        (os.getpid(), dev.gi_id, dev.ci_id)]
    tmp = tmp_path / "procs.tmp"
    tmp.write_text("")
    tmp.rename(procs)
    nvml_mig.destroy(h, dev.gi_id)
    assert nvml_mig.list_devices(h, 0) == []
    nvml_mig.destroy(h, dev.gi_id)  # already gone: nothing to do


def test_the_nvml_source_offers_what_nvml_holds(nvml, fake_nvml_lib: Path) -> None:
    """What static MIG serves on a real node: NvmlSource.mig_offers over the driver's instances,
    planned under `mixed` into one resource per profile."""
    from tessera.node_agent import mig_static
    from tessera.node_agent.nvml import NvmlSource

    from tessera.settings import TesseraSettings

    nvml(instance_line(0, A100, "1g.10gb", 0) + instance_line(0, A100, "1g.10gb", 1)
         + instance_line(1, A30, "2g.12gb", 0))
    source = NvmlSource(TesseraSettings(nvml_library=str(fake_nvml_lib)))
    try:
        gpus = source.discover()
        offers = source.mig_offers()
    finally:
        source.close()
    assert [g.mig for g in gpus] == [True, True, False]
    plan = mig_static.plan("mixed", offers, "nvidia.com/gpu")
    assert {r: [(o.parent_uuid, o.start) for o in v] for r, v in plan.resources.items()} == {
        "nvidia.com/mig-1g.10gb": [(U[0], 0), (U[0], 1)],
        "nvidia.com/mig-2g.12gb": [(U[1], 0)],
    }
    assert all(MIG_UUID.match(o.uuid) for o in offers)


def test_the_gpu_check_step_runs_against_nvml(fake_nvml_lib: Path, tmp_path: Path) -> None:
    """gpu-check.sh's MIG step (gpu_mig_check.py), run here on the test NVML: the table agrees,
    an instance is discovered, one is created and destroyed. (On a real H200: not yet run.)"""
    import subprocess
    import sys

    h200 = mig.MODELS["H200"]
    config = tmp_path / "nvml.conf"
    config.write_text(f"gpu {U[0]} 144384 0 00000000:17:00.0 1 NVIDIA H200\n"
                      + gpu_lines(0, h200) + instance_line(0, h200, "3g.71gb", 4))
    env = {**os.environ, "FAKE_NVML_CONFIG": str(config), "TESSERA_GPU_CHECK_MIG_CREATE": "1",
           "FAKE_NVML_MIG_STATE": str(tmp_path / "state"),
           "LD_LIBRARY_PATH": str(fake_nvml_lib.parent)}
    script = Path(__file__).with_name("gpu_mig_check.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"problems": []' in done.stdout and '"created": "MIG-' in done.stdout
    assert '"3g.71gb", 4' in done.stdout
