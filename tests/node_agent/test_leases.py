"""The lease service (services/node-agent/leases.py) over its real unix socket: the container's
account lives here, so what a process may charge is what this service leased it, never more than
the sealed limit in total; a dead connection's leases come back; other holders are recalled."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
from tessera.node_agent.containers import ContainerDir, ContainerStore, PreparedContainer
from tessera.node_agent.leases import (
    ContainerLeases,
    LeaseBook,
    LeaseService,
    ProtocolError,
    parse_line,
)

from tessera import region
from tessera.region import (
    LEASE_SOCKET_NAME,
    LEASE_SPILL_NAME,
    ContainerLimits,
    DeviceLimit,
    seal_limits,
)

MiB = 1 << 20
GPU = "GPU-aaaa"
LIMIT = 1024 * MiB


def test_book_never_grants_past_the_limit() -> None:
    book = LeaseBook()
    assert book.acquire(1, GPU, 600 * MiB, 640 * MiB, LIMIT) == 640 * MiB
    assert book.acquire(2, GPU, 400 * MiB, 448 * MiB, LIMIT) == 0
    # only 384 MiB are left: a want above is clipped, a need above is refused
    assert book.acquire(2, GPU, 100 * MiB, 512 * MiB, LIMIT) == 384 * MiB
    assert book.acquire(3, GPU, 1, 1, LIMIT) == 0
    book.release(1, GPU, 10 * MiB)
    assert book.total(GPU) == LIMIT - 10 * MiB
    book.release(1, GPU, 1 << 62)  # more than held: nothing negative
    assert book.total(GPU) == 384 * MiB
    book.declare(4, GPU, 2048 * MiB)  # already allocated (agent restart): recorded
    assert book.acquire(5, GPU, 1, 1, LIMIT) == 0
    assert book.acquire(1, "GPU-other", 1, 1, 0) == 0  # not the container's GPU


@pytest.mark.parametrize("line", [
    b"X GPU 1\n", b"D 1\n", b"A GPU 1\n", b"A GPU -1 2\n", b"R GPU 1 2\n",
    b"A GPU 1 99999999999999999999\n", b"\xff\n", b"\n",
])  # fmt: skip
def test_malformed_requests_are_refused(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_line(line)


class Client:
    """What libvgpu does on the socket, spoken by hand."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w

    @classmethod
    async def connect(cls, path: Path) -> Client:
        r, w = await asyncio.open_unix_connection(str(path))
        return cls(r, w)

    async def ask(self, need: int, want: int, uuid: str = GPU) -> int:
        self.w.write(f"A {uuid} {need} {want}\n".encode())
        await self.w.drain()
        while True:
            line = await asyncio.wait_for(self.r.readline(), 10)
            if line.startswith(b"G "):
                return int(line[2:])
            if line == b"N\n":
                return 0
            assert line == b"C\n", line

    async def give(self, n: int, uuid: str = GPU) -> None:
        self.w.write(f"R {uuid} {n}\n".encode())
        await self.w.drain()

    async def close(self) -> None:
        self.w.close()
        await self.w.wait_closed()


async def until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def _served(tmp_path: Path, limit: int = LIMIT) -> tuple[ContainerStore, LeaseService, Path]:
    store = ContainerStore(tmp_path / "regions" / ("x" * 60))  # a host path too long to bind
    cdir = store.prepare(PreparedContainer(
        pod_uid="0b6a7c3e-2f1d-4e5a-9b8c-7d6e5f4a3b2c", namespace="ns", pod="p",
        container="c" * 40, index=0, device_ids=["GPU-aaaa::0"], grants=[],
    ))  # fmt: skip
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit(GPU, limit),), lease=True))
    return store, LeaseService(store.all), cdir.limits_dir / LEASE_SOCKET_NAME


async def test_a_container_prepared_while_the_service_syncs_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Allocate prepares a directory in a worker thread while the lease service sweeps the
    store in the event loop: a sweep that lands mid-preparation must not count the preparation
    as seen, or the container's socket never opens and libvgpu, finding no service, is refused
    every allocation (the slice unusable, not enforced)."""
    store = ContainerStore(tmp_path / "regions")
    service = LeaseService(store.all, version=lambda: store.version)
    await service.sync()
    inside, go = threading.Event(), threading.Event()
    real = region.prepare_region_file

    def held(path: Path, mode: int = 0o666) -> None:
        inside.set()
        assert go.wait(10)
        real(path, mode)

    monkeypatch.setattr(region, "prepare_region_file", held)
    done: list[ContainerDir] = []
    worker = threading.Thread(target=lambda: done.append(store.prepare(PreparedContainer(
        pod_uid="5d1e2a3b-4c5d-4e6f-8a9b-0c1d2e3f4a5b", namespace="ns", pod="p", container="c",
        index=0, device_ids=["GPU-aaaa::0"], grants=[]))))  # fmt: skip
    worker.start()
    assert await asyncio.to_thread(inside.wait, 10)
    await service.sync()  # the sweep Allocate's preparation raced
    go.set()
    await asyncio.to_thread(worker.join, 10)
    [cdir] = done
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit(GPU, LIMIT),), lease=True))
    for _ in range(3):  # the sweeps of the next 0.6 s (SYNC_S)
        await service.sync()
    sock = cdir.limits_dir / LEASE_SOCKET_NAME
    assert sock.is_socket(), "the prepared container is never served"
    link = tmp_path / "l"
    link.symlink_to(sock.parent)
    client = await Client.connect(link / LEASE_SOCKET_NAME)
    assert await client.ask(300 * MiB, 320 * MiB) == 320 * MiB
    await client.close()
    await service.close()


async def test_a_directory_that_cannot_be_served_does_not_hold_up_its_seal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ready` answers at once when the sweep could not open the socket (logged there), instead
    of holding kubelet's call (and the plugin's lock) for its whole wait."""
    _store, service, sock = _served(tmp_path)

    async def cannot(self: ContainerLeases) -> None:
        raise OSError("no room for a socket")

    monkeypatch.setattr(ContainerLeases, "start", cannot)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert not await service.ready(sock.parent, timeout_s=30)
    assert loop.time() - began < 5
    monkeypatch.undo()
    assert await service.ready(sock.parent)  # the next try serves it
    assert sock.is_socket()
    await service.close()


async def test_leases_over_the_socket(tmp_path: Path) -> None:
    _store, service, sock = _served(tmp_path)
    await service.sync()
    assert len(str(sock)) > 108 and sock.is_socket()
    assert oct(sock.stat().st_mode & 0o777) == "0o666"
    (leases,) = service.served.values()
    # the socket cannot be reached by its long host path; a short link to its directory can
    link = tmp_path / "l"
    link.symlink_to(sock.parent)
    a = await Client.connect(link / LEASE_SOCKET_NAME)
    b = await Client.connect(link / LEASE_SOCKET_NAME)
    await until(lambda: len(leases.peers) == 2)
    assert service.attested() == {os.getpid(): leases.pod_uid}  # SO_PEERCRED: this process
    assert await a.ask(600 * MiB, 640 * MiB) == 640 * MiB
    assert await b.ask(385 * MiB, 448 * MiB) == 0  # 384 MiB left; a holds no unused lease
    assert await b.ask(384 * MiB, 448 * MiB) == 384 * MiB
    assert leases.leased(GPU) == LIMIT
    assert await b.ask(1, 1, uuid="GPU-not-mine") == 0
    # a dies: its leases come back at once
    await a.close()
    await until(lambda: leases.leased(GPU) == 384 * MiB)
    c = await Client.connect(link / LEASE_SOCKET_NAME)
    assert await c.ask(640 * MiB, 700 * MiB) == 640 * MiB
    await b.close()
    await c.close()
    await service.close()
    assert not sock.exists()


async def test_a_refused_request_recalls_unused_leases(tmp_path: Path) -> None:
    _store, service, sock = _served(tmp_path)
    await service.sync()
    (leases,) = service.served.values()
    path = tmp_path / "l"
    path.symlink_to(sock.parent)
    holder = await Client.connect(path / LEASE_SOCKET_NAME)
    assert await holder.ask(512 * MiB, LIMIT) == LIMIT  # holds all, uses half

    async def answer_recall() -> None:  # libvgpu's poll thread: give back what it does not use
        line = await asyncio.wait_for(holder.r.readline(), 10)
        assert line == b"C\n"
        await holder.give(512 * MiB)
        holder.w.write(b"D\n")

    recall = asyncio.create_task(answer_recall())
    other = await Client.connect(path / LEASE_SOCKET_NAME)
    assert await other.ask(500 * MiB, 512 * MiB) == 512 * MiB
    await recall
    assert leases.leased(GPU) == LIMIT
    # the holder answers having nothing to give: refused at once, never above the limit
    async def answer_empty() -> None:
        assert await asyncio.wait_for(holder.r.readline(), 10) == b"C\n"
        holder.w.write(b"D\n")

    empty = asyncio.create_task(answer_empty())
    t0 = asyncio.get_running_loop().time()
    assert await other.ask(1, 1) == 0
    await empty
    assert asyncio.get_running_loop().time() - t0 < 0.4  # not the whole recall wait
    assert leases.leased(GPU) == LIMIT
    # a holder that never answers: refused after the recall's wait
    assert await other.ask(1, 1) == 0
    assert leases.leased(GPU) == LIMIT
    await holder.close()
    await other.close()
    await service.close()


async def test_bad_input_closes_only_that_connection(tmp_path: Path) -> None:
    _store, service, sock = _served(tmp_path)
    await service.sync()
    (leases,) = service.served.values()
    path = tmp_path / "l"
    path.symlink_to(sock.parent)
    good = await Client.connect(path / LEASE_SOCKET_NAME)
    assert await good.ask(64 * MiB, 64 * MiB) == 64 * MiB
    bad = await Client.connect(path / LEASE_SOCKET_NAME)
    assert await bad.ask(64 * MiB, 64 * MiB) == 64 * MiB
    bad.w.write(b"A " + b"x" * 4096 + b"\n")
    await bad.w.drain()
    assert await asyncio.wait_for(bad.r.read(), 10) == b""  # closed
    await until(lambda: leases.leased(GPU) == 64 * MiB)
    assert await good.ask(64 * MiB, 64 * MiB) == 64 * MiB
    await good.close()
    await service.close()


async def test_limits_follow_the_sealed_file(tmp_path: Path) -> None:
    store, service, _sock = _served(tmp_path)
    await service.sync()
    (cdir,) = store.all()
    leases: ContainerLeases = service.for_key(cdir.key)
    assert leases.limit(GPU) == LIMIT
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit(GPU, 2 * LIMIT),),
                                                 lease=True))  # fmt: skip
    assert leases.limit(GPU) == 2 * LIMIT
    store.remove_container(cdir)
    await service.sync()
    assert service.served == {}


async def test_spill_is_leased_up_to_the_sealed_bound_and_never_lent(tmp_path: Path) -> None:
    """Spill (host memory, `spill_bytes`) is leased under its own name, exactly, up to the
    sealed bound for the container's processes together; none without a sealed bound; a dead
    process's spill comes back; the GPU's account is untouched."""
    store, service, _sock = _served(tmp_path)
    (cdir,) = store.all()
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit(GPU, LIMIT),), lease=True,
                                                 spill_bytes=100 * MiB))  # fmt: skip
    await service.sync()
    (leases,) = service.served.values()
    link = tmp_path / "l"
    link.symlink_to(cdir.limits_dir)
    a = await Client.connect(link / LEASE_SOCKET_NAME)
    b = await Client.connect(link / LEASE_SOCKET_NAME)
    assert await a.ask(60 * MiB, 60 * MiB, uuid=LEASE_SPILL_NAME) == 60 * MiB
    assert await b.ask(41 * MiB, 41 * MiB, uuid=LEASE_SPILL_NAME) == 0  # 40 MiB left
    assert await b.ask(40 * MiB, 64 * MiB, uuid=LEASE_SPILL_NAME) == 40 * MiB
    assert leases.leased(LEASE_SPILL_NAME) == 100 * MiB and leases.leased(GPU) == 0
    assert await b.ask(1, 1, uuid=LEASE_SPILL_NAME) == 0
    assert leases.refused_borrow == 0  # not a borrow beyond a GPU guarantee
    await a.close()  # its process died: its spill comes back
    await until(lambda: leases.leased(LEASE_SPILL_NAME) == 40 * MiB)
    await b.give(40 * MiB, uuid=LEASE_SPILL_NAME)
    await until(lambda: leases.leased(LEASE_SPILL_NAME) == 0)
    # sealed without a spill bound (or without leases): no spill at all
    for limits in (ContainerLimits(devices=(DeviceLimit(GPU, LIMIT),), lease=True),
                   ContainerLimits(devices=(DeviceLimit(GPU, LIMIT),), spill_bytes=100 * MiB)):
        seal_limits(cdir.limits_dir, limits)
        assert await b.ask(1, 1, uuid=LEASE_SPILL_NAME) == 0
    await b.close()
    await service.close()


def test_the_spilled_figure_counts_what_the_lease_service_leased(tmp_path: Path) -> None:
    """/metrics' spilled host memory of a container: the larger of its spill lease (the account
    a tenant cannot write) and its region's counter (which a tenant may zero)."""
    from dataclasses import dataclass

    from tessera.node_agent.spill_metrics import spill_totals

    @dataclass
    class Sealed:  # what is read of a prepared container
        limits_dir: Path
        region_file: Path
        key: str

    c = Sealed(tmp_path, tmp_path / "usage", "pod/main")  # no region file: the tenant's zeroed
    seal_limits(tmp_path, ContainerLimits(devices=(DeviceLimit(GPU, LIMIT),), lease=True,
                                          spill_bytes=100 * MiB))  # fmt: skip
    assert spill_totals([c]) == (100 * MiB, 0, 1)  # the region alone: nothing to see
    leased = {"pod/main": 60 * MiB}
    assert spill_totals([c], lambda key: leased.get(key, 0)) == (100 * MiB, 60 * MiB, 1)
