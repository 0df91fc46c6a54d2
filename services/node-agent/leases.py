"""The lease service: each container's device-memory account, held here, out of the tenant's reach.

libvgpu (inside the container) may charge an allocation only against memory it holds on lease
from this service; the sum of a container's leases never exceeds its sealed limit, whatever the
tenant writes into its usage region. One unix stream socket per container, `lease.sock` in its
limits directory (mounted read-only: the tenant can connect but not replace it). The protocol is
in native/libvgpu/include/tessera_region.h; in short:

    libvgpu -> agent   A <uuid> <need> <want>   lease need..want bytes more -> G <bytes> | N
                       R <uuid> <bytes>         give back
                       H <uuid> <bytes>         already held (after a reconnect)
                       D                        a recall answered (after its R lines)
    agent -> libvgpu   C                        recall: give back what you hold unused

Leases are counted per connection, and each connection is named by its peer's credentials
(SO_PEERCRED: the host pid). A closed connection — the process exited or was killed — returns
its leases. A live connection is also the process's attestation: a process using memory on a
limited GPU with no connection here is not running libvgpu (the watchdog's business).

`LeaseBook` is the pure account; `ContainerLeases` serves one socket; `LeaseService` keeps one
per prepared container directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tessera.region import LEASE_SOCKET_NAME, ContainerLimits, RegionFormatError, read_limits

from .containers import ContainerDir

MAX_CONNECTIONS = 1024  # per container (libvgpu's process slots)
MAX_LINE = 256
RECALL_WAIT_S = 0.5  # how long a request waits for other processes to give back unused lease
LIMITS_RECHECK_S = 1.0  # the watchdog's question "does it lease?" stats the limits this often
SYNC_S = 0.2  # how often the service looks for new or removed container directories
_U63 = (1 << 63) - 1


class LeaseBook:
    """Who holds what, per connection and GPU (pure; no I/O). The invariant: a grant never takes
    a GPU's total above its limit. Declared holdings (H, after an agent restart) are recorded
    even above it — that memory is already allocated — and then nothing more is granted."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, int]] = {}

    def total(self, uuid: str) -> int:
        return sum(h.get(uuid, 0) for h in self.held.values())

    def holds(self, conn: int) -> int:
        return sum(self.held.get(conn, {}).values())

    def acquire(self, conn: int, uuid: str, need: int, want: int, limit: int) -> int:
        """Bytes granted (need..want), or 0 when even `need` would pass `limit`."""
        if need <= 0 or limit <= 0:
            return 0
        room = limit - self.total(uuid)
        if room < need:
            return 0
        granted = min(max(want, need), room)
        mine = self.held.setdefault(conn, {})
        mine[uuid] = mine.get(uuid, 0) + granted
        return granted

    def release(self, conn: int, uuid: str, n: int) -> None:
        mine = self.held.get(conn)
        if not mine or uuid not in mine:
            return
        left = mine[uuid] - max(n, 0)
        if left > 0:
            mine[uuid] = left
        else:
            del mine[uuid]

    def declare(self, conn: int, uuid: str, n: int) -> None:
        if n > 0:
            mine = self.held.setdefault(conn, {})
            mine[uuid] = mine.get(uuid, 0) + n

    def drop(self, conn: int) -> None:
        self.held.pop(conn, None)


@dataclass
class Peer:
    """One connected process."""

    conn: int
    pid: int
    uid: int
    writer: asyncio.StreamWriter
    pending: asyncio.Task[None] | None = field(default=None, repr=False)
    recalls: int = 0  # recalls sent and not yet answered ("D")


class ProtocolError(ValueError):
    pass


def parse_line(line: bytes) -> tuple[str, str, int, int]:
    """(verb, uuid, first number, second number) of one request line; ProtocolError if bad."""
    try:
        parts = line.decode("ascii").split()
    except UnicodeDecodeError as e:
        raise ProtocolError("not ASCII") from e
    if parts == ["D"]:
        return "D", "", 0, 0
    if not parts or parts[0] not in ("A", "R", "H"):
        raise ProtocolError(f"unknown request {line[:32]!r}")
    want = 3 if parts[0] != "A" else 4
    if len(parts) != want or not all(p.isdigit() for p in parts[2:]) or not parts[1]:
        raise ProtocolError(f"malformed {parts[0]} request")
    nums = [int(p) for p in parts[2:]]
    if any(n > _U63 for n in nums):
        raise ProtocolError("number out of range")
    return parts[0], parts[1], nums[0], nums[1] if len(nums) > 1 else 0


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel tells it."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class ContainerLeases:
    """One container's socket and account."""

    def __init__(self, key: str, limits_dir: Path, log: logging.Logger) -> None:
        self.key = key
        self.pod_uid = key.split("/", 1)[0]
        self.limits_dir = limits_dir
        self.path = limits_dir / LEASE_SOCKET_NAME
        self.log = log
        self.book = LeaseBook()
        self.peers: dict[int, Peer] = {}
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._next = 0
        self._limits: ContainerLimits | None = None
        self._limits_stat: tuple[int, int, int] | None = None
        self._checked_at = -1e18

    async def start(self) -> None:
        # Bound through the directory's descriptor: the host path may be longer than a socket
        # address can be (108 bytes); the container's (/run/tessera/limits/lease.sock) is not.
        dfd = os.open(self.limits_dir, os.O_RDONLY | os.O_DIRECTORY)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(LEASE_SOCKET_NAME, dir_fd=dfd)  # an earlier agent's: its peers are gone
            sock.bind(f"/proc/self/fd/{dfd}/{LEASE_SOCKET_NAME}")
            # any uid of the container may connect; nobody there may replace it (read-only dir)
            os.chmod(LEASE_SOCKET_NAME, 0o666, dir_fd=dfd)
        except BaseException:
            sock.close()
            raise
        finally:
            os.close(dfd)
        # a backlog for every process of the container starting at once (the default is 100)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE,
                                                       backlog=MAX_CONNECTIONS)  # fmt: skip

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for peer in list(self.peers.values()):
            peer.writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def limit(self, uuid: str) -> int:
        """The sealed memory limit of `uuid` (0: not this container's GPU, or no limits)."""
        try:
            st = (self.limits_dir / "limits").stat()
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._limits_stat:
                self._limits, self._limits_stat = read_limits(self.limits_dir), stamp
        except (OSError, RegionFormatError):
            self._limits, self._limits_stat = None, None
        d = self._limits.device(uuid) if self._limits else None
        return d.mem_limit_bytes if d else 0

    def leasing(self, uuid: str) -> bool:
        """Sealed with leases and a memory limit on `uuid` (the limits file re-read only when it
        changed; its stat at most every LIMITS_RECHECK_S)."""
        now = time.monotonic()
        if now - self._checked_at >= LIMITS_RECHECK_S:
            self._checked_at = now
            self.limit(uuid)
        d = self._limits.device(uuid) if self._limits and self._limits.lease else None
        return bool(d and d.mem_limit_bytes)

    def pids(self) -> set[int]:
        return {p.pid for p in self.peers.values()}

    def leased(self, uuid: str) -> int:
        return self.book.total(uuid)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _gid = peer_credentials(sock)
        except OSError:
            writer.close()
            return
        if len(self.peers) >= MAX_CONNECTIONS:
            self.log.warning("lease service: too many connections", extra={"container": self.key})
            writer.close()
            return
        self._next += 1
        peer = Peer(self._next, pid, uid, writer)
        self.peers[peer.conn] = peer
        try:
            while True:
                line = await reader.readline()
                if not line or not line.endswith(b"\n"):
                    break
                verb, uuid, a, b = parse_line(line)
                if verb == "A":
                    if peer.pending is not None and not peer.pending.done():
                        raise ProtocolError("a second request before the first was answered")
                    peer.pending = asyncio.create_task(self._acquire(peer, uuid, a, b))
                elif verb == "R":
                    self.book.release(peer.conn, uuid, a)
                    await self._notify()
                elif verb == "D":
                    peer.recalls = max(peer.recalls - 1, 0)
                    await self._notify()
                else:
                    self.book.declare(peer.conn, uuid, a)
        except ConnectionError:
            pass  # the process went away: its leases come back below
        except (ProtocolError, ValueError, asyncio.LimitOverrunError) as e:
            self.log.warning("lease service: closing a connection: %s", e,
                             extra={"container": self.key, "pid": pid})  # fmt: skip
        finally:
            if peer.pending is not None:
                peer.pending.cancel()
            self.peers.pop(peer.conn, None)
            self.book.drop(peer.conn)
            writer.close()
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _acquire(self, peer: Peer, uuid: str, need: int, want: int) -> None:
        granted = self.book.acquire(peer.conn, uuid, need, want, self.limit(uuid))
        if not granted and 0 < need <= self.limit(uuid):
            granted = await self._after_recall(peer, uuid, need, want)
        peer.writer.write(b"G %d\n" % granted if granted else b"N\n")
        with contextlib.suppress(ConnectionError):
            await peer.writer.drain()

    async def _after_recall(self, peer: Peer, uuid: str, need: int, want: int) -> int:
        """Ask every other holder of `uuid` to give back what it has not charged, then wait
        (RECALL_WAIT_S at most) for room."""
        others = [p for p in self.peers.values()
                  if p is not peer and self.book.held.get(p.conn, {}).get(uuid)]  # fmt: skip
        if not others:
            return 0
        for p in others:
            p.recalls += 1
            p.writer.write(b"C\n")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECALL_WAIT_S
        async with self._changed:
            while True:
                granted = self.book.acquire(peer.conn, uuid, need, want, self.limit(uuid))
                left = deadline - loop.time()
                answered = all(p.recalls == 0 or p.conn not in self.peers for p in others)
                if granted or left <= 0 or answered:
                    return granted
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)


class LeaseService:
    """A lease socket for every prepared container directory, opened and closed as the store's
    directories come and go (`sync`, every SYNC_S in `run`)."""

    def __init__(self, containers: Callable[[], Iterable[ContainerDir]],
                 log: logging.Logger | None = None,
                 version: Callable[[], int] | None = None) -> None:  # fmt: skip
        self.containers = containers
        self.log = log or logging.getLogger("tessera.node_agent.leases")
        self.version = version  # when given: sync only after it moved (ContainerStore.version)
        self.served: dict[Path, ContainerLeases] = {}
        self._by_pod: dict[str, list[ContainerLeases]] = {}  # pod uid -> its containers'
        self._synced: int | None = None
        self._failed = False

    async def sync(self) -> None:
        version = self.version() if self.version else None
        if version is not None and version == self._synced and not self._failed:
            return
        self._synced, self._failed = version, False
        present = {c.limits_dir: c for c in self.containers()}
        for path in [p for p in self.served if p not in present]:
            await self.served.pop(path).close()
        for path, cdir in present.items():
            if path in self.served or not path.is_dir():
                continue
            leases = ContainerLeases(cdir.key, path, self.log)
            try:
                await leases.start()
            except OSError as e:
                self.log.error("lease service: cannot serve %s: %s", path, e)
                self._failed = True  # try again at the next sync
                continue
            self.served[path] = leases
        self._by_pod = {}
        for c in self.served.values():
            self._by_pod.setdefault(c.pod_uid, []).append(c)

    def attested(self) -> dict[int, str]:
        """host pid -> pod uid, for every process with a live lease connection."""
        return {p.pid: c.pod_uid for c in self.served.values() for p in c.peers.values()}

    def leased_by_pod(self, pod_uid: str, uuid: str) -> int:
        """What the pod's containers hold on lease on `uuid`."""
        return sum(c.leased(uuid) for c in self._by_pod.get(pod_uid, ()))

    def leases_memory(self, pod_uid: str, uuid: str) -> bool:
        """Some container of the pod leases its memory on `uuid` (sealed with a limit there)."""
        return any(c.leasing(uuid) for c in self._by_pod.get(pod_uid, ()))

    def limit_of_pod(self, pod_uid: str, uuid: str) -> int:
        return sum(c.limit(uuid) for c in self._by_pod.get(pod_uid, ()))

    def for_key(self, key: str) -> ContainerLeases | None:
        return next((c for c in self.served.values() if c.key == key), None)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.sync()
                except Exception:
                    self.log.exception("lease service: sync failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SYNC_S)
        finally:
            await self.close()

    async def close(self) -> None:
        for leases in self.served.values():
            await leases.close()
        self.served.clear()
        self._by_pod.clear()
