"""MPS sharing: one NVIDIA MPS control daemon per container on an MPS card, each holding its
own pod's slice server-side.

A GPU is in MPS mode when the node's configuration says so (`operatingmode: mps`); pods reach
it by that or by `nvidia.com/vgpu-mode: mps` (the scheduler places them only on MPS cards, one
card per container).

- **Why one daemon per container.** NVIDIA's MPS (its v2 control interface) holds limits per
  *server*: the pinned device memory limit and active thread percentage a server has bind every
  client that connects to it afterwards, and a client's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` /
  `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` can only lower them. A control daemon runs one server per
  user id at a time, and every client of that uid joins it. So pods of different sizes sharing
  one daemon cannot each get their own limits. NVIDIA documents running several control/server
  pairs in parallel, each with its own `CUDA_MPS_PIPE_DIRECTORY` (its "Starting multiple
  control/server pairs"): the agent gives each container holding an MPS card its own daemon
  and pipe directory (`<region dir>/.mps/c-<hash of the container directory>/pipe`), whose
  default limits are that container's grant, set before the container can start.
- **Identity.** The pipe directory belongs to the container *directory* (the one kubelet mounts),
  not to the pod an Allocate answer guessed: PreStartContainer, which proves the owner, puts
  the proven pod's limits on the daemon before any process of the container runs, so a crossed
  admission never leaves a container on another pod's limits.
- **Restarts.** The daemons outlive the agent (clients keep running). A restarted agent adopts
  each daemon that still answers on its pipe directory (its pid file names a live process and
  `get_server_list` answers) and re-applies its limits; where a daemon died, the stale pipe
  directory is removed and a new daemon started (its container's new processes connect to it).
  A daemon whose container is gone (pod released, directory removed) gets `quit` once
  `get_client_list` shows no client, and its pipe directory is removed (its log is kept).
- **The container** gets its pipe directory mounted read-write at `/run/tessera/mps`
  (`CUDA_MPS_PIPE_DIRECTORY`), and libvgpu stays preloaded in accounting mode: it keeps the
  usage region (metrics, the watchdog's view) and the memory limit (the same value as the
  server's), but its compute limiter is off (sealed `sm_limit_pct` 100): MPS partitions the SMs,
  and a second, time-based limiter would compound with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from nats.js import JetStreamContext

from tessera import bus
from tessera.device_kinds.nvidia.mps import MODE as MPS_MODE
from tessera.device_kinds.nvidia.mps import PIPE_CONTAINER_DIR as PIPE_CONTAINER_DIR
from tessera.models import Allocation, DeviceGrant, DeviceInfo, MpsEvent, NodeLedger
from tessera.region import ContainerLimits, read_limits

from .containers import ContainerDir

MPS_DIR = ".mps"  # under the region dir; a dot-directory is never taken for a pod's
PID_FILE = "nvidia-cuda-mps-control.pid"
COMMAND_TIMEOUT_S = 20.0
# How the control daemon's answers start when it refuses a command.
REFUSALS = ("invalid", "unknown", "server ", "error", "cannot")


class MpsError(RuntimeError):
    """The control daemon could not be started or did not take a command."""


@dataclass(frozen=True)
class ServerLimits:
    """What every client of one MPS server may use: MiB of device 0, % of its threads."""

    memory_mib: int
    thread_pct: int


@dataclass(frozen=True)
class MpsSlot:
    """One container's own control daemon on one MPS card, and the limits its server holds."""

    key: str  # the daemon's directory under <region dir>/.mps
    uuid: str
    pod_uid: str
    pod: str  # namespace/name
    container: str
    limits: ServerLimits


def mps_uuids(devices: Iterable[DeviceInfo]) -> set[str]:
    return {d.uuid for d in devices if d.mode == MPS_MODE}


def grant_limits(grant: DeviceGrant) -> ServerLimits:
    """A grant as server limits. A container's 0 % cores (HAMi: no compute limit) is 100 %."""
    threads = min(grant.cores, 100) if grant.cores > 0 else 100
    return ServerLimits(max(1, grant.memory_mib), max(1, threads))


def daemon_key(cdir: ContainerDir, uuid: str) -> str:
    """The daemon directory of a container directory (its path, which never changes, even when
    PreStartContainer relabels it to its true owner) on one card; short, for the sockets in it
    (a unix socket path has 108 bytes)."""
    where = f"{cdir.path.parent.name}/{cdir.path.name}\0{uuid}"
    return "c-" + hashlib.sha256(where.encode()).hexdigest()[:20]


def container_slots(cdir: ContainerDir, allocation: Allocation | None, cards: set[str]
                    ) -> list[MpsSlot]:
    """The daemons a container directory needs: one per MPS card of its owner's grant (the
    ledger's, which limits.set changes), none when the owner holds no active allocation."""
    p = cdir.prepared
    if allocation is None or not allocation.active or p.index >= len(allocation.containers):
        return []
    return [MpsSlot(key=daemon_key(cdir, g.uuid), uuid=g.uuid, pod_uid=p.pod_uid,
                    pod=f"{p.namespace}/{p.pod}", container=p.container,
                    limits=grant_limits(g))
            for g in allocation.containers[p.index] if g.uuid in cards]


def wanted_slots(cdirs: Iterable[ContainerDir], allocations: Mapping[str, Allocation],
                 cards: set[str], sealed: Callable[[ContainerDir], Mapping[str, int]] | None = None,
                 ) -> dict[str, MpsSlot]:
    """Every daemon the node should run: key → slot. `sealed` (container → GPU uuid → MiB
    sealed) caps each server's memory at what PreStartContainer or limits.set validated and
    sealed, so a ledger value changed on the bus alone never raises it."""
    out: dict[str, MpsSlot] = {}
    for cdir in cdirs:
        slots = container_slots(cdir, allocations.get(cdir.prepared.pod_uid), cards)
        capped = sealed(cdir) if sealed is not None and slots else {}
        for slot in slots:
            cap = capped.get(slot.uuid)
            if cap is not None and cap < slot.limits.memory_mib:
                slot = replace(slot, limits=replace(slot.limits, memory_mib=max(1, cap)))
            out[slot.key] = slot
    return out


def sealed_memory(cdir: ContainerDir) -> dict[str, int]:
    """GPU uuid → the memory limit (MiB) sealed in the container's limits file (none before
    PreStartContainer; an unreadable file caps nothing: the ledger's grant stands)."""
    try:
        limits = read_limits(cdir.limits_dir)
    except Exception:
        return {}
    if limits is None:
        return {}
    return {d.uuid: d.mem_limit_bytes >> 20 for d in limits.devices if d.mem_limit_bytes > 0}


def limit_commands(limits: ServerLimits, servers: Iterable[int]) -> list[str]:
    """The control daemon's documented commands that put `limits` in force: defaults for the
    next server, then each running server (for clients that connect afterwards)."""
    commands = [
        f"set_default_device_pinned_mem_limit 0 {limits.memory_mib}M",
        f"set_default_active_thread_percentage {limits.thread_pct}",
    ]
    for pid in servers:
        commands.append(f"set_device_pinned_mem_limit {pid} 0 {limits.memory_mib}M")
        commands.append(f"set_active_thread_percentage {pid} {limits.thread_pct}")
    return commands


def accounting_only(limits: ContainerLimits, uuids: set[str]) -> ContainerLimits:
    """libvgpu's sealed limits for an MPS container: memory as granted, compute not limited
    (the MPS server partitions the SMs)."""
    return replace(limits, devices=tuple(
        replace(d, sm_limit_pct=100) if d.uuid in uuids else d for d in limits.devices
    ))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ControlDaemon:
    """One control daemon (one card, one container), driven through the control program
    (blocking: run in a thread). Every command is one run of the program with the command on
    stdin."""

    def __init__(self, binary: str, root: Path, uuid: str, key: str | None = None) -> None:
        self.binary = binary
        self.uuid = uuid
        self.key = key or uuid
        self.root = root / self.key
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env.update(CUDA_VISIBLE_DEVICES=self.uuid, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe_dir),
                   CUDA_MPS_LOG_DIRECTORY=str(self.log_dir))
        return env

    def pid(self) -> int | None:
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid > 0 and _pid_alive(pid) else None

    def command(self, *lines: str) -> str:
        """Run the control program once with `lines` on stdin (its interactive shell reads one
        command a line); its answers, or MpsError when it fails or refuses one."""
        script = "".join(line + "\n" for line in lines)
        what = "; ".join(lines)
        try:
            done = subprocess.run([self.binary], input=script, env=self._env(),
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"{self.binary}: {what}: {exc}") from exc
        if done.returncode != 0:
            raise MpsError(f"{self.binary}: {what}: exit {done.returncode}: "
                           f"{done.stderr.strip() or done.stdout.strip()}")
        answer = done.stdout.strip()
        for said in answer.splitlines():
            if said.strip().lower().startswith(REFUSALS):
                raise MpsError(f"{what}: {said.strip()}")
        return answer

    def answering(self) -> bool:
        if self.pid() is None:
            return False
        try:
            self.command("get_server_list")
        except MpsError:
            return False
        return True

    def start(self) -> None:
        """Start the daemon; a pipe directory left by a dead one is cleaned first."""
        shutil.rmtree(self.pipe_dir, ignore_errors=True)
        self.pipe_dir.mkdir(parents=True, mode=0o755)
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            done = subprocess.run([self.binary, "-d"], env=self._env(), capture_output=True,
                                  text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"cannot start {self.binary} for {self.uuid}: {exc}") from exc
        if done.returncode != 0:
            raise MpsError(f"{self.binary} -d for {self.uuid}: exit {done.returncode}: "
                           f"{done.stderr.strip()}")

    def servers(self) -> list[int]:
        return [int(w) for w in self.command("get_server_list").split() if w.isdigit()]

    def clients(self) -> list[int]:
        servers = self.servers()
        if not servers:
            return []
        answer = self.command(*(f"get_client_list {s}" for s in servers))
        return [int(w) for w in answer.split() if w.isdigit()]

    def apply(self, limits: ServerLimits) -> None:
        self.command(*limit_commands(limits, self.servers()))

    def quit(self) -> None:
        self.command("quit")


class MpsDaemons:
    """The node's control daemons, one per container on an MPS card: started (or adopted),
    limited and stopped against the node's container directories and its ledger. All decisions
    are in the pure functions above."""

    def __init__(
        self,
        *,
        binary: str,
        root: Path,
        node: str,
        log: logging.Logger,
        js: JetStreamContext | None = None,
        source: str = "",
    ) -> None:
        self.binary = binary
        self.root = root
        self.node = node
        self.log = log
        self.js = js
        self.source = source
        self.daemons: dict[str, ControlDaemon] = {}
        self.applied: dict[str, ServerLimits] = {}
        self.slots: dict[str, MpsSlot] = {}  # what each daemon serves (the dashboard's view)
        self._lock = asyncio.Lock()

    def daemon(self, key: str, uuid: str = "") -> ControlDaemon:
        return self.daemons.get(key) or ControlDaemon(self.binary, self.root, uuid or key, key)

    def pipe_dir(self, cdir: ContainerDir, uuid: str) -> Path:
        return self.root / daemon_key(cdir, uuid) / "pipe"

    def known_dirs(self) -> list[str]:
        """Daemon directories under the root (daemons of an earlier run included)."""
        try:
            return sorted(p.name for p in self.root.iterdir() if (p / "pipe").is_dir())
        except FileNotFoundError:
            return []

    async def reconcile(self, devices: Iterable[DeviceInfo], ledger: NodeLedger | None,
                        cdirs: Iterable[ContainerDir]) -> None:
        """A daemon (adopted or started) with its container's limits for every container on an
        MPS card, and daemons no container wants stopped once their clients are gone."""
        async with self._lock:
            allocations = ledger.allocations if ledger else {}
            wanted = await asyncio.to_thread(wanted_slots, list(cdirs), allocations,
                                             mps_uuids(devices), sealed_memory)
            for _key, slot in sorted(wanted.items()):
                try:
                    await self._ensure(slot)
                    await self._limit(slot)
                except MpsError as exc:
                    self.log.error("mps daemon", extra={"gpu": slot.uuid, "pod": slot.pod,
                                                        "err": str(exc)})
            for key in sorted((set(self.daemons) | set(self.known_dirs())) - set(wanted)):
                await self._retire(key)

    async def limit_now(self, cdir: ContainerDir, allocation: Allocation, uuid: str) -> Path:
        """Put this container's limits on its own daemon before the container can run (raises
        MpsError: the Allocate or PreStartContainer fails and kubelet retries, rather than a
        client connecting unlimited); the daemon's pipe directory."""
        slots = container_slots(cdir, allocation, {uuid})
        if not slots:
            raise MpsError(f"{cdir.prepared.namespace}/{cdir.prepared.pod} holds no grant "
                           f"on {uuid}")
        slot = slots[0]
        async with self._lock:
            await self._ensure(slot)
            await self._limit(slot)
        return self.daemons[slot.key].pipe_dir

    async def _ensure(self, slot: MpsSlot) -> None:
        daemon = self.daemon(slot.key, slot.uuid)
        self.slots[slot.key] = slot
        if slot.key in self.daemons and daemon.pid() is not None:
            return  # ours and alive (its pid file names a live process): no command needed
        adopted = await asyncio.to_thread(daemon.answering)
        if not adopted:
            pid = daemon.pid()
            if pid is not None:  # alive but silent (busy, starting): never start a second one
                raise MpsError(f"the MPS control daemon of {slot.pod} on {slot.uuid} (pid {pid})"
                               " does not answer")
            await asyncio.to_thread(daemon.start)
            if not await asyncio.to_thread(daemon.answering):
                raise MpsError(f"the MPS control daemon for {slot.pod} on {slot.uuid} does not "
                               "answer after start")
        self.daemons[slot.key] = daemon
        self.applied.pop(slot.key, None)
        self.log.info("mps daemon", extra={"gpu": slot.uuid, "pod": slot.pod,
                                           "adopted": adopted, "pid": daemon.pid()})
        await self._publish("started", daemon, slot, daemon.pid(), adopted,
                            "adopted a running control daemon" if adopted
                            else "started the control daemon")

    async def _limit(self, slot: MpsSlot) -> None:
        if self.applied.get(slot.key) == slot.limits:
            return
        await asyncio.to_thread(self.daemons[slot.key].apply, slot.limits)
        self.applied[slot.key] = slot.limits
        self.log.info("mps limits", extra={"gpu": slot.uuid, "pod": slot.pod,
                                           "memory_mib": slot.limits.memory_mib,
                                           "thread_pct": slot.limits.thread_pct})

    async def _retire(self, key: str) -> None:
        daemon = self.daemon(key)
        slot = self.slots.get(key)
        try:
            if not await asyncio.to_thread(daemon.answering):
                self._forget(key)  # gone: its pipe directory too (its log is kept)
                await asyncio.to_thread(shutil.rmtree, daemon.pipe_dir, True)
                return
            clients = await asyncio.to_thread(daemon.clients)
            if clients:
                self.daemons[key] = daemon  # kept until its clients are gone
                return
            pid = daemon.pid()
            await asyncio.to_thread(daemon.quit)
        except MpsError as exc:
            self.log.error("mps daemon not stopped", extra={"daemon": key, "err": str(exc)})
            return
        self._forget(key)
        await asyncio.to_thread(shutil.rmtree, daemon.pipe_dir, True)
        await self._publish("stopped", daemon, slot, pid, False,
                            "its container is gone" if slot else "no container uses it")

    def _forget(self, key: str) -> None:
        self.daemons.pop(key, None)
        self.applied.pop(key, None)
        self.slots.pop(key, None)

    async def _publish(self, action: str, daemon: ControlDaemon, slot: MpsSlot | None,
                       pid: int | None, adopted: bool, reason: str) -> None:
        if self.js is None:
            return
        try:
            await bus.publish_event(self.js, MpsEvent(
                action=action, node=self.node, device_uuid=slot.uuid if slot else daemon.uuid,
                daemon_pid=pid or 0, adopted=adopted, reason=reason, source=self.source,
                pod=slot.pod if slot else "", container=slot.container if slot else "",
                memory_mib=slot.limits.memory_mib if slot else 0,
                thread_pct=slot.limits.thread_pct if slot else 0,
            ))  # type: ignore[arg-type]
        except Exception as exc:  # an event lost is logged, never fatal
            self.log.warning("mps event not published", extra={"err": str(exc)})

    async def run(self, stop: asyncio.Event, devices: Callable[[], Iterable[DeviceInfo]],
                  ledger: Callable[[], Awaitable[NodeLedger | None]],
                  cdirs: Callable[[], list[ContainerDir]], interval_s: float) -> None:
        """Reconcile every `interval_s` until stopped. The daemons outlive the agent."""
        while not stop.is_set():
            try:
                await self.reconcile(list(devices()), await ledger(),
                                     await asyncio.to_thread(cdirs))
            except Exception as exc:
                self.log.error("mps reconcile", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
