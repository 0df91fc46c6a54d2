"""What a process that only uses NVML sees (issue 19, item 7): the nvidia-smi pattern — memory
info and running processes — shows its own limit and its own container's usage from the first
call, without a CUDA context."""

from __future__ import annotations

import pytest

from tessera import region

from .conftest import MiB
from .test_run import run

LIMIT = 1000 * MiB
UUID0 = "GPU-fa4e0000-0000-0000-0000-000000000000"


@pytest.mark.parametrize("by", ["uuid", "ordinal"])
def test_nvml_only_process_sees_its_limit_and_its_containers_usage(cluster, by):
    """By UUID (the node agent) or by CUDA ordinal (`tessera run`, HAMi env vars)."""
    k, other = cluster.container("k"), cluster.container("other")
    k.seal(region.DeviceLimit(UUID0 if by == "uuid" else "", LIMIT, 0))
    other.seal(region.DeviceLimit(UUID0, 4 * LIMIT, 0))
    a, o = k.cuctl(), other.cuctl()
    assert a("init")["ok"] and a("alloc plain 314572800")["ok"]
    assert o("init")["ok"] and o("alloc plain 209715200")["ok"]
    smi = k.cuctl()  # never initialises CUDA
    for cmd in ("nvml", "nvml2"):
        v = smi(cmd)
        assert v["rc"] == 0
        assert (v["total"], v["used"], v["free"]) == (LIMIT, 300 * MiB, LIMIT - 300 * MiB), cmd
    assert k.usage().devices[0].limit_bytes == LIMIT  # what `tessera run` and the agent read


@pytest.mark.parametrize("ver", [3, 2, 1])
def test_running_processes_are_the_containers_own(cluster, ver):
    k, other = cluster.container("k"), cluster.container("other")
    k.seal(region.DeviceLimit(UUID0, LIMIT, 0))
    other.seal(region.DeviceLimit(UUID0, LIMIT, 0))
    a, idle, o = k.cuctl(), k.cuctl(), other.cuctl()
    assert a("init")["ok"] and a("alloc plain 314572800")["ok"]
    assert idle("init")["ok"] and idle("info")  # a context, no memory
    assert o("init")["ok"] and o("alloc plain 104857600")["ok"]
    smi = k.cuctl()
    r = smi(f"procs 0 {ver}")
    assert r["rc"] == 0
    assert sorted(map(tuple, r["procs"])) == sorted([(a.pid, 300 * MiB), (idle.pid, 0)])
    # the neighbour sees only its own
    assert other.cuctl()(f"procs 0 {ver}")["procs"] == [[o.pid, 100 * MiB]]


def test_running_processes_in_a_pid_namespace(cluster):
    """NVML lists host pids: a process with memory is known from the region; one with only a
    context is matched once the node agent has written its host pid."""
    k = cluster.container("k")
    k.seal(region.DeviceLimit(UUID0, LIMIT, 0))
    off = {"FAKE_NVML_PID_OFFSET": "100000"}
    a, idle = k.cuctl(**off), k.cuctl(**off)
    assert a("init")["ok"] and a("alloc plain 104857600")["ok"]
    assert idle("init")["ok"] and idle("alloc plain 4096")["ok"]  # registers its slot
    slot = next(p.slot for p in k.usage().processes if p.pid == idle.pid)
    assert idle("free 0")["ok"]
    smi = k.cuctl(**off)
    assert smi("procs")["procs"] == [[a.pid, 100 * MiB]]
    region.set_host_pid(k.region_path, slot, idle.pid + 100000)
    assert sorted(map(tuple, smi("procs")["procs"])) == sorted([(a.pid, 100 * MiB), (idle.pid, 0)])


def test_tessera_run_reports_the_limit_to_an_nvml_only_program(native, tmp_path):
    out = run(native, tmp_path, ["--gpumem", "1500", "--", str(native.bin / "cuctl")], "nvml\n")
    assert out.returncode == 0, out.stderr
    assert f'"total": {1500 * MiB}' in out.stdout
    assert "of 1500 MiB" in out.stderr and "unlimited" not in out.stderr, out.stderr
