"""Issue 19: a hostile tenant, as it would be in a container. Every program here runs as an
unprivileged user (uid/gid 65534) in its own mount namespace where /etc/ld.so.preload (mode 0444,
root's) names libvgpu, with the limits sealed by "the node agent" (root, 0444) and the region
prepared by it (0666, like the agent's). The tenant has no LD_PRELOAD of its own to drop.

It tries: zeroing, truncating and overfilling the region, a huge compute budget, glibc's own
dlsym through dlvsym, graph memory nodes, and a copy of the dynamic loader that ignores the
preload file. Everything but the last is blocked in-process; the last is shown to bypass
libvgpu (no LD_PRELOAD limiter can stop it): the node agent's watchdog is what catches it
(services/node-agent, tests/node_agent: kill or observe within its grace period). The rig is
tenant_rig.py; races between libvgpu's threads and the tenant are test_tenant_races.py."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera import region

from .conftest import MiB, wait_for
from .tenant_rig import CHUNK, LIMIT, UID, dev_off, slot_off


def test_tenant_is_unprivileged_and_cannot_touch_its_limits(tenant):
    c = tenant.cuctl()
    assert c("init")["ok"]
    status = Path(f"/proc/{c.pid}/status").read_text()
    assert f"Uid:\t{UID}\t{UID}" in status
    assert "/libvgpu.so" in Path(f"/proc/{c.pid}/maps").read_text()  # from the preload file
    assert c("info")["total"] == LIMIT  # the sealed limit, not CUDA_DEVICE_MEMORY_LIMIT=100g
    assert [c(f"alloc plain {CHUNK}")["ok"] for _ in range(4)] == [True, True, True, False]
    assert tenant.used() == 3 * CHUNK
    probe = tenant.python(
        "import sys\n"
        f"for p in ('/etc/ld.so.preload', '{tenant.base}/sealed/limits'):\n"
        "    try:\n        open(p, 'r+b')\n        print('writable', p)\n"
        "    except PermissionError:\n        pass\n"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout == ""
    c.close()


def test_zeroed_counters_do_not_double_the_budget(tenant):
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    n = region.MAX_PROCS
    zero = tenant.python(
        f"f = open('{tenant.region_path}', 'r+b')\n"
        f"f.seek({dev_off('used_bytes')}); f.write(bytes(8))\n"
        f"for i in range({n}):\n"
        f"    f.seek({slot_off(0, 'used')} + i * {ctypes.sizeof(region.ProcSlotC)})\n"
        "    f.write(bytes(8))\n"
    )
    assert zero.returncode == 0, zero.stderr
    assert not a(f"alloc plain {CHUNK}")["ok"]  # its own charges are put back first
    restored, _ = wait_for(lambda: tenant.used() == 3 * CHUNK, timeout=15)
    assert restored
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert not b(f"alloc plain {CHUNK}")["ok"]  # a new process sees the container's usage
    assert b(f"alloc plain {100 * MiB}")["ok"]
    assert a("phys")["phys"] <= LIMIT


def test_a_lowered_total_is_put_back_by_the_processes(tenant):
    """Without leases the region is the account. Lowering a device's total by one process's
    share, no lower than any process's own (and that process's own count with it), was never
    repaired: each process checked only its own slot and that the total covered its own share,
    and the container went past its limit for good. Each process now also raises the total to
    what the live slots hold, within a poll tick."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {2 * CHUNK}")["ok"]
    (mine,) = [s for s in region.read_region(tenant.region_path).processes if s.pid == a.pid]
    lower = tenant.python(
        f"f = open('{tenant.region_path}', 'r+b')\n"
        f"f.seek({dev_off('used_bytes')}); f.write(({2 * CHUNK}).to_bytes(8, 'little'))\n"
        f"f.seek({slot_off(mine.slot, 'used')}); f.write(bytes(8))\n"
    )
    assert lower.returncode == 0, lower.stderr
    back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK, timeout=5)
    assert back, f"the container's total after the tenant lowered it: {tenant.used()}"
    assert not b(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT


def test_truncated_region_gives_no_fresh_budget(tenant):
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    tenant.truncate_region()
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert not b(f"alloc plain {CHUNK}")["ok"]  # refused until the region is repaired
    refused, _ = wait_for(lambda: not a(f"alloc plain {10 * MiB}")["ok"], timeout=3)
    assert refused, a.stderr()
    # the tenant writes a fresh, valid header: the live processes put their charges back
    tenant.write_fresh_region()
    back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK, timeout=5)
    assert back, tenant.used()
    ok, _ = wait_for(lambda: b(f"alloc plain {50 * MiB}")["ok"], timeout=5, step=0.05)
    assert ok
    assert not b(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT
    assert "bad header" in b.stderr() or "unusable" in b.stderr()


def bogus_table(tenant, claim_pid: int | None) -> str:
    lines = [f"f = open('{tenant.region_path}', 'r+b')"]
    for d in range(region.MAX_DEVICES):
        lines.append(
            f"f.seek({dev_off('uuid', d)}); f.write(b'GPU-bogus-{d:02d}'.ljust(64, b'\\0'))"
        )
        lines.append(
            f"f.seek({dev_off('used_bytes', d)}); f.write((1 << 30).to_bytes(8, 'little'))"
        )
    lines.append(
        f"f.seek({region.RegionC.num_devices.offset}); f.write((16).to_bytes(4, 'little'))"
    )
    if claim_pid:  # a live process "holds" something on every bogus device
        lines.append(f"f.seek({slot_off(0, 'pid')}); f.write(({claim_pid}).to_bytes(4, 'little'))")
        for d in range(region.MAX_DEVICES):
            lines.append(
                f"f.seek({slot_off(0, 'used')} + {d * 8}); f.write((1).to_bytes(8, 'little'))"
            )
    return "\n".join(lines) + "\n"


def test_overfilled_device_table_is_reclaimed_for_the_sealed_device(tenant):
    fill = tenant.python(bogus_table(tenant, None))
    assert fill.returncode == 0, fill.stderr
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    assert not a(f"alloc plain {CHUNK}")["ok"]
    assert tenant.used() == 3 * CHUNK  # charged in the shared region again
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert not b(f"alloc plain {CHUNK}")["ok"]  # container-wide


def test_device_table_held_by_bogus_claims_fails_closed(tenant):
    """Every slot claimed by a live process: libvgpu cannot take one, so each process is held to
    the limit by its own allocations (a second process could take another limit's worth: that
    is the watchdog's to catch, memory > limit + 5 % for 2 s)."""
    holder = subprocess.Popen([*tenant.prefix, "sleep", "60"], env=tenant.env())
    try:
        time.sleep(0.2)
        fill = tenant.python(bogus_table(tenant, holder.pid))
        assert fill.returncode == 0, fill.stderr
        a = tenant.cuctl()
        assert a("init")["ok"]
        assert a(f"alloc plain {3 * CHUNK}")["ok"]
        assert not a(f"alloc plain {CHUNK}")["ok"]  # never unlimited
        assert a("info")["total"] == LIMIT
        assert "no device slot" in a.stderr()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timing
def test_huge_compute_budget_does_not_lift_the_limit(tenant):
    tenant.seal(sm=30)
    a = tenant.cuctl()
    assert a("init")["ok"]
    writer = subprocess.Popen(
        [*tenant.prefix, sys.executable, "-c",
         "import time\n"
         f"f = open('{tenant.region_path}', 'r+b')\n"
         "end = time.time() + 2.5\n"
         "while time.time() < end:\n"
         f"    f.seek({dev_off('budget_ns')})\n"
         "    f.write((1 << 62).to_bytes(8, 'little')); f.flush()\n"
         "    time.sleep(0.001)\n"],
        env=tenant.env(),
    )  # fmt: skip
    try:
        got = a("burn 2.0 k_1000us kernel", timeout=60)
    finally:
        writer.wait(timeout=30)
    assert got["rc"] == 0
    argv = [str(tenant.native.bin / "fkstat"), str(tenant.base / "gpu" / "state"), "0",
            str(got["t0"] + 300_000_000), str(got["t1"]), str(got["t1"] - got["t0"] - 300_000_000),
            str(a.pid)]  # fmt: skip
    share = float(
        subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()[0]
    )
    assert share < 0.45, share  # unlimited it would be ~1.0


def test_dlvsym_of_glibc_dlsym_reaches_libvgpu(tenant):
    a = tenant.cuctl(mode="dlsym")
    assert a("init")["ok"]
    got = [a(f"route dlvsym_dlsym {CHUNK}") for _ in range(4)]
    assert all(g["ours"] for g in got)
    assert [g["ok"] for g in got] == [True, True, True, False]
    assert a("phys")["phys"] <= LIMIT


def test_graph_memory_nodes_cannot_hold_more_than_the_limit(tenant):
    a = tenant.cuctl()
    assert a("init")["ok"]
    got = [a(f"graphmem {600 * MiB}") for _ in range(8)]
    assert sum(g["ok"] for g in got) == 1
    assert a("phys")["phys"] == 600 * MiB
    assert a("info")["free"] == LIMIT - 600 * MiB


def test_loader_copy_without_the_preload_file_bypasses_libvgpu(tenant):
    """NOT blockable in-process: a copy of ld.so whose "/etc/ld.so.preload" string is changed
    never loads libvgpu, and allocates past the limit. The node agent's watchdog sees the
    process's memory in NVML and kills it (or reports it) within its grace period."""
    ldso = Path(os.path.realpath("/lib64/ld-linux-x86-64.so.2"))
    if not ldso.exists():
        pytest.skip("no x86-64 dynamic loader at the usual path")
    copy = tenant.base / "gpu" / "ld-copy.so"
    patch = tenant.python(
        f"data = open('{ldso}', 'rb').read()\n"
        "assert b'/etc/ld.so.preload' in data\n"
        f"open('{copy}', 'wb').write(data.replace(b'/etc/ld.so.preload', b'/etc/ld.so.prelXad'))\n"
        f"import os; os.chmod('{copy}', 0o755)\n"
    )
    assert patch.returncode == 0, patch.stderr
    c = tenant.cuctl(prefix=(*tenant.prefix, str(copy)))
    assert c("init")["ok"]
    assert "libvgpu.so" not in Path(f"/proc/{c.pid}/maps").read_text()
    assert [c(f"alloc plain {3 * CHUNK}")["ok"] for _ in range(2)] == [True, True]
    assert c("phys")["phys"] == 6 * CHUNK > LIMIT  # beyond the limit: only the watchdog sees it
    assert tenant.used() == 0  # nothing in the region: "region claims less than NVML shows"
