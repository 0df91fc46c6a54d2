"""Elastic memory through the whole local stack (issue 33): admission, the scheduler, kube-sim's
kubelet and the node agent (its device plugin, sealing and lease service) as they run.

A pod guaranteed 4 GiB with a 12 GiB limit (`tessera.io/gpumem-reclaim: evict`) on a node with
one 16 GiB GPU: the scheduler records the burst limit on the bound pod, the agent seals
guarantee + burst limit, and the container's lease socket leases it 12 GiB (spoken as libvgpu
speaks it). A guaranteed neighbour (8 GiB) is then placed on the 12 GiB the guarantees leave, and
asks for its memory: the agent evicts the borrower through the Eviction API with a Warning event
on it, and the neighbour's lease is granted once the borrower is gone. A bad burst annotation is
denied at admission."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera import elastic, region
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE = "elastic-a"
NODES = [SimNode(name=NODE, gpus=1, gpu_memory_mib=16384, gpu_model="NVIDIA A10")]
GiB = 1 << 30


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    env = {"TESSERA_MEMORY_EVICT_GRACE_S": "0", "TESSERA_MEMORY_RECLAIM_WAIT_S": "90"}
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


def test_a_bad_limit_is_denied(sim: RunningStack, namespace: str) -> None:
    pod = gpu_pod("low", mem=4096, node=NODE, annotations={elastic.ANN_GPUMEM_LIMIT: "1024"})
    reply = sim.kube.create_pod(pod, namespace)
    assert reply.status_code in (400, 403), reply.text
    assert "below its guaranteed memory" in reply.text
