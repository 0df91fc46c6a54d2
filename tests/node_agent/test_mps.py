"""MPS sharing on a node: one control daemon per GPU in MPS mode, slices enforced server-side.

The control daemon is tests/node_agent/fake_mps_control.py (a stand-in for NVIDIA's
nvidia-cuda-mps-control that follows its documented commands and answers); the agent runs
against a real NATS with kubelet's stand-in on real unix-socket gRPC. What a user would notice:
a node set to `operatingmode: mps` gets a daemon per GPU; a pod's container is given the pipe
directory, and the card's server limits are its slice before the container can start — a client
that asks for more in its environment still gets the slice; a restarted agent adopts the
daemons (or starts a new one where one died); a GPU leaving MPS mode has its daemon stopped once
no client is connected; a card holding pods cannot switch modes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from node_agent_rig import grants, make_pod, running_rig
from tessera.node_agent import mps
from tessera.node_agent.node_config_rules import GpuUsage, mode_change_problems

from tessera import bus
from tessera.codec import encode
from tessera.events import decode_event
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    MpsEvent,
    NodeConfigSetRequest,
    NodeLedger,
)
from tessera.region import SEALED_LIMITS_DIR, ContainerLimits, DeviceLimit, read_limits

FAKE = Path(__file__).parent / "fake_mps_control.py"
GPU_TYPE = "NVIDIA-NVIDIA A100-SXM4-80GB"


# --- the rules (pure) ---------------------------------------------------------------------------


def _alloc(uid: str, *cards: tuple[str, int, int], state=AllocationState.ALLOCATED) -> Allocation:
    return Allocation(pod_uid=uid, namespace="t", name=uid, node="n", state=state,
                      containers=[[DeviceGrant(uuid=u, type=GPU_TYPE, memory_mib=m, cores=c)]
                                  for u, m, c in cards])


def test_a_cards_server_limits_are_the_smallest_active_slice() -> None:
    allocations = [
        _alloc("a", ("GPU-1", 4000, 30)),
        _alloc("b", ("GPU-1", 8000, 0)),  # 0 cores: not limited, 100 % of the threads
        _alloc("c", ("GPU-1", 1000, 10), state=AllocationState.RELEASED),
        _alloc("d", ("GPU-2", 2000, 50)),
    ]
    assert mps.card_limits("GPU-1", allocations) == mps.ServerLimits(4000, 30)
    assert mps.card_limits("GPU-2", allocations) == mps.ServerLimits(2000, 50)
    assert mps.card_limits("GPU-3", allocations) is None
    assert mps.limit_commands(mps.ServerLimits(4000, 30), [71, 72]) == [
        "set_default_device_pinned_mem_limit 0 4000M",
        "set_default_active_thread_percentage 30",
        "set_device_pinned_mem_limit 71 0 4000M",
        "set_active_thread_percentage 71 30",
        "set_device_pinned_mem_limit 72 0 4000M",
        "set_active_thread_percentage 72 30",
    ]


def test_libvgpu_keeps_accounting_but_not_its_compute_limiter_on_mps_cards() -> None:
    limits = ContainerLimits(devices=(DeviceLimit("GPU-1", mem_limit_bytes=1 << 30,
                                                  sm_limit_pct=30),
                                      DeviceLimit("GPU-2", mem_limit_bytes=1 << 30,
                                                  sm_limit_pct=30)))
    out = mps.accounting_only(limits, {"GPU-1"})
    assert [(d.mem_limit_bytes, d.sm_limit_pct) for d in out.devices] == [
        (1 << 30, 100), (1 << 30, 30)]


def test_a_card_holding_pods_cannot_switch_modes() -> None:
    def dev(mode: str) -> DeviceInfo:
        return DeviceInfo(uuid="GPU-1", index=0, type=GPU_TYPE, memory_mib=1000, cores=100,
                          split_count=4, mode=mode)

    held = {"GPU-1": GpuUsage(memory_mib=500, cores=10, slots=1, pods=1)}
    [problem] = mode_change_problems([dev("hami-core")], [dev("mps")], held)
    assert "holds 1 pod(s) in hami-core mode and cannot switch to mps" in problem
    assert mode_change_problems([dev("hami-core")], [dev("mps")], {}) == []
    assert mode_change_problems([dev("mps")], [dev("mps")], held) == []


# --- with the fake control daemon -----------------------------------------------------------------


def attach(pipe: Path, pid: int, uid: int | None = None) -> str:
    """What an MPS client is told when it connects (the fake driver speaks this)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(pipe / "control"))
        s.sendall(f"fake_client_attach {pid} {os.getuid() if uid is None else uid}\n".encode())
        data = b""
        while not data.endswith(b"\0"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.rstrip(b"\0").decode().strip()


def daemon_pid(pipe: Path) -> int | None:
    try:
        return int((pipe / mps.PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def commands(root: Path, uuid: str) -> list[str]:
    log = root / uuid / "log" / "control.log"
    if not log.exists():
        return []
    return [line.split("Cmd: ", 1)[1] for line in log.read_text().splitlines() if "Cmd: " in line]


async def until(check, timeout: float = 15.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await check()
        if result:
            return result
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def mps_events(rig) -> list[MpsEvent]:
    js = rig.nc.jetstream()
    sub = await js.subscribe(f"{bus.EVENTS_PREFIX}.mps.{bus.subject_token(rig.node)}.*",
                             ordered_consumer=True)
    found = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:
                return found
            found.append(decode_event(msg.data))
    finally:
        await sub.unsubscribe()


async def events_until(rig, action: str, count: int) -> list[MpsEvent]:
    async def enough():
        found = [e for e in await mps_events(rig) if e.action == action]
        return found if len(found) >= count else None

    return await until(enough)


async def set_mode(rig, mode: str):
    body = encode(NodeConfigSetRequest(config={"operatingmode": mode}))
    msg = await rig.nc.request(bus.node_config_set_subject(rig.node), body, timeout=10)
    return msg


def control(pipe: Path, line: str) -> str:
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    done = subprocess.run([sys.executable, str(FAKE)], input=line + "\n", env=env, text=True,
                          capture_output=True, timeout=10)
    return done.stdout.strip()


def quit_all(root: Path) -> None:
    """Daemons outlive the agent by design: the test ends its own."""
    for pipe in root.glob("*/pipe"):
        pid = daemon_pid(pipe)
        if pid:
            control(pipe, "quit")


@pytest.fixture
def mps_settings() -> dict:
    return {"mps_control_binary": str(FAKE), "mps_reconcile_s": 0.5}


async def test_mps_node_runs_a_daemon_per_gpu_and_limits_each_pod_server_side(
    short_dir, nc, buckets, mps_settings
) -> None:
    root = short_dir / "regions" / ".mps"
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            gpu0, gpu1 = rig.gpus
            assert not root.exists() or not list(root.iterdir())  # hami-core: no daemons
            await set_mode(rig, "mps")

            async def both_running():
                return all(daemon_pid(root / g / "pipe") for g in (gpu0, gpu1))

            await until(both_running)
            started = await events_until(rig, "started", 2)
            assert {e.device_uuid for e in started} == {gpu0, gpu1}
            assert not any(e.adopted for e in started)

            pod = make_pod("mps-a", [("main", 1)])
            await rig.bind(pod, [grants((gpu0, 4000, 30))])
            admitted = await rig.kubelet.admit_pod(pod)
            assert admitted.ok, admitted.error
            container = admitted.containers[0]
            # The container reaches its card's daemon; libvgpu keeps accounting, no SM limiter.
            assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == mps.PIPE_CONTAINER_DIR
            assert container.mount(mps.PIPE_CONTAINER_DIR).host_path == str(root / gpu0 / "pipe")
            assert container.envs["CUDA_DEVICE_SM_LIMIT_0"] == "100"
            sealed = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
            assert (sealed.devices[0].mem_limit_bytes, sealed.devices[0].sm_limit_pct) == (
                4000 << 20, 100)
            # Server-side limits were set through the daemon before the container could start.
            said = commands(root, gpu0)
            assert "set_default_device_pinned_mem_limit 0 4000M" in said
            assert "set_default_active_thread_percentage 30" in said
            assert not any("pinned" in c or "thread" in c for c in commands(root, gpu1))
            # A client connecting now (whatever its env says) is given the slice.
            client = subprocess.Popen(["sleep", "60"])
            try:
                assert attach(root / gpu0 / "pipe", client.pid) == f"{4000 << 20} 30.0"
                # A second, smaller pod lowers the card's server limit for later clients,
                # including on the server that is already running.
                small = make_pod("mps-b", [("main", 1)])
                await rig.bind(small, [grants((gpu0, 2000, 20))])
                assert (await rig.kubelet.admit_pod(small)).ok
                said = commands(root, gpu0)
                server = control(root / gpu0 / "pipe", "get_server_list")
                assert f"set_device_pinned_mem_limit {server} 0 2000M" in said
                assert f"set_active_thread_percentage {server} 20" in said
                other = subprocess.Popen(["sleep", "60"])
                try:
                    assert attach(root / gpu0 / "pipe", other.pid) == f"{2000 << 20} 20.0"
                finally:
                    other.kill()
                    other.wait()
            finally:
                client.kill()
                client.wait()
    finally:
        quit_all(root)


async def test_restarted_agent_adopts_daemons_and_replaces_a_dead_one(
    short_dir, nc, buckets, mps_settings
) -> None:
    root = short_dir / "regions" / ".mps"
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            gpu0, gpu1 = rig.gpus
            await set_mode(rig, "mps")

            async def both_running():
                return all(daemon_pid(root / g / "pipe") for g in (gpu0, gpu1))

            await until(both_running)
            before = {g: daemon_pid(root / g / "pipe") for g in (gpu0, gpu1)}
            await rig.stop_agent()
            # The daemons outlive the agent; one dies meanwhile (SIGKILL: a stale pipe dir).
            assert all(os.path.exists(f"/proc/{p}") for p in before.values())
            os.kill(before[gpu1], signal.SIGKILL)
            await rig.start_agent()

            async def replaced():
                pid = daemon_pid(root / gpu1 / "pipe")
                return pid if pid and pid != before[gpu1] and os.path.exists(f"/proc/{pid}") \
                    else None

            await until(replaced)
            assert daemon_pid(root / gpu0 / "pipe") == before[gpu0]  # adopted, not restarted
            started = await events_until(rig, "started", 4)
            adopted = [e for e in started if e.adopted]
            assert [(e.device_uuid, e.daemon_pid) for e in adopted] == [(gpu0, before[gpu0])]
    finally:
        quit_all(root)


async def test_leaving_mps_mode_stops_daemons_once_no_client_is_connected(
    short_dir, nc, buckets, mps_settings
) -> None:
    root = short_dir / "regions" / ".mps"
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            gpu0, gpu1 = rig.gpus
            await set_mode(rig, "mps")

            async def both_running():
                return all(daemon_pid(root / g / "pipe") for g in (gpu0, gpu1))

            await until(both_running)
            pid1 = daemon_pid(root / gpu1 / "pipe")
            client = subprocess.Popen(["sleep", "60"])  # a process still connected on GPU 1
            try:
                assert attach(root / gpu1 / "pipe", client.pid).split()[1] == "100.0"
                await set_mode(rig, "hami-core")

                async def gpu0_stopped():
                    return daemon_pid(root / gpu0 / "pipe") is None

                await until(gpu0_stopped)
                await asyncio.sleep(1.0)  # several reconciles: GPU 1's daemon is kept
                assert daemon_pid(root / gpu1 / "pipe") == pid1
                assert os.path.exists(f"/proc/{pid1}")
            finally:
                client.kill()
                client.wait()

            async def gpu1_stopped():
                return daemon_pid(root / gpu1 / "pipe") is None

            await until(gpu1_stopped)
            stopped = await events_until(rig, "stopped", 2)
            assert {e.device_uuid for e in stopped} == {gpu0, gpu1}
            assert commands(root, gpu1)[-1] == "quit"
    finally:
        quit_all(root)


async def test_a_mode_switch_of_a_card_in_use_is_refused(short_dir, nc, buckets,
                                                         mps_settings) -> None:
    root = short_dir / "regions" / ".mps"
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            pod = make_pod("core", [("main", 1)])
            allocation = await rig.bind(pod, [grants((rig.gpus[0], 1000, 10))])
            assert (await rig.kubelet.admit_pod(pod)).ok
            msg = await set_mode(rig, "mps")
            assert b"cannot switch to mps" in msg.data
            assert not root.exists() or not any(root.glob("*/pipe"))

            def release(ledger):
                ledger = ledger.model_copy(deep=True)
                ledger.allocations[allocation.pod_uid].state = AllocationState.RELEASED
                return ledger

            await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, release)
            msg = await set_mode(rig, "mps")
            assert b"cannot switch" not in msg.data
    finally:
        quit_all(root)
