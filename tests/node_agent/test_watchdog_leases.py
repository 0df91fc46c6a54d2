"""Issue 29: with memory leases on (the default), the watchdog acts at first sight, without the
grace period, on a GPU whose memory the pod leases from the agent:

* a process NVML lists there with no lease connection is not running libvgpu (LD_AUDIT, another
  link-map namespace, a loader copy, a bind over /etc/ld.so.preload): killed ("unattested");
* a pod holding more than the agent leased it (plus a context's allowance per process) bypassed
  libvgpu inside an attested process: killed ("unleased");
* an attested process within its lease is never touched.

Measured from the moment the fake NVML shows the process to its death: within 0.5 s, at the
agent's default poll period. The processes are real; the attested one really connects to the
container's lease socket (SO_PEERCRED names it) and really leases memory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from watchdog_rig import MIB, Breaches, WatchEnv, admit, make_env, wait_exit, watched_rig

from tessera.settings import TesseraSettings

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process

BOUND_S = 0.5

LEASER = """
import os, socket, sys, time
directory, uuid, need = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(directory, os.O_RDONLY)
s = socket.socket(socket.AF_UNIX)
for _ in range(400):
    try:
        s.connect(f"/proc/self/fd/{fd}/lease.sock")
        break
    except OSError:
        time.sleep(0.025)
else:
    sys.exit("no lease service")
if need:
    s.sendall(f"A {uuid} {need} {need}\\n".encode())
    assert s.recv(64).startswith(b"G "), "lease refused"
print("leased", flush=True)
time.sleep(600)
"""


@pytest.fixture
def env(
    short_dir: Path, fake_nvml_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WatchEnv]:
    watch_env = make_env(short_dir, fake_nvml_lib, monkeypatch)
    try:
        yield watch_env
    finally:
        watch_env.cleanup()


def leaser_in_pod(env: WatchEnv, pod_uid: str, limits_dir: str, gpu: str, mib: int):
    """A real process of the pod (fake /proc cgroup) holding a lease connection: libvgpu's."""
    child = subprocess.Popen([sys.executable, "-c", LEASER, limits_dir, gpu, str(mib * MIB)],
                             stdout=subprocess.PIPE)  # fmt: skip
    env.children.append(child)
    entry = env.proc_root / str(child.pid)
    entry.mkdir(parents=True, exist_ok=True)
    scope = f"cri-containerd-{uuidlib.uuid4().hex}.scope"
    slice_ = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
    (entry / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}/{scope}\n")
    assert child.stdout is not None
    assert child.stdout.readline() == b"leased\n"
    return child


async def known(rig, pod_uid: str, timeout: float = 15.0) -> None:
    """Until the watchdog's ledger holds the pod (it is there long before a real container
    starts; here the container 'starts' at once)."""
    end = time.monotonic() + timeout
    while pod_uid not in rig.agent.watchdog._allocations:
        assert time.monotonic() < end, "the pod never reached the watchdog's ledger"
        await asyncio.sleep(0.05)


def limits_dir_of(region: str) -> str:
    return str(Path(region).parent.parent / "limits")


async def test_unattested_and_unleased_processes_are_killed_at_first_sight(env, nc, buckets):
    assert TesseraSettings().memory_leases and TesseraSettings().lease_enforcement == "kill"
    poll_s = TesseraSettings().watchdog_lease_poll_s
    breaches = Breaches(nc, env.node)
    # enforcement stays `observe` (memory, compute): a bypass is killed by the lease policy
    async with watched_rig(env, nc, buckets, memory_leases=True) as rig:
        pod_uid, region = await admit(rig, "tenant", 1000)
        gpu = rig.gpus[0]
        honest = await asyncio.to_thread(leaser_in_pod, env, pod_uid, limits_dir_of(region),
                                         gpu, 600)  # fmt: skip
        await known(rig, pod_uid)
        # the honest process, within its lease (and a context beside it): never touched
        env.gpu_holds((0, honest, 700, 0))
        assert await breaches.none_within(3 * poll_s + 0.5)
        # a bypass: same pod, same GPU, no lease connection (libvgpu never loaded)
        bypass = env.spawn_in_pod(pod_uid)
        env.gpu_holds((0, honest, 700, 0), (0, bypass, 1, 0))  # its first byte
        elapsed = await wait_exit(bypass, timeout=10)
        assert elapsed is not None, "the unattested process was not killed"
        assert elapsed <= BOUND_S, f"killed after {elapsed:.2f}s"
        event = await breaches.next()
        assert (event.breach, event.action, event.pids) == ("unattested", "killed", [bypass.pid])
        assert honest.poll() is None  # attested: left alone
        # the honest process now holds more than it leased (the driver called by address)
        env.gpu_holds((0, honest, 600 + 256 + 100, 0))
        elapsed = await wait_exit(honest, timeout=10)
        assert elapsed is not None and elapsed <= BOUND_S, elapsed
        event = await breaches.next()
        while event.breach == "tampered":  # its region claims nothing (it never wrote one)
            event = await breaches.next()
        assert (event.breach, event.action) == ("unleased", "killed")
        assert event.region_claim == 600 * MIB  # what the agent leased it
        print(f"killed within {elapsed:.2f}s at lease poll {poll_s}s")
    await breaches.close()


async def test_observe_reports_an_unattested_process_once(env, nc, buckets):
    breaches = Breaches(nc, env.node)
    async with watched_rig(env, nc, buckets, lease_enforcement="observe",
                           memory_leases=True) as rig:  # fmt: skip
        pod_uid, _region = await admit(rig, "tenant", 1000)
        await known(rig, pod_uid)
        bypass = env.spawn_in_pod(pod_uid)
        env.gpu_holds((0, bypass, 10, 0))
        event = await breaches.next()
        assert (event.breach, event.action) == ("unattested", "observed")
        assert await breaches.none_within(2.0)  # one event per episode
        assert bypass.poll() is None
    await breaches.close()
