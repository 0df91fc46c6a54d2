"""Issue 29: an account the tenant cannot forge. The node agent's real container layout —
`ContainerStore.prepare`, `handshake.limits_for` + `region.seal_limits`, the mounts of
`handshake.container_mounts` under /run/tessera — with the agent's lease service
(services/node-agent/leases.py) serving the container, and the tenant as uid 65534 in its own
mount namespace (/etc/ld.so.preload naming the default libvgpu build, whose sealed directory is
the real /run/tessera/limits). Each attack races long enough to lose: thousands of allocations
against a tenant that rewrites, truncates or replaces its region all the while. The fake GPU's
physical memory (all processes together) is checked after every successful allocation.

  1. rewriting every process's counters every ~50 µs while processes allocate;
  2. truncate-and-rewrite (a fresh, zero-use header) in a loop while new processes start;
  3. the container's root (no CAP_SYS_ADMIN) moving a zero-use copy over the region, then
     writing it in place;
and the lease service itself: no service → fail closed; an agent restart loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tessera.node_agent import handshake
from tessera.node_agent.containers import ContainerStore, PreparedContainer
from tessera.node_agent.leases import LeaseService

from tessera import region
from tessera.models import Allocation, DeviceGrant
from tessera.settings import TesseraSettings

from .conftest import Cuctl, MiB, base_env, wait_for
from .tenant_rig import GPU0, unprivileged_unavailable

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process

LIMIT_MIB = 512
LIMIT = LIMIT_MIB * MiB
POD = "5d1c9e2a-7b3f-4a6d-8e0c-1f2a3b4c5d6e"
CAPS_OF_CONTAINER_ROOT = "-all,+chown,+dac_override,+fowner,+kill,+setuid,+setgid"


class AgentLoop:
    """The node agent's lease service on its own event loop (a thread of this test)."""

    def __init__(self, store: ContainerStore) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = LeaseService(store.all)
        self.call(self.service.sync())

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def leased(self, name: str = GPU0) -> int:
        async def total() -> int:
            return sum(c.leased(name) for c in self.service.served.values())

        return self.call(total())

    def attested(self) -> dict[int, str]:
        async def get() -> dict[int, str]:
            return self.service.attested()

        return self.call(get())

    def stop(self) -> None:
        self.call(self.service.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class Pod:
    """One GPU container laid out as the node agent lays it out, and its tenant."""

    def __init__(self, base: Path, native) -> None:
        self.base, self.native = base, native
        self.store = ContainerStore(base / "regions")
        self.store.ensure_root()
        grant = DeviceGrant(uuid=GPU0, type="FAKE", memory_mib=LIMIT_MIB, cores=100)
        alloc = Allocation(pod_uid=POD, namespace="t", name="p", node="n",
                           containers=[[grant]], container_names=["main"])  # fmt: skip
        settings = TesseraSettings()
        self.alloc, self.settings = alloc, settings
        self.cdir = self.store.prepare(PreparedContainer(
            pod_uid=POD, namespace="t", pod="p", container="main", index=0,
            device_ids=[f"{GPU0}::0"], grants=alloc.containers[0],
        ))  # fmt: skip
        region.seal_limits(self.cdir.limits_dir, handshake.limits_for(alloc, 0, settings))
        self.mounts = handshake.container_mounts(self.cdir, settings, str(self.store.preload_file))
        self.agent: AgentLoop | None = AgentLoop(self.store)
        self.n = 0
        self.procs: list[Cuctl] = []

    def seal_spill(self, spill_bytes: int) -> None:
        """Seal the container's limits again with a spill bound (tessera.io/gpumem-spill), as
        PreStartContainer does for a pod that opted in."""
        region.seal_limits(self.cdir.limits_dir, handshake.limits_for(
            self.alloc, 0, self.settings, spill_bytes=spill_bytes))  # fmt: skip

    def restart_agent(self, down_s: float = 0.0) -> None:
        if self.agent:
            self.agent.stop()
        self.agent = None
        time.sleep(down_s)
        self.agent = AgentLoop(self.store)

    def prefix(self, root: bool = False) -> tuple[str, ...]:
        """Own mount namespace: a private /run holding the agent's mounts (parents first, as a
        runtime mounts them), /etc with the preload file; then uid 65534 (or root without
        CAP_SYS_ADMIN, as a container's root is)."""
        lines = ["set -e", "mount -t tmpfs -o mode=755 tmpfs /run"]
        ours = [m for m in self.mounts if m[0].startswith("/run/tessera/")]
        for cpath, hpath, ro in sorted(ours, key=lambda m: m[0].count("/")):
            if Path(hpath).is_dir():
                lines.append(f"mkdir -p '{cpath}'")
            else:
                lines.append(f"[ -e '{cpath}' ] || {{ mkdir -p '{Path(cpath).parent}'; "
                             f"touch '{cpath}'; }}")  # fmt: skip
            lines.append(f"mount --bind '{hpath}' '{cpath}'")
            if ro:
                lines.append(f"mount -o remount,bind,ro '{cpath}'")
        lines.append(f"mount --bind '{self.base / 'etc'}' /etc")
        who = "--reuid=0 --regid=0" if root else "--reuid=65534 --regid=65534"
        caps = f" --bounding-set={CAPS_OF_CONTAINER_ROOT} --inh-caps=-all" if root else ""
        lines.append(f'exec setpriv {who} --clear-groups --no-new-privs{caps} "$@"')
        return ("unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh")

    def env(self) -> dict[str, str]:
        env = base_env()
        env.update(LD_LIBRARY_PATH=str(self.native.fake),
                   FAKE_CUDA_STATE=str(fake_gpu_state(self.base)), LIBCUDA_LOG_LEVEL="1",
                   CUDA_DEVICE_MEMORY_LIMIT="100g")  # fmt: skip
        if self.native.san:
            env["ASAN_OPTIONS"] = "detect_leaks=0"
        return env

    def cuctl(self) -> Cuctl:
        self.n += 1
        c = Cuctl(self.native.bin / "cuctl", self.env(),
                  self.base / "logs" / f"cuctl-{self.n}.stderr", self.prefix())  # fmt: skip
        self.procs.append(c)
        return c

    def run(self, argv: list[str], root: bool = False, timeout: float = 120):
        return subprocess.run([*self.prefix(root), *argv], env=self.env(), capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    def spawn(self, argv: list[str], root: bool = False) -> subprocess.Popen:
        pipe = subprocess.PIPE
        return subprocess.Popen([*self.prefix(root), *argv], env=self.env(), stdout=pipe,
                                stderr=pipe, text=True)  # fmt: skip

    def stress(self, procs: int, threads: int, seconds: float) -> dict:
        out = self.run([str(self.native.bin / "stress"), str(procs), str(threads), str(seconds),
                        str(LIMIT)])  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    def physical(self) -> int:
        probe = Cuctl(self.native.bin / "cuctl", {**self.env(), "CUDA_DEVICE_MEMORY_LIMIT": ""},
                      self.base / "logs" / "probe.stderr")  # fmt: skip
        try:
            return probe("phys")["phys"]
        finally:
            probe.close(check=False)

    def close(self) -> None:
        for c in self.procs:
            c.kill()
        if self.agent:
            self.agent.stop()


def fake_gpu_state(base: Path) -> Path:
    """The fake GPU: one file for the module (the watchdog's NVML, loaded into this process,
    maps it once), emptied in place between tests."""
    return base / "fakegpu" / "state"


@pytest.fixture(scope="module")
def account_base(native) -> Iterator[Path]:
    reason = unprivileged_unavailable()
    if reason:
        pytest.skip(f"account suite: {reason}")
    base = Path(tempfile.mkdtemp(prefix="tessera-account-", dir="/tmp"))
    base.chmod(0o755)
    etc = base / "etc"
    subprocess.run(["cp", "-a", "/etc", str(etc)], check=True)
    (etc / "ld.so.preload").unlink(missing_ok=True)
    (etc / "ld.so.preload").write_text(native.preload.replace(" ", "\n") + "\n")
    (etc / "ld.so.preload").chmod(0o444)
    fake_gpu_state(base).parent.mkdir(mode=0o777)
    fake_gpu_state(base).parent.chmod(0o1777)
    with pytest.MonkeyPatch.context() as env:  # for the fake NVML in-process
        env.setenv("FAKE_CUDA_STATE", str(fake_gpu_state(base)))
        yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pod(account_base, native) -> Iterator[Pod]:
    for d in ("regions", "gpu", "logs"):
        shutil.rmtree(account_base / d, ignore_errors=True)
        (account_base / d).mkdir()
    (account_base / "gpu").chmod(0o1777)
    (account_base / "logs").chmod(0o777)
    state = fake_gpu_state(account_base)
    if state.exists():
        os.truncate(state, 0)  # a fresh GPU; the next process to open it initialises it
    p = Pod(account_base, native)
    assert p.physical() == 0  # ... this one
    state.chmod(0o666)  # the tenant's processes share it
    yield p
    p.close()


def _dev_off(field: str) -> int:
    return region.RegionC.dev.offset + getattr(region.RegionDeviceC, field).offset


def _used_off(slot: int) -> int:
    return (region.RegionC.procs.offset + slot * region.ctypes.sizeof(region.ProcSlotC)
            + region.ProcSlotC.used.offset)  # fmt: skip


REWRITER = """
import mmap, os, sys, time
f = open('/run/tessera/region/usage', 'r+b')
m = mmap.mmap(f.fileno(), 0)
dev, used, stride, end = {dev}, {used}, {stride}, time.monotonic() + {seconds}
zero, n = bytes(8), 0
while time.monotonic() < end:
    m[dev:dev + 8] = zero
    for i in range(32):
        o = used + i * stride
        m[o:o + 8] = zero
    n += 1
    time.sleep(0.00005)
print(n)
"""


def test_layout_is_the_agents_and_the_region_cannot_be_moved(pod):
    """The tenant sees the agent's mounts: the region writable, but neither renamable nor
    removable, and no file can be created beside it or beside the limits."""
    probe = pod.run([sys.executable, "-c", """
import errno, json, os, sys
out = {}
zero = sys.argv[1]  # the test's own file (nothing under a fixed name in /tmp)
open(zero, 'wb').close()
for name, op in [
    ('rename_over', lambda: os.replace(zero, '/run/tessera/region/usage')),
    ('unlink', lambda: os.unlink('/run/tessera/region/usage')),
    ('create_beside', lambda: open('/run/tessera/region/new', 'wb')),
    ('rename_away', lambda: os.rename('/run/tessera/region/usage', '/run/tessera/region/x')),
    ('replace_socket', lambda: os.unlink('/run/tessera/limits/lease.sock')),
    ('write_limits', lambda: open('/run/tessera/limits/limits', 'r+b')),
]:
    try:
        op(); out[name] = 'done'
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
out['region_writable'] = os.access('/run/tessera/region/usage', os.W_OK)
out['uid'] = os.getuid()
print(json.dumps(out))
""", str(pod.base / "gpu" / "zero")])
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert got["uid"] == 65534 and got["region_writable"]
    assert all(got[k] in ("EBUSY", "EROFS", "EACCES", "EPERM", "EXDEV") for k in got
               if k not in ("uid", "region_writable")), got  # fmt: skip
    c = pod.cuctl()
    assert c("init")["ok"]
    assert c("info")["total"] == LIMIT
    assert [c(f"alloc plain {200 * MiB}")["ok"] for _ in range(3)] == [True, True, False]
    assert pod.agent.attested() == {c.pid: POD}  # its connection: its attestation
    assert pod.agent.leased() <= LIMIT


def test_attack1_rewriting_counters_every_50us_gives_nothing(pod):
    """Two processes (two threads each) allocate and free 1..100 MiB as fast as they can while
    the tenant zeroes the device total and every process's counter every ~50 µs."""
    rewriter = pod.spawn([sys.executable, "-c", REWRITER.format(
        dev=_dev_off("used_bytes"), used=_used_off(0), stride=region.ctypes.sizeof(
            region.ProcSlotC), seconds=4.0)])  # fmt: skip
    try:
        got = pod.stress(procs=4, threads=2, seconds=3.0)
    finally:
        out, err = rewriter.communicate(timeout=60)
    assert rewriter.returncode == 0, err
    print(f"attack 1: {int(out)} rewrites, {got}")
    assert int(out) > 1000, "the rewriter must really race"
    assert got["failed_procs"] == 0
    assert got["allocs"] > 1000 and got["ooms"] > 0, got  # the limit was really met
    assert got["violations"] == 0 and got["max_used"] <= LIMIT, got
    assert pod.agent.leased() == 0  # every process exited: every lease came back


def test_attack2_truncate_and_rewrite_loop_gives_new_processes_no_fresh_budget(pod):
    """A holder keeps 3/4 of the limit; the tenant truncates the region and writes a fresh,
    zero-use header in a loop, while new processes keep starting and allocating."""
    holder = pod.cuctl()
    assert holder("init")["ok"]
    assert holder(f"alloc plain {384 * MiB}")["ok"]
    fresh = pod.base / "gpu" / "fresh"
    region.prepare_region_file(fresh)
    fresh.chmod(0o644)
    cutter = pod.spawn([sys.executable, "-c", f"""
import time
data = open('{fresh}', 'rb').read()
end, n = time.monotonic() + 4.0, 0
while time.monotonic() < end:
    with open('/run/tessera/region/usage', 'r+b') as f:
        f.truncate(0)
        f.write(data)
    n += 1
print(n)
"""])
    runs, allocs, worst = 0, 0, 0
    try:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            got = pod.stress(procs=2, threads=1, seconds=0.2)
            runs += 1
            allocs += got["allocs"]
            worst = max(worst, got["max_used"])
            assert got["violations"] == 0 and got["max_used"] <= LIMIT, (got, holder.p.poll())
    finally:
        out, err = cutter.communicate(timeout=60)
    assert cutter.returncode == 0, err
    print(f"attack 2: {int(out)} truncate-rewrites, {runs} runs, {allocs} allocations, "
          f"max {worst >> 20} MiB")  # fmt: skip
    assert int(out) > 500, "the cutter must really race"  # ~1,400 on a loaded 2-core machine
    assert runs >= 3 and worst <= LIMIT
    assert holder("phys")["phys"] <= LIMIT
    # the holder keeps what it has; nobody got a fresh budget beside it
    assert pod.agent.leased() <= LIMIT


def test_attack3_container_root_cannot_replace_the_region(pod):
    """The container's root (no CAP_SYS_ADMIN) moves a zero-use copy over the region: refused
    (a mount point); writing it in place instead makes no room either."""
    a = pod.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {448 * MiB}")["ok"]
    zero = pod.base / "gpu" / "zero"
    region.prepare_region_file(zero)
    attack = pod.run([sys.executable, "-c", f"""
import errno, os, shutil
out = []
shutil.copy('{zero}', '{zero}-root')
for op in (lambda: os.replace('{zero}-root', '/run/tessera/region/usage'),
           lambda: os.rename('/run/tessera/region/usage', '/run/tessera/region/old'),
           lambda: os.unlink('/run/tessera/region/usage')):
    try:
        op(); out.append('done')
    except OSError as e:
        out.append(errno.errorcode[e.errno])
open('/run/tessera/region/usage', 'r+b').write(open('{zero}', 'rb').read())
print(os.getuid(), ' '.join(out))
"""], root=True)
    assert attack.returncode == 0, attack.stderr
    uid, *errs = attack.stdout.split()
    assert uid == "0" and "done" not in errs, attack.stdout
    for _ in range(3):  # new processes, as many times as the tenant likes
        b = pod.cuctl()
        assert b("init")["ok"]
        assert not b(f"alloc plain {128 * MiB}")["ok"]
        assert b("phys")["phys"] <= LIMIT
        b.close(check=False)
    assert pod.physical() <= LIMIT


def test_without_the_lease_service_allocations_fail_closed(pod):
    pod.agent.stop()
    pod.agent = None
    c = pod.cuctl()
    assert c("init")["ok"]
    assert not c(f"alloc plain {MiB}")["ok"]  # nothing leased, nobody to lease from
    assert "no lease service" in c.stderr()
    pod.agent = AgentLoop(pod.store)
    ok, _ = wait_for(lambda: c(f"alloc plain {MiB}")["ok"], timeout=10, step=0.05)
    assert ok


def test_an_agent_restart_keeps_the_account(pod):
    """The agent restarts: each process reconnects and declares what it holds, so the new
    service's account starts from the truth and grants no more than what is left."""
    a = pod.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {400 * MiB}")["ok"]
    pod.restart_agent(down_s=0.3)
    back, _ = wait_for(lambda: pod.agent.leased() >= 400 * MiB, timeout=10, step=0.05)
    assert back, pod.agent.leased()
    b = pod.cuctl()
    assert b("init")["ok"]
    assert not b(f"alloc plain {200 * MiB}")["ok"]
    assert pod.physical() <= LIMIT



# ---- attack 6: spill (host memory) beyond the sealed bound by rewriting the region ------------

SPILL = 128 * MiB
SPILL_STEP = 16 * MiB

SPILL_REWRITER = """
import mmap, sys, time
f = open('/run/tessera/region/usage', 'r+b')
m = mmap.mmap(f.fileno(), 0)
offs, end = {offs}, time.monotonic() + {seconds}
zero, n = bytes(8), 0
print('racing', flush=True)
while time.monotonic() < end:
    for o in offs:
        m[o:o + 8] = zero
    n += 1
    time.sleep(0.00005)
print(n)
"""


def _spill_offsets() -> list[int]:
    """The region's spill counters a tenant can write: the container's total and each slot's."""
    slot = region.ctypes.sizeof(region.ProcSlotC)
    return [region.RegionC.spilled_bytes.offset] + [
        region.RegionC.procs.offset + i * slot + region.ProcSlotC.spilled_bytes.offset
        for i in range(32)]  # fmt: skip


def _spill_until_refused(c: Cuctl, limit: int) -> int:
    got = 0
    while got <= limit and c(f"alloc plain {SPILL_STEP}")["ok"]:
        got += SPILL_STEP
    return got


def test_attack6_zeroing_the_spill_counters_gives_no_host_memory_past_the_bound(pod):
    """A container sealed with a 128 MiB spill bound fills its card, then three processes spill
    (allocations past the device limit served from host memory) while the tenant zeroes the
    region's spill total and every process's spill counter every ~50 µs: together they never
    get more than the bound (the node agent leases it; the region only reports it), and what a
    process frees can be spilled again."""
    pod.seal_spill(SPILL)
    card = pod.cuctl()
    assert card("init")["ok"]
    assert card(f"alloc plain {LIMIT}")["ok"]  # the card is full: every next byte spills
    spillers = [pod.cuctl() for _ in range(3)]
    for c in spillers:
        assert c("init")["ok"]
    rewriter = pod.spawn([sys.executable, "-c", SPILL_REWRITER.format(
        offs=_spill_offsets(), seconds=3.0)])  # fmt: skip
    try:
        assert rewriter.stdout.readline() == "racing\n"  # it writes from now on
        got = [_spill_until_refused(c, SPILL) for c in spillers]
        got.append(_spill_until_refused(spillers[0], SPILL))  # after the others: once more
    finally:
        out, err = rewriter.communicate(timeout=60)
    assert rewriter.returncode == 0, err
    assert int(out) > 100, "the rewriter must really race"
    print(f"attack 6: {int(out)} rewrites, spilled {[g // MiB for g in got]} MiB")
    assert sum(got) == SPILL, got  # all of the bound, none past it
    assert pod.agent.leased(region.LEASE_SPILL_NAME) == SPILL
    assert pod.physical() <= LIMIT  # nothing of it went onto the card
    spillers[0].close(check=False)  # a process that goes gives its spill back ...
    back, _ = wait_for(lambda: pod.agent.leased(region.LEASE_SPILL_NAME) < SPILL, timeout=10,
                       step=0.05)  # fmt: skip
    assert back
    freed = SPILL - pod.agent.leased(region.LEASE_SPILL_NAME)
    assert _spill_until_refused(spillers[1], SPILL) == freed  # ... to be spilled again
    assert pod.agent.leased(region.LEASE_SPILL_NAME) == SPILL


def test_spill_without_the_agents_lease_is_refused(pod):
    """Sealed with leases, a spill the lease service does not grant is refused (fail closed):
    no lease service, no host memory past the limit."""
    pod.seal_spill(SPILL)
    c = pod.cuctl()
    assert c("init")["ok"]
    assert c(f"alloc plain {LIMIT}")["ok"]
    pod.agent.stop()
    pod.agent = None
    assert not c(f"alloc plain {SPILL_STEP}")["ok"]
    pod.agent = AgentLoop(pod.store)
    ok, _ = wait_for(lambda: c(f"alloc plain {SPILL_STEP}")["ok"], timeout=10, step=0.05)
    assert ok

# ---- attacks 4 and 5: libvgpu never loads; the watchdog kills at first sight -----------------

AUDIT_MODULE = r"""
#define _GNU_SOURCE
#include <link.h>
#include <stdint.h>
#include <string.h>
unsigned int la_version(unsigned int v) { (void)v; return LAV_CURRENT; }
char *la_objsearch(const char *name, uintptr_t *cookie, unsigned int flag)
{
    (void)cookie; (void)flag;
    const char *base = strrchr(name, '/');
    return strcmp(base ? base + 1 : name, "libvgpu.so") ? (char *)name : NULL; /* the preload */
}
"""


class Watched:
    """The node agent's watchdog (kill, lease polls at the default period) on the agent's loop,
    beside its lease service: NVML is the fake driver's (it lists the processes that really
    hold memory on the fake GPU), /proc maps the tenant's pids to the pod (written per pid)."""

    def __init__(self, pod: Pod, native) -> None:
        from tessera.node_agent.nvml_processes import NvmlProcessProbe
        from tessera.node_agent.watchdog import Watchdog
        from tessera.node_agent.watchdog_rules import WatchdogPolicy

        from tessera.models import AllocationState, NodeLedger

        self.pod = pod
        self.proc_root = pod.base / "proc"
        shutil.rmtree(self.proc_root, ignore_errors=True)
        self.proc_root.mkdir()
        grant = DeviceGrant(uuid=GPU0, type="FAKE", memory_mib=LIMIT_MIB, cores=100)
        ledger = NodeLedger(node="n", allocations={POD: Allocation(
            pod_uid=POD, namespace="t", name="p", node="n", containers=[[grant]],
            container_names=["main"], state=AllocationState.ALLOCATED)})  # fmt: skip

        async def read_ledger() -> NodeLedger:
            return ledger

        settings = TesseraSettings()
        self.lease_poll_s = settings.watchdog_lease_poll_s
        probe = NvmlProcessProbe(str(native.fake / "libnvidia-ml.so.1"))
        assert pod.agent is not None
        self.watchdog = Watchdog(
            node="n", store=pod.store, ledger=read_ledger, probe=probe, js=None,  # type: ignore[arg-type]
            policy=WatchdogPolicy(), enforcement="kill", proc_root=self.proc_root,
            log=__import__("logging").getLogger("test.watchdog"), poll_s=settings.watchdog_poll_s,
            leases=pod.agent.service, lease_poll_s=self.lease_poll_s,
        )  # fmt: skip

        async def start() -> asyncio.Event:
            stop = asyncio.Event()
            self.task = asyncio.create_task(self.watchdog.run(stop))
            return stop

        self.stop_event = pod.agent.call(start())

    def in_pod(self, pid: int) -> None:
        entry = self.proc_root / str(pid)
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "cgroup").write_text(f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}"
                                      ".slice/cri-containerd-0123.scope\n")  # fmt: skip

    def stop(self) -> None:
        async def stop() -> None:
            self.stop_event.set()
            await self.task

        assert self.pod.agent is not None
        self.pod.agent.call(stop())


def _maps_once_loaded(p: subprocess.Popen, exe_name: str, timeout: float = 30.0) -> str:
    """/proc/<pid>/maps once the process (after its prefix's mounts and execs: slow on a loaded
    host) runs `exe_name` and the loader has mapped libc (preloads are mapped before it)."""
    end = time.monotonic() + timeout
    while True:
        assert p.poll() is None, p.stderr.read()[-2000:]
        with contextlib.suppress(OSError):
            if Path(os.readlink(f"/proc/{p.pid}/exe")).name == exe_name:
                maps = Path(f"/proc/{p.pid}/maps").read_text()
                if "/libc.so" in maps or "/libc-" in maps:
                    return maps
        assert time.monotonic() < end, f"{exe_name} not started in {timeout}s"
        time.sleep(0.01)


def _attack(pod: Pod, watched: Watched, prefix: tuple[str, ...], env: dict[str, str]) -> float:
    """A cuctl that allocates past the limit at once; seconds from the allocation being sent
    to the process's death (killed by the watchdog), asserting it really got past libvgpu."""
    p = subprocess.Popen([*prefix, str(pod.native.bin / "cuctl")], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)  # fmt: skip
    try:
        watched.in_pod(p.pid)
        maps = _maps_once_loaded(p, "cuctl")  # the loader has run: is libvgpu mapped?
        assert str(pod.native.lib) not in maps, "the attack did not keep libvgpu out"
        # its context and its allocation (past the limit) at once: whatever the watchdog sees
        # first, the process is dead within the bound of the first byte it took
        t0 = time.monotonic()
        p.stdin.write(f"init\nalloc plain {2 * LIMIT}\nsleep 30\n")
        p.stdin.flush()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"not killed: {dict(watched.watchdog.stats)}") from None
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = p.stdout.read()
    assert p.returncode == -9, p.stderr.read()[-2000:]
    assert "false" not in out, out  # never refused: libvgpu was really out of the way
    return elapsed


@pytest.fixture
def watched(pod, native) -> Iterator[Watched]:
    if native.san:  # an ASan-built library cannot load into this (uninstrumented) interpreter
        pytest.skip("the watchdog loads the fake NVML into the test process")
    w = Watched(pod, native)
    yield w
    w.stop()


def test_attack4_ld_audit_is_killed_by_the_watchdog_within_half_a_second(pod, watched):
    audit_c = pod.base / "gpu" / "audit.c"
    audit_c.write_text(AUDIT_MODULE)
    audit = pod.base / "gpu" / "audit.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(audit), str(audit_c)], check=True)
    audit.chmod(0o755)
    honest = pod.cuctl()
    assert honest("init")["ok"]
    assert honest(f"alloc plain {256 * MiB}")["ok"]
    watched.in_pod(honest.pid)
    elapsed = _attack(pod, watched, pod.prefix(), {**pod.env(), "LD_AUDIT": str(audit)})
    print(f"LD_AUDIT bypass killed {elapsed:.2f}s after its allocation was sent")
    assert elapsed <= 0.5
    assert honest.p.poll() is None  # attested and within its lease: untouched


def test_attack5_bind_over_the_preload_file_in_a_user_namespace_is_killed(pod, watched):
    probe = pod.run(["unshare", "-Urm", "true"])
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces refused here: {probe.stderr.strip()}")
    script = "mount --bind /dev/null /etc/ld.so.preload && exec \"$@\""
    prefix = (*pod.prefix(), "unshare", "-Urm", "sh", "-c", script, "sh")
    elapsed = _attack(pod, watched, prefix, pod.env())
    print(f"user-namespace bypass killed {elapsed:.2f}s after its allocation was sent")
    assert elapsed <= 0.5
