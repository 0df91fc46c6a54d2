"""Crash tests: a burst of 200 pods while every service (and NATS) is killed and restarted.

Afterwards: no GPU over capacity, no allocation lost or duplicated (ledger ↔ pods), every
container sealed with its own pod's limits, and every pod (they all fit) Running within 15 s of
the last restart.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from tessera.bus import connect, ensure_bus
from tessera.codec import decode
from tessera.models import NodeLedger
from tessera.settings import NatsSettings, TesseraSettings
from tessera.stack import SimNode

from .conftest import RunningStack, gpu_pod, grants, start_stack
from .test_scenarios import sealed_memory_mib

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PODS = 200
SPLIT = 20
GPU_MIB = 24576
NODES = [SimNode(name=f"crash-{i}", gpus=4, gpu_memory_mib=GPU_MIB, gpu_model="NVIDIA A10")
         for i in range(4)]
CONVERGE_S = 15.0


def request_mib(i: int) -> int:
    # Distinct sizes, so a container sealed with another pod's limits is caught.
    return 500 + (i % 9) * 50


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    # Node policy spread: the burst is shared by the four nodes' bind pipelines.
    yield from start_stack(NODES, env={"TESSERA_DEVICE_SPLIT_COUNT": str(SPLIT),
                                       "TESSERA_NODE_SCHEDULER_POLICY": "spread"})


async def claims(nats_url: str) -> dict[str, Any]:
    """node → its in-flight claim (for a failure report)."""
    nc = await connect(NatsSettings(NATS_URL=nats_url), name="e2e-crash-claims")
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        out: dict[str, Any] = {}
        for node in NODES:
            ledger = decode((await buckets.ledger.get(node.name)).value, NodeLedger)
            states = defaultdict(int)
            for allocation in ledger.allocations.values():
                states[str(allocation.state)] += 1
            out[node.name] = (ledger.claim, dict(states))
        return out
    finally:
        await nc.close()


async def active_ledger(nats_url: str) -> dict[str, list[tuple[str, Any]]]:
    """pod uid → [(node, allocation)] for every active allocation in the ledger."""
    nc = await connect(NatsSettings(NATS_URL=nats_url), name="e2e-crash-check")
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        found: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        for node in NODES:
            entry = await buckets.ledger.get(node.name)
            ledger = decode(entry.value, NodeLedger)
            for uid, allocation in ledger.allocations.items():
                if allocation.active:
                    found[uid].append((node.name, allocation))
        return found
    finally:
        await nc.close()


def test_burst_with_every_service_killed(sim: RunningStack, namespace: str) -> None:
    kube, stack = sim.kube, sim.stack
    errors: list[str] = []

    def create_burst() -> None:
        try:
            for i in range(PODS):
                kube.create_pod_retrying(
                    gpu_pod(f"burst-{i:03d}", mem=request_mib(i), cores=5), namespace, 60
                )
                time.sleep(0.03)
        except Exception as exc:  # reported by the main thread
            errors.append(repr(exc))

    creator = threading.Thread(target=create_burst)
    creator.start()
    victims = ["scheduler", "admission", "quota", f"node-agent/{NODES[0].name}", "metrics",
               f"node-agent/{NODES[1].name}"]
    for name in victims:
        time.sleep(0.8)
        stack.kill_service(name)
        time.sleep(0.4)
        stack.start_service(stack.find(name).spec)
    time.sleep(0.5)
    assert stack.nats is not None
    stack.nats.kill()
    time.sleep(0.5)
    stack.nats.start()
    last_restart = time.monotonic()
    creator.join(120)
    assert not errors, errors
    created_s = time.monotonic() - last_restart

    def all_running() -> list[dict[str, Any]] | None:
        pods = kube.pods(namespace)
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return pods if len(pods) == PODS and len(running) == PODS else None

    try:
        pods = kube.wait_for(
            f"all {PODS} pods Running", all_running, 40, 0.25,
            progress=lambda: print(f"   claims: {asyncio.run(claims(stack.nats_url or ''))}"),
        )
    except AssertionError:
        summary: dict[str, int] = defaultdict(int)
        for pod in kube.pods(namespace):
            conditions = pod["status"].get("conditions") or [{}]
            summary[f"{pod['status'].get('phase')} {conditions[-1].get('message', '')}"] += 1
        stuck = asyncio.run(claims(stack.nats_url or ""))
        raise AssertionError(f"not all Running: {dict(summary)}; ledger: {stuck}") from None
    converged_s = time.monotonic() - last_restart
    assert converged_s <= CONVERGE_S, (
        f"converged {converged_s:.1f} s after the last restart (all created at {created_s:.1f} s)"
    )

    # No GPU over capacity (slots, memory, cores), counted from what pods were given.
    per_gpu: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for pod in pods:
        [[grant]] = grants(pod)
        use = per_gpu[grant.uuid]
        use[0] += 1
        use[1] += grant.memory_mib
        use[2] += grant.cores
    for uuid, (slots, mem, cores) in per_gpu.items():
        assert slots <= SPLIT and mem <= GPU_MIB and cores <= 100, (uuid, slots, mem, cores)

    # Ledger ↔ pods: every pod exactly once, nothing else, with the same grants.
    ledger = asyncio.run(active_ledger(stack.nats_url or ""))
    uids = {p["metadata"]["uid"]: p for p in pods}
    duplicated = {uid: [n for n, _ in e] for uid, e in ledger.items() if len(e) > 1}
    assert not duplicated, duplicated
    assert set(ledger) >= set(uids), f"lost: {sorted(set(uids) - set(ledger))[:5]}"
    stale = [a.name for uid, e in ledger.items() if uid not in uids for _, a in e
             if a.namespace == namespace]
    assert not stale, stale
    for uid, pod in uids.items():
        [(node, allocation)] = ledger[uid]
        assert node == pod["spec"]["nodeName"]
        assert allocation.containers == grants(pod)

    # Every container runs with its own pod's limits (env and sealed limits file).
    admitted = {entry["uid"]: entry for node in NODES for entry in kube.containers(node.name)}
    for i in range(PODS):
        pod = next(p for p in pods if p["metadata"]["name"] == f"burst-{i:03d}")
        [main] = admitted[pod["metadata"]["uid"]]["containers"]
        [[grant]] = grants(pod)
        assert grant.memory_mib == request_mib(i)
        assert main["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{request_mib(i)}m"
        assert main["envs"]["NVIDIA_VISIBLE_DEVICES"] == grant.uuid
        assert sealed_memory_mib(main) == [request_mib(i)]
    print(f"converged {converged_s:.1f} s after the last restart "
          f"(burst all created {created_s:.1f} s after it)")
