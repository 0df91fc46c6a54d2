"""Issue 19: a hostile tenant, as it would be in a container. Every program here runs as an
unprivileged user (uid/gid 65534) in its own mount namespace where /etc/ld.so.preload (mode 0444,
root's) names libvgpu, with the limits sealed by "the node agent" (root, 0444) and the region
prepared by it (0666, like the agent's). The tenant has no LD_PRELOAD of its own to drop.

It tries: zeroing, truncating and overfilling the region, a huge compute budget, glibc's own
dlsym through dlvsym, graph memory nodes, and a copy of the dynamic loader that ignores the
preload file. Everything but the last is blocked in-process; the last is shown to bypass
libvgpu (no LD_PRELOAD limiter can stop it): the node agent's watchdog is what catches it
(services/node-agent, tests/node_agent: kill or observe within its grace period)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tessera import region

from .conftest import LIBVGPU_DIR, Cuctl, MiB, base_env, wait_for

LIMIT = 1000 * MiB
CHUNK = 300 * MiB
UID = 65534
GPU0 = "GPU-fa4e0000-0000-0000-0000-000000000000"  # the fake driver's device 0


def _unprivileged_possible() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create the unprivileged tenant and its mount namespace"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a mount namespace here: {probe.stderr.strip()}"
    return None


@dataclass
class Tenant:
    base: Path
    lib: Path
    native: object
    n: int = 0

    @property
    def region_path(self) -> Path:
        return self.base / "region" / "usage"

    @property
    def prefix(self) -> tuple[str, ...]:
        """Run argv as the tenant: own mount namespace, /etc with the preload file, uid 65534."""
        script = 'mount --bind "$0" /etc && exec setpriv --reuid=65534 --regid=65534 '
        script += '--clear-groups --no-new-privs "$@"'
        return ("unshare", "-m", "--propagation", "private", "sh", "-c", script,
                str(self.base / "etc"))  # fmt: skip

    def env(self, mode: str = "direct", **extra: str) -> dict[str, str]:
        env = base_env()
        env.update(
            LD_LIBRARY_PATH=str(self.native.fake),
            FAKE_CUDA_STATE=str(self.base / "gpu" / "state"),
            TV_TEST_MODE=mode,
            LIBCUDA_LOG_LEVEL="1",
            # what a tenant would try: none of it may count
            CUDA_DEVICE_MEMORY_LIMIT="100g",
            TESSERA_LIMITS_DIR=str(self.base / "mine"),
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.base / "gpu" / "my-region"),
        )
        if self.native.san:
            env["ASAN_OPTIONS"] = "detect_leaks=0"
        env.update(extra)
        return env

    def cuctl(self, mode: str = "direct", exe: Path | None = None, prefix=None) -> Cuctl:
        self.n += 1
        return Cuctl(
            exe or self.native.bin / "cuctl",
            self.env(mode),
            self.base / "logs" / f"cuctl-{self.n}.stderr",
            self.prefix if prefix is None else prefix,
        )

    def python(self, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run Python code as the tenant (the region is the tenant's to write)."""
        return subprocess.run(
            [*self.prefix, sys.executable, "-c", code],
            env=self.env(), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def used(self) -> int:
        u = region.read_region(self.region_path)
        dev = u.device(GPU0) if u else None
        return dev.used_bytes if dev else 0

    def seal(self, sm: int = 0) -> None:
        region.prepare_region_file(self.region_path)
        region.seal_limits(
            self.base / "sealed",
            region.ContainerLimits(
                devices=(region.DeviceLimit(GPU0, LIMIT, sm),),
                core_policy="force",
                region_path=str(self.region_path),
            ),
        )


@pytest.fixture(scope="module")
def tenant_build(native):
    reason = _unprivileged_possible()
    if reason:
        pytest.skip(f"tenant suite: {reason}")
    base = Path(tempfile.mkdtemp(prefix="tessera-tenant-", dir="/tmp"))
    base.chmod(0o755)
    build = base / "build"
    # a libvgpu whose sealed directory is this suite's (the real one is /run/tessera/limits)
    out = subprocess.run(
        ["make", "-s", "-j2", "-C", str(LIBVGPU_DIR), f"BUILD={build}", f"SAN={native.san}",
         f"PYTHON={sys.executable}", f'CFLAGS=-O2 -DTSR_SEALED_LIMITS_DIR=\\"{base}/sealed\\"'],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    etc = base / "etc"
    subprocess.run(["cp", "-a", "/etc", str(etc)], check=True)
    preload = native.preload.replace(str(native.lib), str(build / "libvgpu.so"))
    (etc / "ld.so.preload").write_text(preload.replace(" ", "\n") + "\n")
    (etc / "ld.so.preload").chmod(0o444)
    yield base, build / "libvgpu.so"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def tenant(tenant_build, native):
    base, lib = tenant_build
    for d in ("sealed", "region", "gpu", "logs", "mine"):
        shutil.rmtree(base / d, ignore_errors=True)
        (base / d).mkdir()
    (base / "gpu").chmod(0o1777)  # the fake GPU's shared state: any process of the machine
    (base / "logs").chmod(0o777)
    t = Tenant(base, lib, native)
    t.seal()
    procs: list[Cuctl] = []
    real_cuctl = t.cuctl

    def tracked(*a, **kw):
        c = real_cuctl(*a, **kw)
        procs.append(c)
        return c

    t.cuctl = tracked
    yield t
    for c in procs:
        if c.p.poll() is None:
            c.p.kill()
            c.p.wait()
        c.close(check=False)


def dev_off(field: str, d: int = 0) -> int:
    return (region.RegionC.dev.offset + d * ctypes.sizeof(region.RegionDeviceC)
            + getattr(region.RegionDeviceC, field).offset)  # fmt: skip


def slot_off(i: int, field: str) -> int:
    return (region.RegionC.procs.offset + i * ctypes.sizeof(region.ProcSlotC)
            + getattr(region.ProcSlotC, field).offset)  # fmt: skip


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


def test_truncated_region_gives_no_fresh_budget(tenant):
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    cut = tenant.python(f"open('{tenant.region_path}', 'r+b').truncate(0)")
    assert cut.returncode == 0, cut.stderr
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert not b(f"alloc plain {CHUNK}")["ok"]  # refused until the region is repaired
    refused, _ = wait_for(lambda: not a(f"alloc plain {10 * MiB}")["ok"], timeout=3)
    assert refused, a.stderr()
    # the tenant writes a fresh, valid header: the live processes put their charges back
    fresh = tenant.base / "gpu" / "fresh"
    region.prepare_region_file(fresh)
    rewrite = tenant.python(
        f"data = open('{fresh}', 'rb').read()\n"
        f"f = open('{tenant.region_path}', 'r+b'); f.write(data)\n"
    )
    assert rewrite.returncode == 0, rewrite.stderr
    back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK, timeout=5)
    assert back, tenant.used()
    ok, _ = wait_for(lambda: b(f"alloc plain {50 * MiB}")["ok"], timeout=5, step=0.05)
    assert ok
    assert not b(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT
    assert "bad header" in b.stderr() or "unusable" in b.stderr()


class HeldStderr:
    """A process's stderr as a one-page pipe the test can keep full: the process's next log line
    then blocks inside the very call that writes it, until the test drains the pipe. This holds
    a thread of libvgpu at a chosen point, so an interleaving with the poll thread is exact."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, 4096)
        self.size = fcntl.fcntl(self.w, fcntl.F_GETPIPE_SZ)
        os.set_blocking(self.r, False)
        self.text = b""
        self._drainer: threading.Thread | None = None

    @property
    def path(self) -> Path:  # a new open of the pipe's write end: blocking, whatever ours is
        return Path(f"/proc/{os.getpid()}/fd/{self.w}")

    def fill(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.r, 65536):
                self.text += chunk
        os.write(self.w, b"\n" * self.size)  # an empty pipe of this size takes it whole

    def seen(self, text: str) -> bool:
        """Has the process written `text` yet? (reads what is there, never waits)"""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.r, 65536):
                self.text += chunk
        return text.encode() in self.text

    def drain(self) -> None:
        def run() -> None:
            os.set_blocking(self.r, True)
            while chunk := os.read(self.r, 65536):
                self.text += chunk

        self._drainer = threading.Thread(target=run, daemon=True)
        self._drainer.start()

    def close(self) -> None:
        os.close(self.w)
        if self._drainer:
            self._drainer.join(timeout=5)
        os.close(self.r)


def threads_waiting(pid: int, kernel_wait: str) -> int:
    """How many of pid's threads are blocked in the kernel function named (from their wchan)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            n += kernel_wait in Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
    return n


def test_a_slot_taken_while_the_region_was_bad_is_never_kept(tenant):
    """CI caught this once: a process resolved its device while the region was bad and got a
    private stand-in slot; its poll thread repaired the region before the resolver re-checked,
    so the stand-in was kept and every later charge was held to that process's own allocations:
    a fresh budget beside the container's. Here that interleaving is made exact: the poll
    thread is held re-attaching (on the region file's lock) while the allocating thread takes
    its stand-in slot, and the allocating thread is held (on its log line) while the poll
    thread finishes the repair."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    cut = tenant.python(f"open('{tenant.region_path}', 'r+b').truncate(0)")
    assert cut.returncode == 0, cut.stderr
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(), held.path, tenant.prefix)
    file_lock = tenant.region_path.open("rb")
    try:
        assert b("init")["ok"]
        assert not b(f"alloc plain {50 * MiB}")["ok"]  # bad: refused
        fcntl.flock(file_lock, fcntl.LOCK_EX)
        fresh = tenant.base / "gpu" / "fresh"
        region.prepare_region_file(fresh)
        rewrite = tenant.python(
            f"data = open('{fresh}', 'rb').read()\n"
            f"f = open('{tenant.region_path}', 'r+b'); f.write(data)\n"
        )
        assert rewrite.returncode == 0, rewrite.stderr
        attaching, _ = wait_for(lambda: threads_waiting(b.pid, "lock_inode_wait") == 1, 10)
        assert attaching, "b's poll thread never tried to re-attach"
        held.fill()
        b.send(f"alloc plain {50 * MiB}")  # resolves its device: the region is still bad
        resolving, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert resolving, "the allocating thread never logged its stand-in slot"
        fcntl.flock(file_lock, fcntl.LOCK_UN)
        repaired, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 2, 10)
        assert repaired, "b's poll thread never logged the repair"
        held.drain()
        if not b.recv()["ok"]:  # begun while bad: refusing it is fine, a private charge is not
            ok, _ = wait_for(lambda: b(f"alloc plain {50 * MiB}")["ok"], timeout=5, step=0.05)
            assert ok
        back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK + 50 * MiB, timeout=5)
        assert back, f"b's charge is not in the container's region: {tenant.used()}"
        assert not b(f"alloc plain {CHUNK}")["ok"]  # 950 + 300 > 1000 MiB: the container's
        assert a("phys")["phys"] <= LIMIT
    finally:
        file_lock.close()
        if b.p.poll() is None:
            b.p.kill()
            b.p.wait()
        b.close(check=False)
        held.close()


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


class HeldLimitsFile:
    """The sealed limits file swapped for a FIFO with nobody writing: every poll thread of the
    container blocks opening it (a limits file served late) and does nothing else meanwhile: no
    repair, no sweep of dead slots, no re-attach. `release` puts the file back and lets them go
    (their read of the FIFO fails; the next poll reads the real file again, unchanged)."""

    def __init__(self, sealed: Path) -> None:
        self.limits = sealed / region.LIMITS_FILE_NAME
        self.saved = sealed / "limits.saved"
        self.fifo = sealed / "limits.fifo"
        os.link(self.limits, self.saved)
        os.mkfifo(self.fifo)
        os.link(self.fifo, sealed / "limits.fifo-new")
        os.rename(sealed / "limits.fifo-new", self.limits)

    def release(self) -> None:
        os.rename(self.saved, self.limits)
        with contextlib.suppress(OSError):  # no reader left: nothing to release
            os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
        self.fifo.unlink(missing_ok=True)


def dead_slot(tenant, i: int) -> None:
    """Process slot i "held" by a dead process that holds nothing: the test's own pid with a
    start time it never had (a reused pid), the first thing a reclaim finds and logs."""
    with open(tenant.region_path, "r+b") as f:
        f.seek(slot_off(i, "start_time"))
        f.write((1).to_bytes(8, "little"))
        f.seek(slot_off(i, "pid"))
        f.write(os.getpid().to_bytes(4, "little"))


def test_a_charge_never_fits_against_a_region_truncated_under_it(tenant):
    """A charge that does not fit looks for dead processes' slots, under the region's lock, and
    reads the device's usage again. If the file is truncated in between, that read faults onto
    the zero page libvgpu maps in its place: it used to read 0 and charge, past the container's
    limit. Made exact: every poll thread held (the limits file served late), the charging thread
    held on its "reclaiming" log line (a full stderr pipe) while the tenant truncates."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(LIBCUDA_LOG_LEVEL="2"), held.path,
              tenant.prefix)  # fmt: skip
    limits = None
    try:
        assert b("init")["ok"]
        assert b(f"alloc plain {50 * MiB}")["ok"]  # 950 of 1000 MiB in the container
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        dead_slot(tenant, region.MAX_PROCS - 1)
        held.fill()
        b.send(f"alloc plain {CHUNK}")  # 950 + 300 > 1000: looks for dead slots, logs one
        reclaiming, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert reclaiming, "the charging thread never logged the dead slot"
        cut = tenant.python(f"open('{tenant.region_path}', 'r+b').truncate(0)")
        assert cut.returncode == 0, cut.stderr
        held.drain()
        assert not b.recv()["ok"], "charged against a truncated region"
        limits.release()
        limits = None
        fresh = tenant.base / "gpu" / "fresh"
        region.prepare_region_file(fresh)
        rewrite = tenant.python(
            f"data = open('{fresh}', 'rb').read()\n"
            f"f = open('{tenant.region_path}', 'r+b'); f.write(data)\n"
        )
        assert rewrite.returncode == 0, rewrite.stderr
        back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK + 50 * MiB, timeout=5)
        assert back, f"the container's usage after the repair: {tenant.used()}"
        assert a("phys")["phys"] <= LIMIT
    finally:
        if limits:
            limits.release()
        if b.p.poll() is None:
            b.p.kill()
            b.p.wait()
        b.close(check=False)
        held.close()


def test_a_process_whose_main_thread_ended_keeps_its_charges(tenant):
    """A program may end its main thread (pthread_exit) and go on in others: /proc then shows
    its thread group leader as a zombie (state Z, PF_EXITING) although the process lives and
    holds its memory. Another process's charge that did not fit took it for dead, reclaimed its
    slot, and fitted in the memory the live process still holds: the container past its limit.
    No timing involved: the charge looks for dead slots itself, at once."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    assert a("mainexit")["ok"]
    zombie, _ = wait_for(
        lambda: Path(f"/proc/{a.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 10
    )
    assert zombie, "the main thread did not end"
    assert a(f"alloc plain {CHUNK}")["ok"]  # alive, and served by its other thread
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {CHUNK}")["ok"]  # 900 of 1000 MiB
    assert not b(f"alloc plain {CHUNK}")["ok"]  # 1200 > 1000, however a's leader looks
    assert tenant.used() == 3 * CHUNK
    assert a("phys")["phys"] <= LIMIT


def test_a_live_process_reclaimed_puts_its_charges_back(tenant):
    """A live process's slot freed by a sibling's sweep (here its start time rewritten, so its
    pid looks reused) is taken back by the process; its charges used to come back into its slot
    only, not into the device's total while that total was still above the process's own share:
    the container's total then missed them for good."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {2 * CHUNK}")["ok"]
    slots = [s for s in region.read_region(tenant.region_path).processes if s.pid == a.pid]
    assert len(slots) == 1
    i, real_start = slots[0].slot, slots[0].start_time
    with open(tenant.region_path, "r+b") as f:
        f.seek(slot_off(i, "start_time"))
        f.write((1).to_bytes(8, "little"))
        f.flush()

        def swept_and_taken_back() -> bool:
            # the once-a-second sweep is due now (a's own sweeps pass a by; b's must come)
            f.seek(region.RegionC.reclaim_ns.offset)
            f.write(bytes(8))
            f.seek(slot_off(i, "start_time"))
            f.flush()
            return int.from_bytes(os.pread(f.fileno(), 8, f.tell()), "little") == real_start

        taken_back, _ = wait_for(swept_and_taken_back, timeout=10)
    assert taken_back, "b never swept a's slot, or a never took it back"
    back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK, timeout=5)
    assert back, f"the container's total misses a's charges: {tenant.used()}"
    assert not b(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT


def start_time_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_a_region_truncated_while_it_is_reattached_stays_refused(tenant):
    """The poll thread re-attaches a repaired region: maps it, takes a slot, writes this
    process's charges back, then lets charges resume. A truncation in between faulted onto the
    zero page libvgpu maps in the file's place, and charges then resumed against that page: a
    budget of the whole limit while the file was truncated. Made exact: every process slot of
    the repaired file held by a live process, so the re-attach logs "region full" and is held
    there (a full stderr pipe) while the tenant truncates; then every poll thread is held (the
    limits file served late) while the process asks for memory."""
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(), held.path, tenant.prefix)
    holder = subprocess.Popen([*tenant.prefix, "sleep", "60"], env=tenant.env())
    limits = None
    try:
        assert b("init")["ok"]
        assert b(f"alloc plain {50 * MiB}")["ok"]
        cut = tenant.python(f"open('{tenant.region_path}', 'r+b').truncate(0)")
        assert cut.returncode == 0, cut.stderr
        bad, _ = wait_for(lambda: held.seen("was truncated"), 10)
        assert bad, "b never noticed the truncation"
        full = tenant.base / "gpu" / "full"
        region.prepare_region_file(full)
        with open(full, "r+b") as f:
            for i in range(region.MAX_PROCS):  # every slot: a live process holding nothing
                f.seek(slot_off(i, "pid"))
                f.write(holder.pid.to_bytes(4, "little"))
                f.seek(slot_off(i, "start_time"))
                f.write(start_time_of(holder.pid).to_bytes(8, "little"))
        held.fill()
        rewrite = tenant.python(
            f"data = open('{full}', 'rb').read()\n"
            f"f = open('{tenant.region_path}', 'r+b'); f.write(data)\n"
        )
        assert rewrite.returncode == 0, rewrite.stderr
        full_log, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert full_log, "b's poll thread never logged the full region"
        cut = tenant.python(f"open('{tenant.region_path}', 'r+b').truncate(0)")
        assert cut.returncode == 0, cut.stderr
        limits = HeldLimitsFile(tenant.base / "sealed")
        held.drain()
        polls, _ = wait_for(lambda: threads_waiting(b.pid, "wait_for_partner") == 1, 10)
        assert polls, "b's poll thread never reached the limits file"
        assert not b(f"alloc plain {CHUNK}")["ok"], "charged while the region is truncated"
        limits.release()
        limits = None
        fresh = tenant.base / "gpu" / "fresh"
        region.prepare_region_file(fresh)
        rewrite = tenant.python(
            f"data = open('{fresh}', 'rb').read()\n"
            f"f = open('{tenant.region_path}', 'r+b'); f.write(data)\n"
        )
        assert rewrite.returncode == 0, rewrite.stderr
        ok, _ = wait_for(lambda: b(f"alloc plain {CHUNK}")["ok"], timeout=5, step=0.05)
        assert ok, "charges never resumed after the repair"
        assert tenant.used() == 50 * MiB + CHUNK
    finally:
        holder.kill()
        holder.wait()
        if limits:
            limits.release()
        if b.p.poll() is None:
            b.p.kill()
            b.p.wait()
        b.close(check=False)
        held.close()


def test_a_process_exiting_while_its_poll_thread_repairs_does_not_crash(tenant):
    """The poll thread saw this process's slot tampered with and went to repair it; meanwhile the
    process began to exit and gave its slot up (libvgpu's exit handler). The repair then took
    the slot that was no more (NULL): a crash at exit (SIGSEGV) while the program's own work at
    exit (a runtime's teardown) ran. Made exact: the poll thread held on its "restored" log line
    (a full stderr pipe) until the slot is given up, the program held in its exit handler."""
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(), held.path, tenant.prefix)
    try:
        assert b("exitwait")["ok"]
        assert b("init")["ok"]
        assert b(f"alloc plain {50 * MiB}")["ok"]
        slots = [s for s in region.read_region(tenant.region_path).processes if s.pid == b.pid]
        assert len(slots) == 1
        held.fill()
        with open(tenant.region_path, "r+b") as f:  # the tenant zeroes b's own count
            f.seek(slot_off(slots[0].slot, "used"))
            f.write(bytes(8))
        repairing, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert repairing, "b's poll thread never logged the tampered slot"
        b.send("exit")
        assert b.recv()["exiting"]  # libvgpu's exit handler has given the slot up
        held.drain()
        done, _ = wait_for(
            lambda: b.p.poll() is not None or threads_waiting(b.pid, "nanosleep") == 1, 10
        )
        assert done, "b's poll thread never went back to sleep"
        if b.p.poll() is None:
            b.send("go")
        rc = b.p.wait(timeout=10)
        assert rc == 0, f"b died at exit: {rc}"
        assert all(s.pid != b.pid for s in region.read_region(tenant.region_path).processes)
    finally:
        if b.p.poll() is None:
            b.p.kill()
            b.p.wait()
        b.close(check=False)
        held.close()
