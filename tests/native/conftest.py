"""Harness for libvgpu: builds the library, the fake driver and the test programs, and runs
programs "in a container" (LD_PRELOAD, a region, a limits directory, a shared fake GPU).

LIBVGPU_TEST_SAN=address runs everything against AddressSanitizer builds (own build dirs).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tessera import region

ROOT = Path(__file__).resolve().parents[2]
LIBVGPU_DIR = ROOT / "native" / "libvgpu"
TESTS_DIR = Path(__file__).resolve().parent
SAN = os.environ.get("LIBVGPU_TEST_SAN", "")
MiB = 1 << 20

# env vars a test must never inherit from the developer's shell
_SCRUB_PREFIXES = ("CUDA_", "TESSERA_", "FAKE_", "GPU_CORE_", "LIBCUDA_", "LD_PRELOAD", "TV_TEST")


def pytest_configure(config):
    config.addinivalue_line("markers", "timing: measures real-time compute shares (not under ASan)")


def pytest_collection_modifyitems(config, items):
    # A real-time share is measured with no other test running beside it (tests/conftest.py).
    for item in items:
        if item.get_closest_marker("timing"):
            item.add_marker(pytest.mark.serial)


@dataclass(frozen=True)
class NativeBuild:
    lib: Path  # libvgpu.so
    bin: Path  # cuctl, stress, fkstat, ...
    fake: Path  # libcuda.so.1, libnvidia-ml.so.1
    san: str

    @property
    def preload(self) -> str:
        if not self.san:
            return str(self.lib)
        asan = subprocess.run(
            ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
        return f"{asan} {self.lib}"


@contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """One make at a time in a build directory: the suite's workers (pytest-xdist) share it."""
    build.mkdir(parents=True, exist_ok=True)
    with (build / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _make(*args: str) -> None:
    out = subprocess.run(["make", "-s", "-j4", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"make {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")


def build_native(san: str = SAN) -> NativeBuild:
    build = LIBVGPU_DIR / ("build-asan" if san else "build")
    py = f"PYTHON={sys.executable}"
    with build_lock(build):
        _make("-C", str(LIBVGPU_DIR), f"BUILD={build}", f"SAN={san}", py)
        _make("-C", str(TESTS_DIR), f"BUILD={build / 'tests'}", f"SAN={san}", py)
    return NativeBuild(build / "libvgpu.so", build / "tests", build / "tests" / "fake", san)


@pytest.fixture(scope="session")
def native() -> NativeBuild:
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("no C toolchain")
    return build_native()


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES)}


class Cuctl:
    """A running tests/native/progs/cuctl: send a line, get its JSON answer."""

    def __init__(
        self, exe: Path, env: dict[str, str], stderr_path: Path, prefix: tuple[str, ...] = ()
    ):
        self._stderr = stderr_path.open("w")
        self.stderr_path = stderr_path
        self.p = subprocess.Popen(
            [*prefix, str(exe)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.p.stdout, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        return self.p.pid

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float = 20.0) -> dict:
        if not self._sel.select(timeout):
            raise TimeoutError(f"cuctl gave no answer in {timeout}s; stderr:\n{self.stderr()}")
        out = self.p.stdout.readline()
        if not out:
            raise RuntimeError(f"cuctl exited ({self.p.poll()}); stderr:\n{self.stderr()}")
        return json.loads(out)

    def __call__(self, line: str, timeout: float = 20.0) -> dict:
        self.send(line)
        return self.recv(timeout)

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        """Stop it at once (it may be held mid-call by a test), keeping nothing to check."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.close(check=False)

    def close(self, check: bool = True) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("exit\n")
                self.p.stdin.close()
            except BrokenPipeError:
                pass
            self.p.wait(timeout=30)
        self._stderr.close()
        if check and self.p.returncode not in (0, -9):
            raise AssertionError(f"cuctl exited {self.p.returncode}:\n{self.stderr()}")


@dataclass
class Container:
    """One container: its region, its limits directory, the processes it runs."""

    native: NativeBuild
    dir: Path
    gpu_state: Path
    name: str = "c"
    procs: list[Cuctl] = field(default_factory=list)
    cpu: CpuStarvation | None = None

    @property
    def region_path(self) -> Path:
        return self.dir / "region"

    @property
    def limits_dir(self) -> Path:
        return self.dir / "limits"

    def seal(self, *devices: region.DeviceLimit, **kw) -> region.ContainerLimits:
        kw.setdefault("core_policy", "force")
        lim = region.ContainerLimits(devices=devices, region_path=str(self.region_path), **kw)
        region.prepare_region_file(self.region_path)  # as the node agent does
        return region.seal_limits(self.limits_dir, lim)

    def env(self, mode: str = "direct", preload: bool = True, **extra: str) -> dict[str, str]:
        env = base_env()
        env.update(
            LD_LIBRARY_PATH=str(self.native.fake),
            FAKE_CUDA_STATE=str(self.gpu_state),
            TV_TEST_MODE=mode,
            LIBCUDA_LOG_LEVEL="1",
        )
        if preload:
            env["LD_PRELOAD"] = self.native.preload
            if (self.limits_dir / region.LIMITS_FILE_NAME).exists():
                env[region.ENV_LIMITS_DIR] = str(self.limits_dir)
            else:
                env[region.ENV_REGION_PATH] = str(self.region_path)
        if self.native.san:
            env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0:exitcode=66"
        env.update(extra)
        return env

    def cuctl(self, mode: str = "direct", preload: bool = True, **extra: str) -> Cuctl:
        n = len(self.procs)
        c = Cuctl(
            self.native.bin / "cuctl",
            self.env(mode, preload, **extra),
            self.dir / f"cuctl-{n}.stderr",
        )
        self.procs.append(c)
        if self.cpu is not None:
            self.cpu.watch(c.pid)
        return c

    def run(self, argv: list[str], timeout: float = 60, **extra: str):
        return subprocess.run(
            argv, env=self.env(**extra), capture_output=True, text=True, timeout=timeout
        )

    def usage(self) -> region.RegionUsage:
        u = region.read_region(self.region_path)
        assert u is not None, "region not initialised"
        return u

    def used(self, dev: int = 0) -> int:
        devices = self.usage().devices
        return devices[dev].used_bytes if dev < len(devices) else 0


def run_queue_wait_ns(pid: int) -> int | None:
    """How long `pid`'s main thread has waited for a CPU while runnable (the kernel's run-queue
    delay, /proc/<pid>/schedstat's second field); None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def thread_waits_ns(pid: int) -> dict[str, int]:
    """Run-queue wait so far of each thread of `pid` (by thread id)."""
    waits = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            waits[task.name] = int((task / "schedstat").read_text().split()[1])
    return waits


class HostDelay:
    """How late a loaded host could make a time-bound promise between `start()` and `seconds()`:
    the longest run-queue wait of any thread of the watched process (its poll thread, say) plus
    this test thread's own. A promise "within T" is then judged as "within T + that", never
    excusing more than the host really took."""

    def __init__(self, pid: int):
        self.pid = pid
        self._threads: dict[str, int] = {}
        self._own = 0

    @staticmethod
    def _own_wait() -> int:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1])

    def start(self) -> HostDelay:
        self._threads, self._own = thread_waits_ns(self.pid), self._own_wait()
        return self

    def seconds(self) -> float:
        now = thread_waits_ns(self.pid)
        worst = max((w - self._threads.get(t, 0) for t, w in now.items()), default=0)
        return (max(0, worst) + self._own_wait() - self._own) / 1e9


class CpuStarvation:
    """Samples the run-queue wait of the launching processes (every `period` s, CLOCK_MONOTONIC
    like cuctl's t0/t1), so a real-time share can be judged against what the launcher could
    do: a window in which it waited W ns for a CPU could not feed the GPU for up to W ns (its
    queue runs dry), which a loaded host causes and the limiter cannot help. It never excuses
    more than that, and never excuses going over the limit."""

    def __init__(self, period: float = 0.01):
        self.period = period
        self.samples: dict[int, list[tuple[int, int]]] = {}  # pid -> [(t_ns, wait_ns)]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pid: int) -> None:
        with self._lock:
            self.samples.setdefault(pid, [])
        self._sample_one(pid)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cpu-starvation", daemon=True)
            self._thread.start()

    def _sample_one(self, pid: int) -> None:
        t, wait = time.monotonic_ns(), run_queue_wait_ns(pid)
        if wait is not None:
            with self._lock:
                self.samples[pid].append((t, wait))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for pid in list(self.samples):
                self._sample_one(pid)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def wait_ns(self, pid: int, t0: int, t1: int) -> int:
        """Run-queue wait of `pid` over [t0, t1), rounded outwards to the samples around it
        (an over-estimate: it only ever widens what is excused)."""
        self._sample_one(pid)
        with self._lock:
            samples = list(self.samples.get(pid, ()))
        before = [w for t, w in samples if t <= t0]
        after = [w for t, w in samples if t >= t1]
        start = before[-1] if before else (samples[0][1] if samples else 0)
        end = after[0] if after else (samples[-1][1] if samples else 0)
        return max(0, end - start)

    def fractions(self, pids: list[int], t0: int, t1: int, window: int) -> list[float]:
        """Per window of [t0, t1) (fkstat's windows), the largest fraction of it any of `pids`
        spent waiting for a CPU, in percentage points of the window."""
        return [
            100.0 * max((self.wait_ns(p, a, a + window) for p in pids), default=0) / window
            for a in range(t0, t1 - window + 1, window)
        ]  # fmt: skip


class Cluster:
    """Containers sharing one fake machine (the same FAKE_CUDA_STATE)."""

    def __init__(self, native: NativeBuild, tmp: Path):
        self.native = native
        self.tmp = tmp
        self.gpu_state = tmp / "gpu-state"
        self.containers: list[Container] = []
        self.cpu = CpuStarvation()  # every cuctl of the cluster's containers is watched

    def container(self, name: str | None = None) -> Container:
        name = name or f"c{len(self.containers)}"
        d = self.tmp / name
        d.mkdir()
        c = Container(self.native, d, self.gpu_state, name, cpu=self.cpu)
        self.containers.append(c)
        return c

    def busy(self, dev: int, t0: int, t1: int, window: int, pids: list[int] | None = None):
        argv = [str(self.native.bin / "fkstat"), str(self.gpu_state), str(dev), str(t0), str(t1)]
        argv += [str(window), *(str(p) for p in pids or [])]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        return [float(x) * 100 for x in out.split()]

    def starved(self, pids: list[int], t0: int, t1: int, window: int) -> list[float]:
        """Per window (as busy()'s), percentage points of it a launcher of `pids` waited for a
        CPU (CpuStarvation)."""
        return self.cpu.fractions(pids, t0, t1, window)

    def close(self) -> None:
        self.cpu.stop()
        for c in self.containers:
            for p in c.procs:
                p.kill()


@pytest.fixture
def cluster(native: NativeBuild, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(native, tmp_path)
    yield c
    c.close()


@pytest.fixture
def container(cluster: Cluster) -> Container:
    return cluster.container()


@pytest.fixture
def node(native: NativeBuild):
    """A node with one 16 GiB fake GPU, the node agent's real lease service and container layout
    (tests/native/elastic_rig.py): the elastic memory, spill and reclaim tests."""
    from .elastic_rig import running_node  # it imports this module

    with running_node(native) as n:
        yield n


def wait_for(pred, timeout: float = 2.0, step: float = 0.005):
    """Poll pred() until truthy; returns (value, seconds waited)."""
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return v, time.monotonic() - t0
        time.sleep(step)


@pytest.fixture(scope="session")
def tenant_build(native):
    """The hostile tenant's libvgpu and /etc (tenant_rig.py); skips where none can be made."""
    from .tenant_rig import tenant_build_dir

    yield from tenant_build_dir(native)


@pytest.fixture
def tenant(tenant_build, native):
    """A fresh container of the hostile tenant (tenant_rig.py)."""
    from .tenant_rig import tenant_in

    yield from tenant_in(tenant_build, native)
