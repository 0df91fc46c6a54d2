"""Memory enforcement: every allocation path, every interception route, the views programs read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tessera import region

from .conftest import SAN, HostDelay, MiB, wait_for

LIMIT = 1000 * MiB
CHUNK = 300 * MiB
# Under ASan the interception routes are not repeated: they share all but a few lines.
MODES = ["direct"] if SAN else ["direct", "dlsym", "procaddr"]


def request(kind: str) -> tuple[int, int]:
    """(argument of `alloc KIND`, bytes it really takes): cuctl's shapes are chosen to be exact."""
    if kind == "mipmap":  # a 8192x8192 float array + 2 mip levels
        side = 8192
        return side * side * 4, (side * side + (side // 2) ** 2 + (side // 4) ** 2) * 4
    return CHUNK, CHUNK


KINDS = [
    "plain",
    "pitch",
    "managed",
    "async",
    "pool",
    "vmm",
    "array",
    "array3d",
    "mipmap",
    "graphnode",
    "graphnode2",
    "ctx",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_enforcement_matrix(container, kind, mode):
    """Try to exceed a 1000 MiB limit on one path: the allocation that would cross it fails with
    CUDA_ERROR_OUT_OF_MEMORY, the OOM counter moves, and every view is right after each step."""
    container.seal(region.DeviceLimit("", LIMIT), ctx_charge_bytes=CHUNK)
    c = container.cuctl(mode)
    assert c("init")["ok"]
    if kind == "pool":
        assert c("pool_create")["ok"]
    arg, size = request(kind)
    held = []
    for step in range(4):
        r = c(f"alloc {kind} {arg}")
        fits = (len(held) + 1) * size <= LIMIT
        assert r["ok"] is fits, (step, r)
        if fits:
            held.append(r["id"])
        else:
            assert r["rc"] == 2  # CUDA_ERROR_OUT_OF_MEMORY
        used = len(held) * size
        info = c("info")
        assert (info["total"], info["free"]) == (LIMIT, LIMIT - used), step
        nvml = c("nvml")
        assert (nvml["total"], nvml["used"], nvml["free"]) == (LIMIT, used, LIMIT - used)
        assert c("total")["total"] == LIMIT
        assert container.used() == used
    assert len(held) == LIMIT // size
    assert container.usage().devices[0].oom_count >= 1
    for i in held:
        assert c(f"free {i}")["ok"]
    assert c("info")["free"] == LIMIT
    assert container.used() == 0
    c.close()


def test_pool_memory_stays_charged_until_trimmed(container):
    """A pool that keeps freed memory (high release threshold) still holds it: it is charged
    until cuMemPoolTrimTo gives it back, and reused by the pool without a new charge."""
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl()
    c("init")
    c("pool_create")
    c(f"pool_threshold {1 << 62}")
    ids = [c(f"alloc pool {CHUNK}")["id"] for _ in range(3)]
    for i in ids:
        assert c(f"free {i}")["ok"]
    assert container.used() == 3 * CHUNK  # retained by the pool
    assert c(f"alloc plain {CHUNK}")["rc"] == 2
    again = c(f"alloc pool {CHUNK}")  # reuse: no new charge
    assert again["ok"] and container.used() == 3 * CHUNK
    c(f"free {again['id']}")
    assert c("pool_trim 0")["ok"]
    assert container.used() == 0
    assert c(f"alloc plain {CHUNK}")["ok"]
    assert c("pool_destroy")["ok"]
    c.close()


def test_vmm_charged_until_released_and_unmapped(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl()
    c("init")
    h = c(f"alloc vmm {2 * CHUNK}")["id"]
    m = c(f"map {h} {2 * CHUNK}")
    assert m["ok"]
    assert c(f"free {h}")["ok"]  # cuMemRelease while still mapped: memory lives on
    assert container.used() == 2 * CHUNK
    assert c(f"alloc plain {2 * CHUNK}")["rc"] == 2
    assert c(f"free {m['id']}")["ok"]  # the unmap frees it
    assert container.used() == 0
    c.close()


def test_imported_vmm_handles_are_charged_to_the_mapper(cluster):
    """Memory exported by a process of another container does not escape the importer's limit."""
    other = cluster.container("exporter")
    exporter = other.cuctl(preload=False)
    exporter("init")
    fds = []
    for _ in range(4):
        h = exporter(f"alloc vmm {CHUNK}")["id"]
        fds.append(exporter(f"export {h}")["fd"])
    mine = cluster.container("importer")
    mine.seal(region.DeviceLimit("", LIMIT))
    c = mine.cuctl()
    c("init")
    results = []
    for fd in fds:
        h = c(f"import {fd}")["id"]
        results.append(c(f"map {h} {CHUNK}")["ok"])
    assert results == [True, True, True, False]
    assert mine.used() == 3 * CHUNK
    assert c("nvml")["used"] == 3 * CHUNK
    c.close()
    exporter.close()


def test_freeing_an_untracked_pointer_reaches_the_driver(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl()
    c("init")
    raw = c("alloc raw 4096")  # allocated behind libvgpu's back
    before = c("stats")["frees"]
    assert c(f"free {raw['id']}")["ok"]
    assert c("stats")["frees"] == before + 1
    assert container.used() == 0
    c.close()


def test_unlimited_device_reports_the_physical_size(container):
    c = container.cuctl()  # no limits at all
    c("init")
    phys = 16384 * MiB
    assert c("total")["total"] == phys
    assert c("info")["total"] == phys
    assert c("nvml")["total"] == phys
    c.close()


def test_env_limits_ignored_when_a_limits_file_exists(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl(CUDA_DEVICE_MEMORY_LIMIT_0="100g", CUDA_DEVICE_MEMORY_LIMIT="100g")
    c("init")
    assert c("info")["total"] == LIMIT
    c.close()


def test_env_limits_standalone(container):
    c = container.cuctl(CUDA_DEVICE_MEMORY_LIMIT_0="600m")
    c("init")
    assert c("info")["total"] == 600 * MiB
    assert c(f"alloc plain {CHUNK}")["ok"] and not c(f"alloc plain {CHUNK + MiB}")["ok"]
    c.close()


def test_dynamic_resize_and_no_wraparound(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl()
    c("init")
    assert c(f"alloc plain {2 * CHUNK}")["ok"]
    uuid = c("nvml")["uuid"]
    # the agent lowers the limit below what is in use
    dev = region.read_limits(container.limits_dir).devices[0]
    host = HostDelay(c.pid).start()
    region.seal_limits(
        container.limits_dir,
        region.ContainerLimits(
            devices=(region.DeviceLimit(uuid, 500 * MiB, dev.sm_limit_pct),),
            region_path=str(container.region_path),
        ),
    )
    seen, waited = wait_for(lambda: c("info")["total"] == 500 * MiB, timeout=2)
    late = host.seconds()  # the poll thread's and this thread's waits for a CPU (a loaded host)
    assert seen and waited < 0.1 + late, f"new limit seen after {waited:.3f}s ({late:.3f}s excused)"
    assert c("info")["free"] == 0
    nvml = c("nvml")
    assert (nvml["total"], nvml["used"], nvml["free"]) == (500 * MiB, 2 * CHUNK, 0)
    nvml2 = c("nvml2")
    assert (nvml2["total"], nvml2["used"], nvml2["free"]) == (500 * MiB, 2 * CHUNK, 0)
    assert c("alloc plain 1048576")["rc"] == 2
    assert region.set_device_flags(container.limits_dir, uuid, mem_limit_bytes=2000 * MiB)
    wait_for(lambda: c("info")["total"] == 2000 * MiB)
    assert c(f"alloc plain {3 * CHUNK}")["ok"]
    c.close()


def test_nvml_matches_devices_by_uuid(cluster):
    """NVML may order GPUs differently from CUDA: each keeps its own limit."""
    k = cluster.container()
    k.seal(
        region.DeviceLimit("GPU-fa4e0000-0000-0000-0000-000000000000", 1000 * MiB),
        region.DeviceLimit("GPU-fa4e0000-0000-0000-0000-000000000001", 2000 * MiB),
    )
    c = k.cuctl(FAKE_NVML_REVERSE="1")
    c("init 1")
    assert c("info")["total"] == 2000 * MiB
    n0, n1 = c("nvml 0"), c("nvml 1")
    assert n0["uuid"].endswith("01") and n0["total"] == 2000 * MiB
    assert n1["uuid"].endswith("00") and n1["total"] == 1000 * MiB
    c.close()


def test_limit_is_for_the_whole_container(container):
    container.seal(region.DeviceLimit("", LIMIT))
    a, b = container.cuctl(), container.cuctl("procaddr")
    a("init")
    b("init")
    assert a(f"alloc plain {2 * CHUNK}")["ok"]
    assert not b(f"alloc plain {2 * CHUNK}")["ok"]
    assert b(f"alloc plain {CHUNK}")["ok"]
    assert b("info")["free"] == LIMIT - 3 * CHUNK
    assert {p.pid for p in container.usage().processes} == {a.pid, b.pid}
    a.close()
    b.close()
    assert container.used() == 0


@pytest.mark.parametrize("scrub", [False, True])
def test_scrub_on_free(container, scrub):
    container.seal(region.DeviceLimit("", LIMIT), scrub_on_free=scrub)
    c = container.cuctl(FAKE_CHECK_SCRUB="1")
    c("init")
    for kind in ("plain", "async"):
        i = c(f"alloc {kind} {MiB}")["id"]
        c(f"write {i} 171")
        c(f"free {i}")
    s = c("stats")
    assert (s["frees_dirty"], s["frees_clean"]) == ((0, 2) if scrub else (2, 0))
    c.close()


def test_multi_process_stress_never_overcommits(container, native):
    """8 processes x 4 threads allocate and free at random: the device never holds more than
    the limit, not even for an instant (checked against the fake GPU's physical usage)."""
    container.seal(region.DeviceLimit("", LIMIT))
    out = container.run([str(native.bin / "stress"), "8", "4", "2", str(LIMIT)])
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["failed_procs"] == 0
    assert r["violations"] == 0 and r["max_used"] <= LIMIT
    assert r["allocs"] > 100 and r["ooms"] > 0
    u = container.usage()
    assert u.devices[0].used_bytes == 0 and u.devices[0].peak_bytes <= LIMIT
    assert not u.processes


def test_sigkill_of_the_lock_holder(container):
    """A process killed while holding the region lock: the others go on within 1 s and its
    memory is uncharged."""
    container.seal(region.DeviceLimit("", LIMIT))
    victim, other = container.cuctl(), container.cuctl()
    victim("init")
    other("init")
    assert victim(f"alloc plain {2 * CHUNK}")["ok"]
    assert victim(f"lockhold {container.region_path}")["locked"]
    other.send(f"alloc plain {2 * CHUNK}")  # blocks on the lock
    time.sleep(0.3)
    assert other.p.poll() is None
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    victim.p.wait()
    r = other.recv(timeout=5)
    assert r["ok"], r
    assert time.monotonic() - t0 < 1.0
    assert container.used() == 2 * CHUNK  # only the survivor's
    assert other(f"alloc plain {CHUNK}")["ok"]
    other.close()


def test_dead_process_memory_is_reclaimed(container):
    container.seal(region.DeviceLimit("", LIMIT))
    idle, victim = container.cuctl(), container.cuctl()
    idle("init")
    idle("alloc plain 4096")  # registered: its poll thread sweeps dead slots
    victim("init")
    assert victim(f"alloc plain {3 * CHUNK}")["ok"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.p.wait()
    freed, waited = wait_for(lambda: container.used() == 4096, timeout=3)
    assert freed, container.usage()
    assert waited < 2.5
    idle.close()


def test_dead_process_memory_reclaimed_on_demand(container):
    container.seal(region.DeviceLimit("", LIMIT))
    victim = container.cuctl()
    victim("init")
    assert victim(f"alloc plain {3 * CHUNK}")["ok"]
    victim.p.send_signal(signal.SIGKILL)
    victim.p.wait()
    c = container.cuctl()
    c("init")
    assert c(f"alloc plain {3 * CHUNK}")["ok"]  # the dead slot is swept before refusing
    c.close()


def test_region_version_mismatch_refuses_until_repaired(container):
    """A region of another major version is not trusted: under sealed limits every device
    allocation is refused (never per-process budgets), until the region is valid again."""
    container.seal(region.DeviceLimit("", LIMIT))
    data = bytearray(region.REGION_SIZE)
    data[0:4] = region.REGION_MAGIC.to_bytes(4, "little")
    data[4:6] = (region.VERSION_MAJOR + 1).to_bytes(2, "little")
    container.region_path.write_bytes(bytes(data))
    c = container.cuctl()
    c("init")
    assert not c(f"alloc plain {CHUNK}")["ok"]
    assert "bad header" in c.stderr()
    region.prepare_region_file(container.region_path)  # the node agent repairs it
    ok, _ = wait_for(lambda: c(f"alloc plain {CHUNK}")["ok"], timeout=5, step=0.02)
    assert ok
    assert container.used() == CHUNK
    assert c(f"alloc plain {2 * CHUNK}")["ok"]
    assert not c(f"alloc plain {CHUNK}")["ok"]  # the limit holds in the repaired region
    c.close()


def test_programs_without_cuda_are_untouched(container, native):
    out = subprocess.run(
        ["sh", "-c", "echo hello"], env=container.env(), capture_output=True, text=True
    )
    assert out.stdout == "hello\n" and out.stderr == ""
    assert not container.region_path.exists()
