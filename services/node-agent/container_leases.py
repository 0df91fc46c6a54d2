"""One container's lease socket and account (`ContainerLeases`), asking the node-wide view
(`CardView`, the LeaseService) about memory beyond its guarantee. See leases.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Protocol

from tessera.region import (
    LEASE_SOCKET_NAME,
    LEASE_SPILL_NAME,
    ContainerLimits,
    DeviceLimit,
    RegionFormatError,
    read_limits,
)

from .containers import PreparedContainer
from .lease_protocol import (
    MAX_CONNECTIONS,
    MAX_LINE,
    LeaseBook,
    Peer,
    ProtocolError,
    parse_line,
    peer_credentials,
)
from .memory_lending import RECLAIM_FAIL, Holder, Offer, Refusal, offer

RECALL_WAIT_S = 0.5  # how long a request waits for other processes to give back unused lease
LIMITS_RECHECK_S = 1.0  # the watchdog's question "does it lease?" stats the limits this often
NEIGHBOUR_RECHECK_S = 0.5  # how old a neighbour's limits may be in the card-wide rule
KEEPALIVE_S = 1.0  # a waiting request hears "W" this often (libvgpu's reply timeout is 5 s)


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
    reclaim_grace_s: float

    def others(self, me: ContainerLeases, uuid: str) -> list[Holder]: ...
    def card_bytes(self, uuid: str) -> int: ...
    def reclaim(self, me: ContainerLeases, uuid: str, short: int) -> None: ...
    def enforce(self, me: ContainerLeases, uuid: str, short: int, waited_s: float) -> None: ...
    def recall_freed(self, uuid: str) -> None: ...
    def held_changed(self, c: ContainerLeases, uuid: str) -> None: ...
    def borrowing(self, uuid: str, other_than: ContainerLeases) -> bool: ...


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
        self._neighbour_checked_at = -1e18
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
        return self._sealed(uuid)

    def _sealed(self, uuid: str) -> DeviceLimit | None:
        """The last limits read for `uuid`; LEASE_SPILL_NAME: the container's spill (sealed
        `spill_bytes`, host memory, leased as a hard slice of its own: never lent, no card)."""
        if self._limits is None:
            return None
        if uuid == LEASE_SPILL_NAME:
            spill = self._limits.spill_bytes if self._limits.lease else 0
            return DeviceLimit(LEASE_SPILL_NAME, spill) if spill > 0 else None
        return self._limits.device(uuid)

    def limit(self, uuid: str) -> int:
        """The sealed memory limit of `uuid` (0: not this container's GPU, or no limits)."""
        return memory_bounds(self._device(uuid))[1]

    def guarantee(self, uuid: str) -> int:
        return memory_bounds(self._device(uuid))[0]

    def holder(self, uuid: str, fresh: bool = True) -> Holder:
        """What this container holds on `uuid` against its guarantee and limit. `fresh`: the
        limits file stat'ed now (its own requests); else at most every NEIGHBOUR_RECHECK_S (a
        neighbour's, asked on every lease request of every container on the card)."""
        if fresh:
            d = self._device(uuid)
        else:
            now = time.monotonic()
            if now - self._neighbour_checked_at >= NEIGHBOUR_RECHECK_S:
                self._neighbour_checked_at = now
                self._device(uuid)
            d = self._sealed(uuid)
        guarantee, limit = memory_bounds(d)
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
                    self._held_changed(uuid)
                    peer.freed = peer.freed or peer.recalls == 0  # a free, not a recall's answer
                    await self._notify()
                elif verb == "D":
                    peer.recalls = max(peer.recalls - 1, 0)
                    await self._notify()
                else:
                    self.book.declare(peer.conn, uuid, a)
                    self._held_changed(uuid)
        except ConnectionError:
            pass  # the process went away: its leases come back below
        except (ProtocolError, ValueError, asyncio.LimitOverrunError) as e:
            self.log.warning("lease service: closing a connection: %s", e,
                             extra={"container": self.key, "pid": pid})  # fmt: skip
        finally:
            if peer.pending is not None:
                peer.pending.cancel()
            self.peers.pop(peer.conn, None)
            held = list(self.book.held.get(peer.conn, {}))
            self.book.drop(peer.conn)
            for uuid in held:
                self._held_changed(uuid)
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

    def _held_changed(self, uuid: str) -> None:
        if self.card is not None:
            self.card.held_changed(self, uuid)

    def _offer(self, uuid: str, need: int, want: int) -> Offer:
        me = self.holder(uuid)
        if self.card is None or uuid == LEASE_SPILL_NAME:  # nothing is lent (a hard slice)
            return offer(me, (), 0, need, want)
        if me.limit <= me.guarantee and not self.card.borrowing(uuid, self):
            return offer(me, (), 1, need, want)  # a hard slice, nobody borrows: as before
        return offer(me, self.card.others(self, uuid), self.card.card_bytes(uuid), need, want)

    async def _lease(self, peer: Peer, uuid: str, need: int, want: int) -> int:
        """Bytes granted to `peer` (0: refused): at once when they fit, else after recalling
        unused leases (this container's other processes; borrowers on the card when the
        guarantee is due), waiting for them — and, when the request opted in to waiting or
        its guarantee is due, for memory to be freed — up to a bound."""
        first = self._offer(uuid, need, want)
        if first.grant:
            self.book.grant(peer.conn, uuid, first.grant)
            self._held_changed(uuid)
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
            self.refused_borrow += first.refusal is Refusal.BORROW and uuid != LEASE_SPILL_NAME
            return 0
        if waiting:
            self.waits += 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + max(RECALL_WAIT_S, waiting)
        keepalive = start + KEEPALIVE_S
        due_at = start if due else None  # since when the guarantee waits for borrowers
        enforced = False  # the node's enforcement asked (once per request)
        last = first
        async with self._changed:
            while True:
                last = self._offer(uuid, need, want)
                if last.grant:
                    self.book.grant(peer.conn, uuid, last.grant)
                    self._held_changed(uuid)
                    return last.grant
                if last.refusal is Refusal.RECLAIM and not due and self.card is not None:
                    due = True  # pressure began while this request waited
                    due_at = loop.time()
                    self.card.reclaim(self, uuid, last.short)
                    waiting = max(waiting, self.card.reclaim_wait_s)
                    deadline = max(deadline, loop.time() + waiting)
                if waiting:  # a free since: what the freeing process kept unused, too
                    (self.card or self).recall_freed(uuid)
                now = loop.time()
                enforce_at = None
                if due_at is not None and not enforced and self.card is not None:
                    enforce_at = due_at + self.card.reclaim_grace_s
                    if now >= enforce_at:
                        enforce_at = None
                        if last.refusal is Refusal.RECLAIM:
                            enforced = True  # the borrowers kept it past the grace bound
                            self.card.enforce(self, uuid, last.short, now - due_at)
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
                wake = min(deadline, keepalive, enforce_at or deadline)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.0, wake - now))
        if (last.refusal is Refusal.RECLAIM and due_at is not None and not enforced
                and self.card is not None):
            # the wait ran out before the grace bound: the borrowers kept it all along
            self.card.enforce(self, uuid, last.short, loop.time() - due_at)
        if last.refusal is Refusal.RECLAIM:
            # the guarantee is the container's: after the bound the account grants it as a hard
            # slice's (the driver has the last word on the card's memory)
            guarantee, limit = memory_bounds(self._device(uuid))
            room = min(guarantee, limit) - self.book.total(uuid)  # never beyond the guarantee
            if need <= room:
                granted = min(max(want, need), room)
                self.book.grant(peer.conn, uuid, granted)
                self._held_changed(uuid)
                return granted
        self.refused_borrow += last.refusal is Refusal.BORROW and uuid != LEASE_SPILL_NAME
        return 0

    def _recall(self, peer: Peer, uuid: str) -> list[Peer]:
        """Ask every other process of this container holding `uuid` to give back what it has
        not charged ("C"); the peers asked."""
        others = [p for p in self.peers.values()
                  if p is not peer and self.book.held.get(p.conn, {}).get(uuid)]  # fmt: skip
        for p in others:
            p.recalls += 1
            p.freed = False
            p.writer.write(b"C\n")
        return others

    def recall_all(self, uuid: str) -> int:
        """Recall every process's unused lease of `uuid` (a neighbour's guarantee is due)."""
        n = 0
        for p in self.peers.values():
            if self.book.held.get(p.conn, {}).get(uuid):
                p.recalls += 1
                p.freed = False
                p.writer.write(b"C\n")
                n += 1
        return n

    def recall_freed(self, uuid: str) -> None:
        """Recall the processes holding `uuid` that freed since their last recall (see
        LeaseService.recall_freed)."""
        for p in self.peers.values():
            if p.freed and p.recalls == 0 and self.book.held.get(p.conn, {}).get(uuid):
                p.recalls += 1
                p.freed = False
                p.writer.write(b"C\n")
