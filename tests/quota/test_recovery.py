"""Usage stays true to the ledger across crashes: a charge nobody will release is dropped, a
held allocation whose charge was lost gets it back, and nothing is counted twice."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from quota_testkit import call, eventually, unique_namespace

from tessera import bus
from tessera.bus import Buckets, connect, ensure_bus
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    DeviceGrant,
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.settings import NatsSettings, TesseraSettings


def allocation(ns: str, node: str, uid: str, mem: int, state: AllocationState) -> Allocation:
    grant = DeviceGrant(uuid=f"GPU-{node}", type="NVIDIA-A100", memory_mib=mem, cores=10)
    return Allocation(pod_uid=uid, namespace=ns, name=f"pod-{uid}", node=node,
                      containers=[[grant]], state=state, quota_held=True)


async def put_allocation(buckets: Buckets, alloc: Allocation) -> None:
    def mutate(ledger: NodeLedger | None) -> NodeLedger:
        ledger = ledger.model_copy(deep=True) if ledger else NodeLedger(node=alloc.node)
        ledger.allocations[alloc.pod_uid] = alloc
        return ledger

    await bus.cas_update(buckets.ledger, alloc.node, NodeLedger, mutate)


def reserve(ns: str, uid: str, mem: int) -> QuotaRequest:
    return QuotaRequest(namespace=ns, pod_uid=uid, memory_mib=mem, cores=10, gpus=1)


async def charges(nc, ns: str) -> dict:
    reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert isinstance(reply, QuotaReply), reply
    return reply.states[0].charges


async def test_periodic_reconcile_drops_leaked_charges_and_restores_lost_ones(
    start_quota, nc, buckets
):
    settings = TesseraSettings(
        reservation_ttl_s=0.3, quota_grace_margin_s=0.2, quota_reconcile_interval_s=0.2
    )
    await start_quota(settings)
    ns, node = unique_namespace(), f"node-{uuid.uuid4().hex[:8]}"
    limits = QuotaAmount(memory_mib=3000)
    await call(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=limits))
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "live", 1000))).ok
    await put_allocation(buckets, allocation(ns, node, "live", 1000, AllocationState.BOUND))
    # Reserved, then the scheduler died before recording the allocation: nobody will release it.
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "leaked", 1000))).ok
    # Held in the ledger, but its charge is gone (e.g. the quota entry was lost).
    await put_allocation(buckets, allocation(ns, node, "lost", 700, AllocationState.ALLOCATED))

    async def settled() -> bool:
        return set(await charges(nc, ns)) == {"live", "lost"}

    await eventually(settled)
    held = await charges(nc, ns)
    assert held["lost"].memory_mib == 700 and held["live"].memory_mib == 1000
    # 1000 + 700 held: 1300 more fits exactly, 1 MiB beyond does not.
    assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "next", 1300))).ok
    assert not (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "one-more", 1))).ok


async def wait_serving(nc, ns: str, timeout: float = 20.0) -> None:
    async def answers() -> bool:
        try:
            reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns), timeout=1)
        except Exception:
            return False
        return reply is not None

    await eventually(answers, timeout=timeout, interval=0.1)


def start_process(url: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "NATS_"))},
        "NATS_URL": url,
        "TESSERA_CLUSTER": "none",
        "TESSERA_RESERVATION_TTL_S": "0.5",
        "TESSERA_QUOTA_GRACE_MARGIN_S": "0.5",
        "TESSERA_QUOTA_RECONCILE_INTERVAL_S": "60",  # only the start-up pass counts here
    }
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.quota"], env=env, stdout=log, stderr=subprocess.STDOUT
    )


async def test_kill_between_reserve_and_release_neither_leaks_nor_double_counts(fresh_nats):
    """SIGKILL the service with reservations outstanding; while it is down one pod ends and
    another's charge is lost. The next start converges to exactly what the ledger holds."""
    log_path = Path(tempfile.mkdtemp(prefix="tq-")) / "quota.log"
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="recovery-test")
    proc = start_process(fresh_nats.url, log_path)
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        ns, node = unique_namespace(), "node-a"
        await wait_serving(nc, ns)
        limits = QuotaAmount(memory_mib=3000)
        await call(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=limits))
        for uid in ("live", "ended", "crashed"):
            assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, uid, 1000))).ok
        for uid in ("live", "ended"):  # the scheduler recorded these; not "crashed"
            await put_allocation(buckets, allocation(ns, node, uid, 1000, AllocationState.BOUND))
        assert not (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "new", 1))).ok

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

        # While it is down: "ended" finishes (ledger + event), "orphan" is held in the ledger but
        # its charge never made it to the quota state.
        await put_allocation(buckets, allocation(ns, node, "ended", 1000, AllocationState.RELEASED))
        await bus.publish_event(nc.jetstream(), AllocationEvent(
            action="released", node=node, pod_uid="ended", namespace=ns, name="pod-ended"))
        await put_allocation(buckets, allocation(ns, node, "orphan", 500, AllocationState.BOUND))
        await asyncio.sleep(1.1)  # the crashed reservation outlives its grace (0.5 + 0.5 s)

        started = time.monotonic()
        proc = start_process(fresh_nats.url, log_path)
        await wait_serving(nc, ns)

        async def converged() -> bool:
            return set(await charges(nc, ns)) == {"live", "orphan"}

        await eventually(converged, timeout=10)
        # Before the first periodic pass could run (60 s after the start): the start-up pass
        # converged. (It was `< 15` from before the process start, which a busy host's imports
        # alone can take most of, while wait_serving allows 20 s.)
        assert time.monotonic() - started < 60
        held = await charges(nc, ns)
        assert sum(c.memory_mib for c in held.values()) == 1500
        assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "new", 1500))).ok
        assert not (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "newer", 1))).ok
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await nc.close()


async def test_the_service_comes_back_after_a_broker_crash(fresh_nats):
    """nats-server is SIGKILLed and restarted: held quota survives, the service answers again
    and still frees quota on release events (its durable consumer resumes)."""
    from tessera.quota import QuotaService

    settings = TesseraSettings()
    service_nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="quota-under-test")
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="client")
    service = QuotaService(service_nc, await ensure_bus(service_nc.jetstream(), settings), settings)
    await service.start()
    try:
        ns = unique_namespace()
        await call(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=QuotaAmount(gpus=2)))
        assert (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p1", 100))).ok

        fresh_nats.kill()
        fresh_nats.start()

        async def serving_again() -> bool:
            try:
                return (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p2", 100), timeout=1)).ok
            except Exception:
                return False

        await eventually(serving_again, timeout=20, interval=0.2)
        assert set(await charges(nc, ns)) == {"p1", "p2"}
        assert not (await call(nc, bus.QUOTA_RESERVE, reserve(ns, "p3", 100))).ok

        await bus.publish_event(nc.jetstream(), AllocationEvent(
            action="released", node="node-a", pod_uid="p1", namespace=ns, name="pod-p1"))

        async def released() -> bool:
            return set(await charges(nc, ns)) == {"p2"}

        await eventually(released, timeout=10)
    finally:
        await service.stop()
        await service_nc.close()
        await nc.close()
