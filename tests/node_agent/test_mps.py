"""MPS sharing on a node: one control daemon per container on an MPS card, each pod held
server-side to its own slice.

The control daemon is tests/node_agent/fake_mps_control.py (a stand-in for NVIDIA's
nvidia-cuda-mps-control that follows its documented commands and answers); the agent runs
against a real NATS with kubelet's stand-in on real unix-socket gRPC. What a user would notice:
pods of different sizes on one MPS card each get their own daemon, whose server gives a client
exactly that pod's slice (a client asking more in its environment still gets it — the fake
driver's side is tests/native/test_mps_client.py); a restarted agent adopts the daemons (or
starts a new one where one died); a pod's daemon is stopped once the pod is gone and no client
is connected; a card holding pods cannot switch modes.
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
from tessera.node_agent.containers import ContainerDir, PreparedContainer
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


def _cdir(path: str, uid: str, index: int = 0) -> ContainerDir:
    return ContainerDir(Path("/r") / path, PreparedContainer(
        pod_uid=uid, namespace="t", pod=uid, container="main", index=index, device_ids=[],
        grants=[]))


def test_each_container_on_an_mps_card_gets_a_server_with_its_own_limits() -> None:
    allocations = {a.pod_uid: a for a in [
        _alloc("a", ("GPU-1", 4000, 30)),
        _alloc("b", ("GPU-1", 8000, 0)),  # 0 cores: not limited, 100 % of the threads
        _alloc("c", ("GPU-1", 1000, 10), state=AllocationState.RELEASED),
        _alloc("d", ("GPU-2", 2000, 50)),  # GPU-2 is not in MPS mode
    ]}
    cdirs = [_cdir("a/0-main", "a"), _cdir("b/0-main", "b"), _cdir("c/0-main", "c"),
             _cdir("d/0-main", "d"), _cdir("gone/0-main", "gone")]
    slots = mps.wanted_slots(cdirs, allocations, {"GPU-1"})
    assert sorted((s.pod, s.limits) for s in slots.values()) == [
        ("t/a", mps.ServerLimits(4000, 30)), ("t/b", mps.ServerLimits(8000, 100))]
    assert len(set(slots)) == 2
    # The daemon belongs to the container directory: relabelling it to its true owner keeps
    # the daemon (and the mount kubelet already has), with the owner's limits.
    relabelled = mps.wanted_slots([_cdir("a/0-main", "b")], allocations, {"GPU-1"})
    [(key, slot)] = relabelled.items()
    assert key == mps.daemon_key(cdirs[0], "GPU-1") and slot.limits.memory_mib == 8000
    # A server's memory never exceeds what was validated and sealed for the container: a
    # ledger value raised on the bus alone does not raise it.
    capped = mps.wanted_slots(cdirs[:1], allocations, {"GPU-1"},
                              lambda c: {"GPU-1": 3000, "GPU-9": 1})
    assert [s.limits for s in capped.values()] == [mps.ServerLimits(3000, 30)]
    assert [s.limits for s in mps.wanted_slots(
        cdirs[:1], allocations, {"GPU-1"}, lambda c: {"GPU-1": 9000}).values()] == [
        mps.ServerLimits(4000, 30)]
    assert mps.limit_commands(mps.ServerLimits(4000, 30), [71]) == [
        "set_default_device_pinned_mem_limit 0 4000M",
        "set_default_active_thread_percentage 30",
        "set_device_pinned_mem_limit 71 0 4000M",
        "set_active_thread_percentage 71 30",
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


def commands(pipe: Path) -> list[str]:
    log = pipe.parent / "log" / "control.log"
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


def pipes(root: Path) -> dict[Path, int | None]:
    return {p: daemon_pid(p) for p in root.glob("c-*/pipe")}


async def admit_mps(rig, name: str, gpu: str, memory: int, cores: int):
    pod = make_pod(name, [("main", 1)])
    await rig.bind(pod, [grants((gpu, memory, cores))])
    admitted = await rig.kubelet.admit_pod(pod)
    assert admitted.ok, admitted.error
    return pod, admitted.containers[0]


def pipe_of(container) -> Path:
    return Path(container.mount(mps.PIPE_CONTAINER_DIR).host_path)


async def test_pods_of_different_sizes_on_one_card_each_get_their_own_server_limits(
    short_dir, nc, buckets, mps_settings
) -> None:
    root = short_dir / "regions" / ".mps"
    clients = []
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            gpu0, _gpu1 = rig.gpus
            await set_mode(rig, "mps")
            await asyncio.sleep(0.6)  # a reconcile: no container, so no daemon
            assert pipes(root) == {}
            _big, big = await admit_mps(rig, "mps-big", gpu0, 4000, 30)
            _small, small = await admit_mps(rig, "mps-small", gpu0, 2000, 20)
            # Each container reaches its own daemon; libvgpu keeps accounting, no SM limiter.
            assert big.envs["CUDA_MPS_PIPE_DIRECTORY"] == mps.PIPE_CONTAINER_DIR
            assert pipe_of(big) != pipe_of(small)
            assert {pipe_of(big), pipe_of(small)} == set(pipes(root))
            assert big.envs["CUDA_DEVICE_SM_LIMIT_0"] == "100"
            sealed = read_limits(big.mount(SEALED_LIMITS_DIR).host_path)
            assert (sealed.devices[0].mem_limit_bytes, sealed.devices[0].sm_limit_pct) == (
                4000 << 20, 100)
            # Server-side limits were set through each daemon before its container could start.
            assert "set_default_device_pinned_mem_limit 0 4000M" in commands(pipe_of(big))
            assert "set_default_active_thread_percentage 20" in commands(pipe_of(small))
            # A client of each pod is given that pod's slice, side by side on one card.
            for _ in range(2):
                clients.append(subprocess.Popen(["sleep", "60"]))
            assert attach(pipe_of(big), clients[0].pid) == f"{4000 << 20} 30.0"
            assert attach(pipe_of(small), clients[1].pid) == f"{2000 << 20} 20.0"
            started = await events_until(rig, "started", 2)
            assert sorted((e.pod.split("/")[1], e.memory_mib, e.thread_pct) for e in started) == [
                ("mps-big", 4000, 30), ("mps-small", 2000, 20)]
            # The small pod's reconcile never lowers the big pod's server (the old card-wide rule).
            await asyncio.sleep(1.2)
            assert not any("2000M" in c for c in commands(pipe_of(big)))

            # A grant raised in the ledger alone (forged on the bus, never validated nor sealed)
            # does not raise the server; a lowered one reaches clients that connect afterwards.
            def regrant(memory: int):
                def change(ledger):
                    ledger = ledger.model_copy(deep=True)
                    grant = ledger.allocations[_big["metadata"]["uid"]].containers[0][0]
                    grant.memory_mib = memory
                    return ledger
                return change

            await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, regrant(64000))
            await asyncio.sleep(1.2)
            assert not any("64000M" in c for c in commands(pipe_of(big)))
            await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, regrant(3000))

            async def lowered():
                return "set_default_device_pinned_mem_limit 0 3000M" in commands(pipe_of(big))

            await until(lowered)

            # The fake logs a command as it receives it, before the agent's last command of the
            # change is handled: a client that connects once the change is through gets 3000.
            async def new_client_gets_lowered_limit():
                clients.append(subprocess.Popen(["sleep", "60"]))
                return attach(pipe_of(big), clients[-1].pid) == f"{3000 << 20} 30.0"

            await until(new_client_gets_lowered_limit)
    finally:
        for c in clients:
            c.kill()
            c.wait()
        quit_all(root)


async def test_restarted_agent_adopts_daemons_and_replaces_a_dead_one_with_its_limits(
    short_dir, nc, buckets, mps_settings
) -> None:
    root = short_dir / "regions" / ".mps"
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            gpu0, _gpu1 = rig.gpus
            await set_mode(rig, "mps")
            _a, kept = await admit_mps(rig, "mps-kept", gpu0, 3000, 40)
            _b, lost = await admit_mps(rig, "mps-lost", gpu0, 1000, 10)
            before = {pipe_of(kept): daemon_pid(pipe_of(kept)),
                      pipe_of(lost): daemon_pid(pipe_of(lost))}
            await rig.stop_agent()
            # The daemons outlive the agent; one dies meanwhile (SIGKILL: a stale pipe dir).
            assert all(os.path.exists(f"/proc/{p}") for p in before.values())
            os.kill(before[pipe_of(lost)], signal.SIGKILL)
            await rig.start_agent()

            async def replaced():
                pid = daemon_pid(pipe_of(lost))
                return pid if pid and pid != before[pipe_of(lost)] else None

            await until(replaced)
            assert daemon_pid(pipe_of(kept)) == before[pipe_of(kept)]  # adopted, not restarted
            client = subprocess.Popen(["sleep", "60"])
            try:  # the new daemon holds the pod's own limits again
                async def limited():  # the log keeps the dead daemon's commands: a 2nd time
                    return commands(pipe_of(lost)).count(
                        "set_default_active_thread_percentage 10") >= 2

                await until(limited)
                assert attach(pipe_of(lost), client.pid) == f"{1000 << 20} 10.0"
            finally:
                client.kill()
                client.wait()
            started = await events_until(rig, "started", 4)
            adopted = [e for e in started if e.adopted]
            assert [(e.pod.split("/")[1], e.daemon_pid) for e in adopted] == [
                ("mps-kept", before[pipe_of(kept)])]
    finally:
        quit_all(root)


async def test_a_pods_daemon_stops_once_it_is_gone_and_no_client_is_connected(
    short_dir, nc, buckets, mps_settings
) -> None:
    root = short_dir / "regions" / ".mps"
    try:
        async with running_rig(short_dir, nc, buckets, **mps_settings) as rig:
            gpu0, _gpu1 = rig.gpus
            await set_mode(rig, "mps")
            pod, container = await admit_mps(rig, "mps-gone", gpu0, 1000, 10)
            pipe = pipe_of(container)
            pid = daemon_pid(pipe)
            client = subprocess.Popen(["sleep", "60"])  # a process still connected
            try:
                assert attach(pipe, client.pid).split()[1] == "10.0"

                def release(ledger):
                    ledger = ledger.model_copy(deep=True)
                    ledger.allocations[pod["metadata"]["uid"]].state = AllocationState.RELEASED
                    return ledger

                await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, release)
                rig.kubelet.remove_pod(pod["metadata"]["uid"])
                await asyncio.sleep(2.0)  # several reconciles: kept while its client runs
                assert daemon_pid(pipe) == pid
            finally:
                client.kill()
                client.wait()

            async def stopped():
                return not pipe.exists()

            await until(stopped)
            [event] = await events_until(rig, "stopped", 1)
            assert (event.pod, event.daemon_pid) == ("team/mps-gone", pid)
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
