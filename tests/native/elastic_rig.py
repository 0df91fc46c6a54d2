"""A node with one fake GPU for elastic memory (issue 33), shared by tests/native/
test_elastic_memory.py and bench/libvgpu_elastic_memory.py: the node agent's real container
layout (`ContainerStore.prepare`, `handshake.limits_for` + `seal_limits` from a pod's grant), its
real lease service (services/node-agent/leases.py) with the card's physical memory, and driver-API
programs (cuctl) under libvgpu on the fake driver, whose physical memory is shared by every
process (FAKE_CUDA_STATE) — so "the neighbour gets its memory" is the fake card's truth.

Eviction (a borrower that opted in) is done as kubelet would after the agent's eviction: the
pod's processes are killed (SIGKILL), their lease connections close, the driver frees what they
held."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.node_agent import handshake
from tessera.node_agent.containers import ContainerStore, PreparedContainer
from tessera.node_agent.leases import LeaseService, ReclaimNotice

from tessera import region
from tessera.models import Allocation, DeviceGrant
from tessera.settings import TesseraSettings

from .conftest import Cuctl, NativeBuild, base_env

MiB = 1 << 20
GiB = 1 << 30
GPU0 = "GPU-fa4e0000-0000-0000-0000-000000000000"  # the fake driver's device 0


class ElasticPod:
    def __init__(self, node: ElasticNode, uid: str, name: str, alloc: Allocation) -> None:
        self.node, self.uid, self.name = node, uid, name
        settings = TesseraSettings()
        self.cdir = node.store.prepare(PreparedContainer(
            pod_uid=uid, namespace="ns", pod=name, container="main", index=0,
            device_ids=[f"{GPU0}::0"], grants=alloc.containers[0],
            memory_reclaim=alloc.memory_reclaim, memory_wait_s=alloc.memory_wait_s,
        ))  # fmt: skip
        sealed = handshake.limits_for(alloc, 0, settings)
        # the region as the process sees it: here the host path (no mount namespace)
        sealed = dataclasses.replace(sealed, region_path=str(self.cdir.region_file))
        region.seal_limits(self.cdir.limits_dir, sealed)
        self.procs: list[Cuctl] = []

    def env(self) -> dict[str, str]:
        env = base_env()
        env.update(LD_LIBRARY_PATH=str(self.node.native.fake), LD_PRELOAD=self.node.native.preload,
                   FAKE_CUDA_STATE=str(self.node.gpu_state), FAKE_GPU_COUNT="1",
                   FAKE_GPU_MEM_MB=str(self.node.card_mib),
                   # INFO: a failure's log tells a lease refused from the driver's OOM
                   LIBCUDA_LOG_LEVEL=os.environ.get("ELASTIC_LOG", "2"),
                   TESSERA_LIMITS_DIR=str(self.cdir.limits_dir))  # fmt: skip
        if self.node.native.san:
            env["ASAN_OPTIONS"] = "detect_leaks=0"
        return env

    def cuctl(self, **extra: str) -> Cuctl:
        """A process of the pod; `extra`: more environment (e.g. the fake driver's knobs)."""
        c = Cuctl(self.node.native.bin / "cuctl", self.env() | extra,
                  self.node.base / f"{self.name}-{len(self.procs)}.stderr")  # fmt: skip
        self.procs.append(c)
        assert c("init")["ok"], c.stderr()
        return c

    def kill(self) -> None:
        for c in self.procs:
            if c.p.poll() is None:
                os.kill(c.pid, signal.SIGKILL)
                c.p.wait(timeout=30)


class ElasticNode:
    """The lease service on its own event loop (a thread), with a card of `card_mib`."""

    def __init__(self, native: NativeBuild, base: Path, card_mib: int = 16384,
                 reclaim_wait_s: float = 20.0, **service: Any) -> None:  # fmt: skip
        """`service`: more of LeaseService's settings (the node's `enforcement`,
        `reclaim_grace_s`)."""
        self.native, self.base, self.card_mib = native, base, card_mib
        self.gpu_state = base / "gpu"
        self.store = ContainerStore(base / "r")
        self.store.ensure_root()
        self.pods: dict[str, ElasticPod] = {}
        self.notices: list[tuple[float, ReclaimNotice]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = LeaseService(
            self.store.all, logging.getLogger("elastic-rig"),
            card_memory=lambda u: card_mib * MiB if u == GPU0 else 0,
            on_reclaim=self._on_reclaim, reclaim_wait_s=reclaim_wait_s,
            **service)  # fmt: skip

    def _on_reclaim(self, notice: ReclaimNotice) -> None:
        self.notices.append((self.loop.time(), notice))
        if notice.action == "evicted":  # kubelet ends the evicted pod's processes
            pod = self.pods.get(notice.borrower.pod_uid)
            if pod is not None:
                threading.Thread(target=pod.kill, daemon=True).start()

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def pod(self, uid: str, name: str, guarantee_mib: int, limit_mib: int = 0,
            reclaim: str = "fail", wait_s: float = 0.0) -> ElasticPod:  # fmt: skip
        grant = DeviceGrant(uuid=GPU0, type="FAKE", memory_mib=guarantee_mib, cores=100,
                            memory_limit_mib=limit_mib)  # fmt: skip
        alloc = Allocation(pod_uid=uid, namespace="ns", name=name, node="n",
                           containers=[[grant]], container_names=["main"],
                           memory_reclaim=reclaim, memory_wait_s=wait_s)  # fmt: skip
        pod = ElasticPod(self, uid, name, alloc)
        self.pods[uid] = pod
        self.call(self.service.sync())
        return pod

    def book(self, guarantees_mib: dict[str, int]) -> None:
        """The node's ledger books these pods (uid -> MiB guaranteed on the card), as
        ledger_guarantees.LedgerGuarantees hands it to the lease service."""
        async def set_booked() -> None:
            self.service.set_booked({GPU0: {u: m * MiB for u, m in guarantees_mib.items()}})

        self.call(set_booked())

    def held(self, pod: ElasticPod) -> tuple[int, int]:
        """(leased, borrowed) bytes of the pod's container on the card."""
        async def get() -> tuple[int, int]:
            c = self.service.for_key(f"{pod.uid}/0")
            h = c.holder(GPU0) if c else None
            return (h.leased, h.borrowed) if h else (0, 0)

        return self.call(get())

    def diagnosis(self, *procs: Cuctl) -> str:
        """For a failed expectation: the notices (s since the first), what each pod's container
        holds on lease, the card's physical use (the fake driver's), and each process's exit
        status and libvgpu log."""
        t0 = self.notices[0][0] if self.notices else 0.0
        out = [f"notices: {[(round(t - t0, 2), x.action, x.by_node) for t, x in self.notices]}"]
        out += [f"{p.name}: (leased, borrowed) {self.held(p)}" for p in self.pods.values()]
        live = next((c for p in self.pods.values() for c in p.procs if c.p.poll() is None), None)
        if live is not None:
            with contextlib.suppress(Exception):
                out.append(f"card physical use {live('phys', timeout=5)['phys']}")
        for c in procs:
            out.append(f"pid {c.pid} exit {c.p.poll()}, log:\n{c.stderr()[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for pod in self.pods.values():
            for c in pod.procs:
                c.close(check=False)
        self.call(self.service.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@contextlib.contextmanager
def running_node(native: NativeBuild, **settings: Any) -> Iterator[ElasticNode]:
    """An ElasticNode (`settings`: ElasticNode's) in a fresh short directory, stopped and removed
    after: the `node` fixture of tests/native/conftest.py, and tests that need other settings."""
    base = Path(tempfile.mkdtemp(prefix="eln-"))  # lease socket paths stay under 108 bytes
    n = ElasticNode(native, base, **settings)
    try:
        yield n
    finally:
        n.stop()
        shutil.rmtree(base, ignore_errors=True)
