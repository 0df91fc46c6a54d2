"""Device discovery through NVML (against the fake libnvidia-ml.so.1) and the static source."""

from __future__ import annotations

from pathlib import Path

import pytest
from tessera.node_agent.devices import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    HealthEvent,
    HealthTracker,
    advertise,
)
from tessera.node_agent.nvidia_source import StaticSource

from tessera.settings import TesseraSettings

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process

U = [f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}" for i in range(4)]

CONFIG = f"""\
gpu {U[0]} 81559 0 00000000:17:00.0 0 NVIDIA H200
gpu {U[1]} 81559 0 00000000:18:00.0 0 NVIDIA H200
gpu {U[2]} 81559 1 00000000:97:00.0 0 NVIDIA H200
gpu {U[3]} 40960 1 00000000:98:00.0 1 NVIDIA A100-SXM4-40GB
topo 0 1 10
topo 0 2 50
topo 0 3 50
topo 1 2 50
topo 1 3 50
topo 2 3 30
nvlink 0 2 4
"""


@pytest.fixture
def nvml_env(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = tmp_path / "nvml.conf"
    config.write_text(CONFIG)
    events = tmp_path / "events"
    events.write_text("")
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(config))
    monkeypatch.setenv("FAKE_NVML_EVENTS", str(events))
    settings = TesseraSettings(nvml_library=str(fake_nvml_lib))
    return settings, events


def test_nvml_discovery_reads_every_property(nvml_env):
    from tessera.node_agent.nvml import NvmlSource

    settings, _ = nvml_env
    source = NvmlSource(settings)
    try:
        gpus = source.discover()
    finally:
        source.close()
    assert [g.uuid for g in gpus] == U
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0].type == "NVIDIA-NVIDIA H200"
    assert gpus[3].type == "NVIDIA-NVIDIA A100-SXM4-40GB"
    assert gpus[0].memory_mib == 81559 and gpus[3].memory_mib == 40960
    assert [g.numa for g in gpus] == [0, 0, 1, 1]
    assert [g.mig for g in gpus] == [False, False, False, True]
    # HAMi's link scores: single switch 50, cross-CPU 10, host bridge 30, 4 NVLinks 400.
    assert gpus[0].links[U[1]] == 50
    assert gpus[1].links[U[2]] == 10
    assert gpus[2].links[U[3]] == 30
    assert gpus[0].links[U[2]] == 400 and gpus[2].links[U[0]] == 400


DECOY_NVML = """\
/* Another library with NVML's soname: it says the host has no GPUs. */
int nvmlInit_v2(void) { return 0; }
int nvmlInitWithFlags(unsigned int flags) { (void)flags; return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 0; return 0; }
"""

DISCOVER_AFTER_DECOY = """\
import ctypes, sys
from tessera.node_agent.nvml import NvmlSource
from tessera.settings import TesseraSettings
ctypes.CDLL(sys.argv[1])  # loaded first, by path, as another component of the process might
source = NvmlSource(TesseraSettings(nvml_library=sys.argv[2]))
try:
    print(",".join(g.uuid for g in source.discover()))
finally:
    source.close()
"""


def test_the_configured_nvml_library_is_used_when_another_of_its_soname_is_loaded(
    nvml_env, fake_nvml_lib: Path, tmp_path: Path
):
    # The dynamic loader answers pynvml's dlopen("libnvidia-ml.so.1") with whichever library of
    # that soname the process loaded first; the node agent must still read the one configured.
    import subprocess
    import sys

    source = tmp_path / "decoy.c"
    source.write_text(DECOY_NVML)
    decoy = tmp_path / "decoy" / "libnvidia-ml.so.1"
    decoy.parent.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(decoy),
                    str(source)], check=True)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", DISCOVER_AFTER_DECOY, str(decoy), str(fake_nvml_lib)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split(",") == U


def test_advertised_devices_apply_scaling_and_mode(nvml_env):
    from tessera.node_agent.nvml import NvmlSource

    settings, _ = nvml_env
    source = NvmlSource(settings)
    try:
        gpus = source.discover()
    finally:
        source.close()
    scaled = settings.model_copy(update={
        "device_memory_scaling": 1.5, "device_core_scaling": 2, "device_split_count": 4
    })
    infos = advertise(gpus, scaled, unhealthy=frozenset({U[1]}))
    assert infos[0].memory_mib == int(81559 * 1.5) and infos[0].physical_memory_mib == 81559
    assert infos[0].cores == 200 and infos[0].split_count == 4
    assert [i.healthy for i in infos] == [True, False, True, True]
    assert infos[3].mode == "mig" and infos[0].mode == "hami-core"


def test_nvml_events_ignore_harmless_xids(nvml_env):
    from tessera.node_agent.nvml import NvmlSource

    settings, events = nvml_env
    source = NvmlSource(settings)
    try:
        source.discover()
        with events.open("a") as f:
            f.write(f"1 {EVENT_XID_CRITICAL} 43\n")  # ignored by default (HAMi's list)
            f.write(f"1 {EVENT_SINGLE_BIT_ECC} 0\n")  # corrected: harmless
            f.write(f"1 {EVENT_XID_CRITICAL} 79\n")  # fell off the bus: critical
            f.write(f"2 {EVENT_DOUBLE_BIT_ECC} 0\n")
            f.write(f"-1 {EVENT_XID_CRITICAL} 48\n")
        seen = []
        for _ in range(8):
            event = source.wait_event(0.05)
            if event:
                seen.append(event)
        assert seen == [
            HealthEvent(U[1], "xid", 79), HealthEvent(U[2], "ecc", 0), HealthEvent(None, "xid", 48)
        ]
        assert source.wait_event(0.02) is None
    finally:
        source.close()


def test_ignored_xids_are_configurable(nvml_env):
    from tessera.node_agent.nvml import NvmlSource

    settings, events = nvml_env
    source = NvmlSource(settings.model_copy(update={"ignored_xids": "79"}))
    try:
        source.discover()
        with events.open("a") as f:
            f.write(f"0 {EVENT_XID_CRITICAL} 79\n")
            f.write(f"0 {EVENT_XID_CRITICAL} 43\n")
        seen = [source.wait_event(0.05) for _ in range(3)]
        assert [e for e in seen if e] == [HealthEvent(U[0], "xid", 43)]
    finally:
        source.close()


def test_health_tracker_recovers_after_quiet_period():
    tracker = HealthTracker(U[:2], recovery_s=10)
    assert tracker.record(HealthEvent(U[0], "xid", 79), now=100) == [U[0]]
    assert tracker.record(HealthEvent(U[0], "xid", 79), now=105) == []  # already unhealthy
    assert tracker.unhealthy == {U[0]}
    assert tracker.recover(now=112) == []  # the second event restarted the clock
    assert tracker.recover(now=115) == [U[0]]
    assert tracker.record(HealthEvent(None, "lost"), now=200) == U[:2]


def test_static_source_is_stable_and_spread_over_numa():
    settings = TesseraSettings(static_gpu_count=4, static_numa_nodes=2, static_gpu_memory_mib=1000)
    a = StaticSource(settings, "node-a").discover()
    assert [g.uuid for g in a] == [g.uuid for g in StaticSource(settings, "node-a").discover()]
    assert {g.uuid for g in a}.isdisjoint(g.uuid for g in StaticSource(settings, "b").discover())
    assert [g.numa for g in a] == [0, 0, 1, 1]
    assert a[0].links[a[1].uuid] == 20 and a[0].links[a[2].uuid] == 10
    assert all(g.memory_mib == 1000 and g.type.startswith("NVIDIA-") for g in a)


def test_static_source_takes_injected_faults(tmp_path):
    faults = tmp_path / "faults"
    settings = TesseraSettings(static_gpu_count=2, static_fault_file=str(faults))
    source = StaticSource(settings, "node-f")
    gpus = [g.uuid for g in source.discover()]
    assert source.wait_event(0.01) is None  # no file yet
    faults.write_text("1 79\n0 43\n-1 48\n0 6")  # the last line is not finished yet
    assert source.wait_event(0.2) == HealthEvent(gpus[1], "xid", 79)
    assert source.wait_event(0.2) == HealthEvent(None, "xid", 48)  # 43 is ignored
    assert source.wait_event(0.05) is None
    with faults.open("a") as f:
        f.write("2\n")
    assert source.wait_event(0.2) == HealthEvent(gpus[0], "xid", 62)
