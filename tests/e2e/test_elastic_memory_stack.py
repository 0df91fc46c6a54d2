"""Elastic memory through the whole local stack (issue 33): admission, the scheduler, kube-sim's
kubelet and the node agent (its device plugin, sealing and lease service) as they run.

A pod guaranteed 4 GiB with a 12 GiB limit (`tessera.io/gpumem-reclaim: evict`) on a node with
one 16 GiB GPU: the scheduler records the burst limit on the bound pod, the agent seals
guarantee + burst limit, and the container's lease socket leases it 12 GiB (spoken as libvgpu
speaks it). A guaranteed neighbour (8 GiB) is then placed on the 12 GiB the guarantees leave, and
asks for its memory: the agent evicts the borrower through the Eviction API with a Warning event
on it, and the neighbour's lease is granted once the borrower is gone. A bad burst annotation is
denied at admission.

A borrower that did not opt in (policy `fail`) and keeps the memory is evicted by the node's
enforcement (TESSERA_MEMORY_RECLAIM_ENFORCEMENT=evict, the default) after the grace bound, with
the same Warning and a `MemoryReclaimEvent` (`by_node`) on the bus."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera import bus, elastic, region
from tessera.bus import connect
from tessera.codec import decode
from tessera.models import MemoryReclaimEvent
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE = "elastic-a"
NODES = [SimNode(name=NODE, gpus=1, gpu_memory_mib=16384, gpu_model="NVIDIA A10")]
GiB = 1 << 30


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    env = {"TESSERA_MEMORY_EVICT_GRACE_S": "0", "TESSERA_MEMORY_RECLAIM_WAIT_S": "90",
           "TESSERA_MEMORY_RECLAIM_GRACE_S": "2"}
    yield from start_stack(NODES, env=env)


def limits_dir(sim: RunningStack, uid: str) -> Path:
    """The container's sealed limits directory on the node, through a short link (a socket's
    path must stay under 108 bytes)."""
    real = sim.stack.state_dir / "regions" / NODE / uid / "0-main" / "limits"
    link = Path(tempfile.mkdtemp(prefix="el-")) / "l"
    link.symlink_to(real)
    return link


async def served(sock: Path) -> Path:
    """The socket once the agent serves it (its lease service syncs every 0.2 s; libvgpu waits
    for it at start-up the same way)."""
    for _ in range(600):
        if sock.exists():
            return sock
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sock} never served")


async def ask(sock: Path, need: int, timeout: float = 120) -> int:
    """One lease request as libvgpu makes it: G <bytes>, or 0 for N; W lines are read past."""
    r, w = await asyncio.open_unix_connection(str(sock))
    try:
        w.write(f"A {gpu_uuid(NODE, 0)} {need} {need}\n".encode())
        await w.drain()
        while True:
            line = await asyncio.wait_for(r.readline(), timeout)
            if line.startswith(b"G "):
                return int(line[2:])
            if line in (b"N\n", b""):
                return 0
            if line == b"C\n":
                w.write(b"D\n")
                await w.drain()
    finally:
        w.close()


def test_a_burst_pod_borrows_and_is_evicted_for_a_guarantee(sim: RunningStack,
                                                           namespace: str) -> None:
    kube = sim.kube
    borrower = gpu_pod("burst", mem=4096, cores=20, node=NODE, annotations={
        elastic.ANN_GPUMEM_LIMIT: "12288", elastic.ANN_GPUMEM_RECLAIM: "evict"})
    assert kube.create_pod(borrower, namespace).status_code == 201
    bound = kube.wait_running(namespace, "burst", timeout_s=60)
    uid = bound["metadata"]["uid"]
    record = bound["metadata"]["annotations"][elastic.ANN_BURST_ALLOCATED]
    assert record == f"{gpu_uuid(NODE, 0)},12288,0:;"
    d = limits_dir(sim, uid)
    sealed = region.read_limits(d)
    assert sealed is not None and sealed.lease
    (dev,) = sealed.devices
    assert (dev.mem_limit_bytes, dev.mem_burst_limit_bytes) == (4 * GiB, 12 * GiB)

    async def scenario() -> int:
        # the borrower's process holds its connection (and 12 GiB) until it is evicted
        r, w = await asyncio.open_unix_connection(str(await served(d / region.LEASE_SOCKET_NAME)))
        w.write(f"A {gpu_uuid(NODE, 0)} {12 * GiB} {12 * GiB}\n".encode())
        await w.drain()
        assert await asyncio.wait_for(r.readline(), 30) == f"G {12 * GiB}\n".encode()
        neighbour = gpu_pod("guaranteed", mem=8192, cores=20, node=NODE)
        assert kube.create_pod(neighbour, namespace).status_code == 201
        placed = await asyncio.to_thread(kube.wait_running, namespace, "guaranteed", 60)
        n = await served(limits_dir(sim, placed["metadata"]["uid"]) / region.LEASE_SOCKET_NAME)
        try:
            return await ask(n, 8 * GiB)  # waits for the eviction
        finally:
            w.close()

    assert asyncio.run(scenario()) == 8 * GiB

    def evicted() -> bool:
        pods = {p["metadata"]["name"] for p in kube.pods(namespace)}
        return "burst" not in pods

    kube.wait_for("the borrower evicted", evicted, 60)
    events = kube.http.get(f"/api/v1/namespaces/{namespace}/events").json()["items"]
    reasons = {e["reason"] for e in events if e["involvedObject"]["name"] == "burst"}
    assert "GpuMemoryBorrowerEvicted" in reasons, reasons
    kube.delete_namespace_pods(namespace)  # the card free again for the next test


async def hold(sock: Path, need: int, deadline_s: float = 90):
    """A borrower's process: leases `need` (asking again while a previous test's pods are still
    booked on the card) and keeps the connection; answers recalls with nothing unused."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        r, w = await asyncio.open_unix_connection(str(sock))
        w.write(f"A {gpu_uuid(NODE, 0)} {need} {need}\n".encode())
        await w.drain()
        line = await asyncio.wait_for(r.readline(), 30)
        if line == f"G {need}\n".encode():
            return r, w
        w.close()
        assert loop.time() < end, f"never leased {need} bytes: {line!r}"
        await asyncio.sleep(0.5)


def test_a_borrower_that_keeps_the_memory_is_evicted_by_the_node(sim: RunningStack,
                                                                namespace: str) -> None:
    kube = sim.kube
    borrower = gpu_pod("keeper", mem=4096, cores=20, node=NODE, annotations={
        elastic.ANN_GPUMEM_LIMIT: "12288"})  # policy fail: it never opted in to eviction
    assert kube.create_pod(borrower, namespace).status_code == 201
    uid = kube.wait_running(namespace, "keeper", timeout_s=60)["metadata"]["uid"]
    d = limits_dir(sim, uid)

    async def scenario() -> tuple[int, list[MemoryReclaimEvent]]:
        nc = await connect(sim.stack.nats_settings(), name="e2e-elastic", initial_attempts=5)
        js = nc.jetstream()
        subject = bus.memory_event_subject(NODE, "reclaimed").rsplit(".", 1)[0] + ".>"
        sub = await js.subscribe(subject, ordered_consumer=True)
        _r, w = await hold(await served(d / region.LEASE_SOCKET_NAME), 12 * GiB)
        try:
            neighbour = gpu_pod("promised", mem=8192, cores=20, node=NODE)
            assert kube.create_pod(neighbour, namespace).status_code == 201
            placed = await asyncio.to_thread(kube.wait_running, namespace, "promised", 60)
            n = await served(limits_dir(sim, placed["metadata"]["uid"]) / region.LEASE_SOCKET_NAME)
            granted = await ask(n, 8 * GiB)  # waits past the grace bound for the eviction
            events = []
            while len(events) < 2:  # this borrower's (an earlier test's are on the stream)
                event = decode((await sub.next_msg(timeout=30)).data, MemoryReclaimEvent)
                if event.pod_uid == uid:
                    events.append(event)
            return granted, events
        finally:
            w.close()
            await nc.close()

    granted, events = asyncio.run(scenario())
    assert granted == 8 * GiB
    assert [(e.action, e.by_node, e.pod_uid) for e in events] == [
        ("reclaimed", False, uid), ("evicted", True, uid)]
    kube.wait_for("the borrower evicted",
                  lambda: "keeper" not in {p["metadata"]["name"] for p in kube.pods(namespace)},
                  60)  # fmt: skip
    events = kube.http.get(f"/api/v1/namespaces/{namespace}/events").json()["items"]
    messages = [e["message"] for e in events if e["involvedObject"]["name"] == "keeper"
                and e["reason"] == "GpuMemoryBorrowerEvicted"]  # fmt: skip
    assert messages and "did not give it back" in messages[0], messages
    kube.delete_namespace_pods(namespace)


def test_a_bad_limit_is_denied(sim: RunningStack, namespace: str) -> None:
    pod = gpu_pod("low", mem=4096, node=NODE, annotations={elastic.ANN_GPUMEM_LIMIT: "1024"})
    reply = sim.kube.create_pod(pod, namespace)
    assert reply.status_code in (400, 403), reply.text
    assert "below its guaranteed memory" in reply.text
