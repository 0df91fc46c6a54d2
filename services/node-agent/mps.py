"""MPS sharing: one NVIDIA MPS control daemon per GPU in MPS mode, slices enforced server-side.

A GPU is in MPS mode when the node's configuration says so (`operatingmode: mps`); pods reach
it by that or by `nvidia.com/vgpu-mode: mps` (the scheduler places them only on MPS cards).

- **Daemons.** For each such GPU the agent runs `nvidia-cuda-mps-control -d` with
  `CUDA_VISIBLE_DEVICES=<uuid>` and `CUDA_MPS_PIPE_DIRECTORY` / `CUDA_MPS_LOG_DIRECTORY` under
  `<region dir>/.mps/<uuid>/`. A restarted agent adopts a daemon that still answers on its pipe
  directory (its pid file names a live process and `get_server_list` answers); a stale pipe
  directory (dead daemon) is cleaned and the daemon started anew. A GPU leaving MPS mode gets
  `quit` once no client is connected to its servers (until then the daemon is kept).
- **Limits, server-side.** NVIDIA's MPS (v2 interface) limits per *server*: the pinned device
  memory limit and the active thread percentage a server holds apply to every client that
  connects to it afterwards; a client's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` /
  `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` can only lower them (documented). So on each card the
  agent sets the server limits (the defaults for servers not yet started, and each running
  server from `get_server_list`) to the **smallest** slice among the card's active allocations
  — never above any pod's own grant, whatever a container's environment says — before kubelet
  gets the Allocate answer (so before the container can connect), and again on every
  reconcile (a limit raised when a small pod leaves reaches clients that connect afterwards).
  Pods of one size per MPS card get exactly their slice; a larger pod next to a smaller one
  gets the smaller one (safe, not generous): give an MPS node uniform slices.
- **The container** gets the pipe directory (mounted read-write at `/run/tessera/mps`,
  `CUDA_MPS_PIPE_DIRECTORY`), and libvgpu stays preloaded in accounting mode: it keeps the
  usage region (metrics, the watchdog's view) and the memory limit (the same value as the
  server's), but its compute limiter is off (sealed `sm_limit_pct` 100): MPS partitions the SMs,
  and a second, time-based limiter would compound with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from nats.js import JetStreamContext

from tessera import bus
from tessera.models import Allocation, DeviceInfo, MpsEvent, NodeLedger
from tessera.region import ContainerLimits

MPS_MODE = "mps"
MPS_DIR = ".mps"  # under the region dir; a dot-directory is never taken for a pod's
PID_FILE = "nvidia-cuda-mps-control.pid"
PIPE_CONTAINER_DIR = "/run/tessera/mps"
COMMAND_TIMEOUT_S = 20.0
# How the control daemon's answers start when it refuses a command.
REFUSALS = ("invalid", "unknown", "server ", "error", "cannot")


class MpsError(RuntimeError):
    """The control daemon could not be started or did not take a command."""


@dataclass(frozen=True)
class ServerLimits:
    """What every client of a card's MPS server may use: MiB of device 0, % of its threads."""

    memory_mib: int
    thread_pct: int


def mps_uuids(devices: Iterable[DeviceInfo]) -> set[str]:
    return {d.uuid for d in devices if d.mode == MPS_MODE}


def card_limits(uuid: str, allocations: Iterable[Allocation]) -> ServerLimits | None:
    """The smallest slice any active allocation holds on this card (None: nobody holds it).
    A container's 0 % cores (HAMi: no compute limit) is 100 % of the threads."""
    memory: list[int] = []
    threads: list[int] = []
    for allocation in allocations:
        if not allocation.active:
            continue
        for grants in allocation.containers:
            for g in grants:
                if g.uuid == uuid:
                    memory.append(g.memory_mib)
                    threads.append(min(g.cores, 100) if g.cores > 0 else 100)
    if not memory:
        return None
    return ServerLimits(max(1, min(memory)), max(1, min(threads)))


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
    """One GPU's control daemon, driven through the control program (blocking: run in a
    thread). Every command is one run of the program with the command on stdin."""

    def __init__(self, binary: str, root: Path, uuid: str) -> None:
        self.binary = binary
        self.uuid = uuid
        self.root = root / uuid
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
    """The node's control daemons: started, adopted, limited and stopped against what the
    node advertises and what its ledger holds. All decisions are in the pure functions above."""

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
        self._lock = asyncio.Lock()

    def daemon(self, uuid: str) -> ControlDaemon:
        return self.daemons.get(uuid) or ControlDaemon(self.binary, self.root, uuid)

    def pipe_dir(self, uuid: str) -> Path:
        return self.daemon(uuid).pipe_dir

    def known_dirs(self) -> list[str]:
        """GPUs with a pipe directory under the root (daemons of an earlier run included)."""
        try:
            return sorted(p.name for p in self.root.iterdir() if (p / "pipe").is_dir())
        except FileNotFoundError:
            return []

    async def reconcile(self, devices: Iterable[DeviceInfo], ledger: NodeLedger | None) -> None:
        """Daemons for the GPUs in MPS mode (adopted or started), limits from the ledger, and
        daemons of GPUs no longer in MPS mode stopped once their clients are gone."""
        async with self._lock:
            wanted = mps_uuids(devices)
            allocations = list(ledger.allocations.values()) if ledger else []
            for uuid in sorted(wanted):
                try:
                    await self._ensure(uuid)
                    await self._limit(uuid, card_limits(uuid, allocations))
                except MpsError as exc:
                    self.log.error("mps daemon", extra={"gpu": uuid, "err": str(exc)})
            for uuid in sorted((set(self.daemons) | set(self.known_dirs())) - wanted):
                await self._retire(uuid)

    async def limit_now(self, uuid: str, ledger: NodeLedger | None) -> None:
        """Put the card's limits in force before a container is answered (raises MpsError:
        the Allocate fails and kubelet retries, rather than a client connecting unlimited)."""
        async with self._lock:
            await self._ensure(uuid)
            allocations = list(ledger.allocations.values()) if ledger else []
            await self._limit(uuid, card_limits(uuid, allocations))

    async def _ensure(self, uuid: str) -> None:
        daemon = self.daemon(uuid)
        if uuid in self.daemons and daemon.pid() is not None:
            return  # ours and alive (its pid file names a live process): no command needed
        adopted = await asyncio.to_thread(daemon.answering)
        if not adopted:
            pid = daemon.pid()
            if pid is not None:  # alive but silent (busy, starting): never start a second one
                raise MpsError(f"the MPS control daemon of {uuid} (pid {pid}) does not answer")
            await asyncio.to_thread(daemon.start)
            if not await asyncio.to_thread(daemon.answering):
                raise MpsError(f"the MPS control daemon for {uuid} does not answer after start")
        self.daemons[uuid] = daemon
        self.applied.pop(uuid, None)
        self.log.info("mps daemon", extra={"gpu": uuid, "adopted": adopted, "pid": daemon.pid()})
        await self._publish("started", uuid, daemon.pid(), adopted,
                            "adopted a running control daemon" if adopted
                            else "started the control daemon")

    async def _limit(self, uuid: str, limits: ServerLimits | None) -> None:
        if limits is None or self.applied.get(uuid) == limits:
            return
        await asyncio.to_thread(self.daemons[uuid].apply, limits)
        self.applied[uuid] = limits
        self.log.info("mps limits", extra={"gpu": uuid, "memory_mib": limits.memory_mib,
                                           "thread_pct": limits.thread_pct})

    async def _retire(self, uuid: str) -> None:
        daemon = self.daemon(uuid)
        try:
            if not await asyncio.to_thread(daemon.answering):
                self.daemons.pop(uuid, None)  # gone: its pipe directory too (logs are kept)
                await asyncio.to_thread(shutil.rmtree, daemon.pipe_dir, True)
                return
            clients = await asyncio.to_thread(daemon.clients)
            if clients:
                self.daemons[uuid] = daemon  # kept until its clients are gone
                return
            pid = daemon.pid()
            await asyncio.to_thread(daemon.quit)
        except MpsError as exc:
            self.log.error("mps daemon not stopped", extra={"gpu": uuid, "err": str(exc)})
            return
        self.daemons.pop(uuid, None)
        self.applied.pop(uuid, None)
        await self._publish("stopped", uuid, pid, False, "the GPU left MPS mode")

    async def _publish(
        self, action: str, uuid: str, pid: int | None, adopted: bool, reason: str
    ) -> None:
        if self.js is None:
            return
        try:
            await bus.publish_event(self.js, MpsEvent(
                action=action, node=self.node, device_uuid=uuid, daemon_pid=pid or 0,
                adopted=adopted, reason=reason, source=self.source))  # type: ignore[arg-type]
        except Exception as exc:  # an event lost is logged, never fatal
            self.log.warning("mps event not published", extra={"err": str(exc)})

    async def run(self, stop: asyncio.Event, devices: Callable[[], Iterable[DeviceInfo]],
                  ledger: Callable[[], Awaitable[NodeLedger | None]],
                  interval_s: float) -> None:
        """Reconcile every `interval_s` until stopped. The daemons outlive the agent."""
        while not stop.is_set():
            try:
                await self.reconcile(list(devices()), await ledger())
            except Exception as exc:
                self.log.error("mps reconcile", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


def container_extras(uuids: set[str], grants_uuids: list[str], daemons: MpsDaemons
                     ) -> tuple[dict[str, str], list[tuple[str, str, bool]]]:
    """Env and mounts added to an Allocate answer whose container holds an MPS card: the pipe
    directory, and libvgpu's compute limiter off (the sealed file says the same)."""
    mine = [u for u in grants_uuids if u in uuids]
    if not mine:
        return {}, []
    env = {"CUDA_MPS_PIPE_DIRECTORY": PIPE_CONTAINER_DIR, "CUDA_DEVICE_SM_LIMIT": "100"}
    for i, u in enumerate(grants_uuids):
        if u in uuids:
            env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = "100"
    return env, [(PIPE_CONTAINER_DIR, str(daemons.pipe_dir(mine[0])), False)]
