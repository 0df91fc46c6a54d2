"""The hostile tenant's rig (tests/native/test_tenant.py, test_tenant_races.py): programs run as
an unprivileged user (uid/gid 65534) in their own mount namespace where /etc/ld.so.preload (mode
0444, root's) names libvgpu, with the limits sealed by "the node agent" (root, 0444) and the
region prepared by it (0666, like the agent's). Also the hold points the race tests use to make
an interleaving exact: a full stderr pipe (a thread held inside its log line), the sealed
limits file served late (every poll thread held), and threads' kernel wait channels (where a
held thread is)."""

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tessera import region

from .conftest import LIBVGPU_DIR, Cuctl, MiB, base_env

LIMIT = 1000 * MiB
CHUNK = 300 * MiB
UID = 65534
GPU0 = "GPU-fa4e0000-0000-0000-0000-000000000000"  # the fake driver's device 0


def unprivileged_unavailable() -> str | None:
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

    def truncate_region(self) -> None:
        """What a tenant may do to the region file: cut it to nothing under every mapping."""
        cut = self.python(f"open('{self.region_path}', 'r+b').truncate(0)")
        assert cut.returncode == 0, cut.stderr

    def write_fresh_region(self) -> None:
        """The tenant writes a fresh, valid, empty region over the file (in place, same inode)."""
        fresh = self.base / "gpu" / "fresh"
        region.prepare_region_file(fresh)
        rewrite = self.python(
            f"data = open('{fresh}', 'rb').read()\n"
            f"f = open('{self.region_path}', 'r+b'); f.write(data)\n"
        )
        assert rewrite.returncode == 0, rewrite.stderr

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


def tenant_build_dir(native) -> Iterator[tuple[Path, Path]]:
    """A libvgpu whose sealed directory is the suite's, and an /etc whose ld.so.preload names it
    (the tenant_build fixture, conftest.py)."""
    reason = unprivileged_unavailable()
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


def tenant_in(tenant_build: tuple[Path, Path], native) -> Iterator[Tenant]:
    """A fresh container of the tenant: sealed limits, a prepared region, its processes killed
    after the test (the tenant fixture, conftest.py)."""
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
        c.kill()


def dev_off(field: str, d: int = 0) -> int:
    return (region.RegionC.dev.offset + d * ctypes.sizeof(region.RegionDeviceC)
            + getattr(region.RegionDeviceC, field).offset)  # fmt: skip


def slot_off(i: int, field: str) -> int:
    return (region.RegionC.procs.offset + i * ctypes.sizeof(region.ProcSlotC)
            + getattr(region.ProcSlotC, field).offset)  # fmt: skip


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


def start_time_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
