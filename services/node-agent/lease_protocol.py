"""The lease protocol's pure parts: the account (`LeaseBook`), one connection (`Peer`), and
reading a request line. The protocol itself is in native/libvgpu/include/tessera_region.h and
services/node-agent/leases.py."""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field

MAX_CONNECTIONS = 1024  # per container (libvgpu's process slots)
MAX_LINE = 256
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
        """Record `n` bytes leased (the caller judged them: `memory_lending.offer`)."""
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
    freed: bool = False  # it gave back unasked since its last recall (libvgpu keeps a chunk)


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
