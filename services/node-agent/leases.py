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

Elastic memory (issue 33): a container sealed with a guarantee below its limit may lease beyond
the guarantee, up to the limit, while the card has memory nobody is guaranteed (`lending.offer`:
the card-wide rule, across every container the service serves on that card). When a guaranteed
request finds the card's free memory held by borrowers, the borrowers' unused leases are recalled,
their next request beyond the guarantee is refused, borrowers that opted in are evicted (the
agent's `evict` callback) and the request waits for the memory (`reclaim_wait_s`). A container
that opted in to waiting (`PreparedContainer.memory_wait_s`) has a request that does not fit
wait that long for memory to be freed instead of failing at once. While a request waits the
service writes `W` lines (ignored by libvgpu) so its reply timeout does not run out.

`LeaseBook` is the pure account; `ContainerLeases` serves one socket; `LeaseService` keeps one
per prepared container directory and is the card-wide view (`CardView`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tessera.region import (
    LEASE_SOCKET_NAME,
    ContainerLimits,
    DeviceLimit,
    RegionFormatError,
    read_limits,
)

from .containers import ContainerDir, PreparedContainer
from .lending import RECLAIM_FAIL, Holder, Offer, Refusal, offer, reclaim_victims

MAX_CONNECTIONS = 1024  # per container (libvgpu's process slots)
MAX_LINE = 256
RECALL_WAIT_S = 0.5  # how long a request waits for other processes to give back unused lease
LIMITS_RECHECK_S = 1.0  # the watchdog's question "does it lease?" stats the limits this often
SYNC_S = 0.2  # how often the service looks for new or removed container directories
KEEPALIVE_S = 1.0  # a waiting request hears "W" this often (libvgpu's reply timeout is 5 s)
RECLAIM_WAIT_S = 15.0  # how long a guaranteed request waits for borrowed memory to come back
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

    def grant(self, conn: int, uuid: str, n: int) -> None:
        """Record `n` bytes leased (the caller judged them: `lending.offer`)."""
        if n > 0:
            mine = self.held.setdefault(conn, {})
            mine[uuid] = mine.get(uuid, 0) + n

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


def memory_bounds(d: DeviceLimit | None) -> tuple[int, int]:
    """(guarantee, limit) in bytes of one sealed device: the limit is the most the container may
    hold (its burst limit), the guarantee what is never lent away (= the limit for a hard
    slice). (0, 0): no limit there."""
    if d is None or not d.mem_limit_bytes:
        return 0, 0
    return d.mem_guarantee_bytes, d.mem_burst_limit_bytes


class CardView(Protocol):
    """What one container's account asks of the node-wide view (LeaseService)."""

    changed: asyncio.Condition
    reclaim_wait_s: float

    def others(self, me: ContainerLeases, uuid: str) -> list[Holder]: ...
    def card_bytes(self, uuid: str) -> int: ...
    def reclaim(self, me: ContainerLeases, uuid: str, short: int) -> None: ...


class ContainerLeases:
    """One container's socket and account."""

    def __init__(self, key: str, limits_dir: Path, log: logging.Logger,
                 prepared: PreparedContainer | None = None,
                 card: CardView | None = None) -> None:  # fmt: skip
        self.key = key
        self.pod_uid = key.split("/", 1)[0]
        self.limits_dir = limits_dir
        self.path = limits_dir / LEASE_SOCKET_NAME
        self.log = log
        self.prepared = prepared
        self.policy = getattr(prepared, "memory_reclaim", RECLAIM_FAIL) or RECLAIM_FAIL
        self.wait_s = float(getattr(prepared, "memory_wait_s", 0.0) or 0.0)
        self.card = card
        self.book = LeaseBook()
        self.peers: dict[int, Peer] = {}
        self._changed = card.changed if card is not None else asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._next = 0
        self._limits: ContainerLimits | None = None
        self._limits_stat: tuple[int, int, int] | None = None
        self._checked_at = -1e18
        self.waits = 0  # requests that waited (metrics)
        self.refused_borrow = 0  # requests beyond the guarantee refused: no room on the card

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

    def _device(self, uuid: str) -> DeviceLimit | None:
        try:
            st = (self.limits_dir / "limits").stat()
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._limits_stat:
                self._limits, self._limits_stat = read_limits(self.limits_dir), stamp
        except (OSError, RegionFormatError):
            self._limits, self._limits_stat = None, None
        return self._limits.device(uuid) if self._limits else None

    def limit(self, uuid: str) -> int:
        """The sealed memory limit of `uuid` (0: not this container's GPU, or no limits)."""
        return memory_bounds(self._device(uuid))[1]

    def guarantee(self, uuid: str) -> int:
        return memory_bounds(self._device(uuid))[0]

    def holder(self, uuid: str) -> Holder:
        guarantee, limit = memory_bounds(self._device(uuid))
        return Holder(self.key, guarantee, limit, self.book.total(uuid), self.policy)

    def leasing(self, uuid: str) -> bool:
        """Sealed with leases and a memory limit on `uuid` (the limits file re-read only when it
        changed; its stat at most every LIMITS_RECHECK_S)."""
        now = time.monotonic()
        if now - self._checked_at >= LIMITS_RECHECK_S:
            self._checked_at = now
            self.limit(uuid)
        d = self._limits.device(uuid) if self._limits and self._limits.lease else None
        return bool(d and d.mem_limit_bytes)

    def uuids(self) -> list[str]:
        """The GPUs this container is sealed on (the last limits read)."""
        return [d.uuid for d in self._limits.devices] if self._limits else []

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
        granted = await self._lease(peer, uuid, need, want)
        peer.writer.write(b"G %d\n" % granted if granted else b"N\n")
        with contextlib.suppress(ConnectionError):
            await peer.writer.drain()

    def _offer(self, uuid: str, need: int, want: int) -> Offer:
        me = self.holder(uuid)
        if self.card is None:  # no card view: nothing is lent (a hard slice as before)
            return offer(me, (), 0, need, want)
        return offer(me, self.card.others(self, uuid), self.card.card_bytes(uuid), need, want)

    async def _lease(self, peer: Peer, uuid: str, need: int, want: int) -> int:
        """Bytes granted to `peer` (0: refused): at once when they fit, else after recalling
        unused leases (this container's other processes; borrowers on the card when the
        guarantee is due), waiting for them — and, when the request opted in to waiting or
        its guarantee is due, for memory to be freed — up to a bound."""
        first = self._offer(uuid, need, want)
        if first.grant:
            self.book.grant(peer.conn, uuid, first.grant)
            return first.grant
        limit = self.limit(uuid)
        if need <= 0 or need > limit:
            return 0  # can never fit this container
        others = self._recall(peer, uuid)
        due = first.refusal is Refusal.RECLAIM
        if due and self.card is not None:
            self.card.reclaim(self, uuid, first.short)
        waiting = (self.card.reclaim_wait_s if due and self.card is not None else 0.0)
        waiting = max(waiting, self.wait_s)
        if not others and not waiting:
            self.refused_borrow += first.refusal is Refusal.BORROW
            return 0
        if waiting:
            self.waits += 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + max(RECALL_WAIT_S, waiting)
        keepalive = start + KEEPALIVE_S
        last = first
        async with self._changed:
            while True:
                last = self._offer(uuid, need, want)
                if last.grant:
                    self.book.grant(peer.conn, uuid, last.grant)
                    return last.grant
                if last.refusal is Refusal.RECLAIM and not due and self.card is not None:
                    due = True  # pressure began while this request waited
                    self.card.reclaim(self, uuid, last.short)
                now = loop.time()
                answered = all(p.recalls == 0 or p.conn not in self.peers for p in others)
                if now >= deadline or (answered and not waiting):
                    break
                if now >= keepalive:
                    keepalive = now + KEEPALIVE_S
                    peer.writer.write(b"W\n")  # still waiting (libvgpu reads past it)
                    # what was freed since may lie unused in another process (libvgpu keeps a
                    # chunk): ask again
                    others = self._recall(peer, uuid)
                    if due and self.card is not None:
                        self.card.reclaim(self, uuid, last.short)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(deadline, keepalive) - now)
        if last.refusal is Refusal.RECLAIM:
            # the guarantee is the container's: after the bound the account grants it as a hard
            # slice's (the driver has the last word on the card's memory)
            room = self.limit(uuid) - self.book.total(uuid)
            if need <= room:
                granted = min(max(want, need), room)
                self.book.grant(peer.conn, uuid, granted)
                return granted
        self.refused_borrow += last.refusal is Refusal.BORROW
        return 0

    def _recall(self, peer: Peer, uuid: str) -> list[Peer]:
        """Ask every other process of this container holding `uuid` to give back what it has
        not charged ("C"); the peers asked."""
        others = [p for p in self.peers.values()
                  if p is not peer and self.book.held.get(p.conn, {}).get(uuid)]  # fmt: skip
        for p in others:
            p.recalls += 1
            p.writer.write(b"C\n")
        return others

    def recall_all(self, uuid: str) -> int:
        """Recall every process's unused lease of `uuid` (a neighbour's guarantee is due)."""
        n = 0
        for p in self.peers.values():
            if self.book.held.get(p.conn, {}).get(uuid):
                p.recalls += 1
                p.writer.write(b"C\n")
                n += 1
        return n


@dataclass(frozen=True)
class ReclaimNotice:
    """Borrowed memory taken back on a card: `reclaimed` (the borrower's unused leases recalled,
    its allocations beyond its guarantee refused while the card is short) or `evicted` (the
    borrower opted in to eviction: the agent evicts its pod)."""

    action: str  # "reclaimed" | "evicted"
    device_uuid: str
    borrower: ContainerLeases
    borrowed_bytes: int
    short_bytes: int
    for_pod: str  # namespace/name of the container whose guarantee was due
    for_pod_uid: str


class LeaseService:
    """A lease socket for every prepared container directory, opened and closed as the store's
    directories come and go (`sync`, every SYNC_S in `run`), and the card-wide view every
    container's account asks about memory beyond guarantees (`CardView`)."""

    def __init__(self, containers: Callable[[], Iterable[ContainerDir]],
                 log: logging.Logger | None = None,
                 version: Callable[[], int] | None = None,
                 card_memory: Callable[[str], int] | None = None,
                 on_reclaim: Callable[[ReclaimNotice], Awaitable[None] | None] | None = None,
                 reclaim_wait_s: float = RECLAIM_WAIT_S,
                 notice_every_s: float = 5.0) -> None:  # fmt: skip
        self.containers = containers
        self.log = log or logging.getLogger("tessera.node_agent.leases")
        self.version = version  # when given: sync only after it moved (ContainerStore.version)
        self.card_memory = card_memory  # uuid -> physical bytes (None/0: nothing is lent)
        self.on_reclaim = on_reclaim  # events, and the eviction of borrowers that opted in
        self.reclaim_wait_s = reclaim_wait_s
        self.notice_every_s = notice_every_s
        self.changed = asyncio.Condition()  # one for the node: a free anywhere may be awaited
        self.served: dict[Path, ContainerLeases] = {}
        self._by_pod: dict[str, list[ContainerLeases]] = {}  # pod uid -> its containers'
        self._synced: int | None = None
        self._failed = False
        self._noticed: dict[tuple[str, str], float] = {}  # (borrower key, uuid) -> when
        self.evicted: set[str] = set()  # pod uids evicted for their borrowed memory
        self.reclaims = 0  # times a guarantee found borrowers in its way (metrics)
        self._tasks: set[asyncio.Task[None]] = set()

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
            leases = ContainerLeases(cdir.key, path, self.log, cdir.prepared, self)
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
        async with self.changed:
            self.changed.notify_all()  # a container gone: its memory may be what one waits for

    # ---- the card-wide view (CardView) --------------------------------------------------------

    def card_bytes(self, uuid: str) -> int:
        if self.card_memory is None:
            return 0
        try:
            return max(0, int(self.card_memory(uuid)))
        except Exception:  # an unknown card lends nothing
            return 0

    def others(self, me: ContainerLeases, uuid: str) -> list[Holder]:
        out = []
        for c in self.served.values():
            if c is me:
                continue
            h = c.holder(uuid)
            if h.limit:
                out.append(h)
        return out

    def reclaim(self, me: ContainerLeases, uuid: str, short: int) -> None:
        """`me`'s guarantee on `uuid` is due and borrowers hold the memory: recall their unused
        leases, evict those that opted in (enough to cover `short`), say so."""
        self.reclaims += 1
        borrowers = [c for c in self.served.values()
                     if c is not me and c.holder(uuid).borrowed]  # fmt: skip
        victims = {h.key for h in reclaim_victims([c.holder(uuid) for c in borrowers], short)}
        now = time.monotonic()
        for c in borrowers:
            c.recall_all(uuid)
            evict = c.key in victims and c.pod_uid not in self.evicted
            if evict:
                self.evicted.add(c.pod_uid)
            elif now - self._noticed.get((c.key, uuid), -1e18) < self.notice_every_s:
                continue
            self._noticed[(c.key, uuid)] = now
            p = me.prepared
            notice = ReclaimNotice(
                "evicted" if evict else "reclaimed", uuid, c, c.holder(uuid).borrowed, short,
                f"{p.namespace}/{p.pod}" if p else "", me.pod_uid)
            self.log.warning("lease service: borrowed memory %s", notice.action, extra={
                "container": c.key, "device": uuid, "borrowed": notice.borrowed_bytes,
                "short": short, "for": notice.for_pod})  # fmt: skip
            self._emit(notice)

    def _emit(self, notice: ReclaimNotice) -> None:
        if self.on_reclaim is None:
            return
        try:
            out = self.on_reclaim(notice)
        except Exception:
            self.log.exception("lease service: reclaim callback failed")
            return
        if out is not None:
            task = asyncio.ensure_future(out)
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("lease service: reclaim callback failed: %s", task.exception())

    def memory_view(self) -> list[tuple[ContainerLeases, str, Holder]]:
        """(container, GPU, its guarantee / limit / leased) for every sealed GPU served."""
        return [(c, u, c.holder(u)) for c in self.served.values() for u in c.uuids()]

    # ---- per pod (the watchdog's questions) ---------------------------------------------------

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
        for task in list(self._tasks):
            task.cancel()
