"""NATS as a 3-server JetStream cluster (`tessera up --nats-cluster 3`): one server is killed and
its whole store wiped in the middle of a burst of pods, then started again.

Every bucket and the stream have 3 replicas, so the two surviving servers hold everything: the
burst completes, no allocation is lost or duplicated, no GPU is granted beyond capacity, and the
wiped server catches up and is healthy again.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator

import pytest

from tessera.bus import LEDGER_BUCKET, connect, read
from tessera.models import Allocation, NodeLedger
from tessera.settings import NatsSettings
from tessera_cli.nats_embedded import ClusterMember
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, grants, start_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PODS = 60
SPLIT = 20
GPU_MIB = 24576
NODES = [SimNode(name=f"nc-{i}", gpus=2, gpu_memory_mib=GPU_MIB) for i in range(2)]
WAIT_S = 180.0  # a loaded 2-core CI machine re-electing a stream leader mid-burst


def request_mib(i: int) -> int:
    return 500 + (i % 7) * 100  # distinct sizes: crossed grants would show


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    env = {"TESSERA_DEVICE_SPLIT_COUNT": str(SPLIT), "TESSERA_NODE_SCHEDULER_POLICY": "spread"}
    yield from start_stack(NODES, env=env, nats_cluster=3)


async def ledger_leader_and_ledgers(
    nats: NatsSettings,
) -> tuple[str, dict[str, NodeLedger]]:
    nc = await connect(nats, name="e2e-cluster-check", initial_attempts=10)
    try:
        js = nc.jetstream()
        info = await js.stream_info(f"KV_{LEDGER_BUCKET}")
        assert info.config.num_replicas == 3, info.config
        kv = await js.key_value(LEDGER_BUCKET)
        ledgers = {n.name: v.value for n in NODES if (v := await read(kv, n.name, NodeLedger))}
        return (info.cluster.leader if info.cluster else "") or "", ledgers
    finally:
        await nc.close()


def test_one_server_lost_mid_burst_loses_and_duplicates_nothing(sim: RunningStack) -> None:
    kube, stack = sim.kube, sim.stack
    assert stack.nats_cluster is not None and len(stack.nats_cluster.members) == 3
    url = stack.nats_url or ""
    assert url.count("nats://") == 3  # services were given every server
    admin = stack.nats_settings()  # the admin identity (NATS refuses anonymous clients)
    leader, _ = asyncio.run(ledger_leader_and_ledgers(admin))
    namespace = f"nc-{uuid.uuid4().hex[:6]}"
    errors: list[str] = []

    def create_burst() -> None:
        try:
            for i in range(PODS):
                kube.create_pod_retrying(
                    gpu_pod(f"burst-{i:03d}", mem=request_mib(i), cores=5), namespace, 60
                )
                time.sleep(0.03)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    creator = threading.Thread(target=create_burst)
    creator.start()
    kube.wait_for("the burst under way", lambda: len(kube.pods(namespace)) >= PODS // 4, 60)
    # The ledger's stream leader loses its disk: kill it, wipe its store, start it again.
    victim: ClusterMember = next(
        (m for m in stack.nats_cluster.members if m.name == leader), stack.nats_cluster.members[0]
    )
    victim.kill()
    victim.wipe()
    time.sleep(1.0)
    victim.start()
    creator.join(120)
    assert not errors, errors

    def all_running() -> bool:
        pods = kube.pods(namespace)
        return len(pods) == PODS and all(p["status"].get("phase") == "Running" for p in pods)

    kube.wait_for(f"all {PODS} pods Running", all_running, WAIT_S, 0.5, progress=True)
    stack.nats_cluster.wait_healthy(60, [victim])  # caught up from the two others

    pods = kube.pods(namespace)
    _leader, ledgers = asyncio.run(ledger_leader_and_ledgers(admin))
    active: dict[str, list[tuple[str, Allocation]]] = defaultdict(list)
    for node, ledger in ledgers.items():
        for uid, allocation in ledger.allocations.items():
            if allocation.active:
                active[uid].append((node, allocation))
    duplicated = {uid: [n for n, _ in found] for uid, found in active.items() if len(found) > 1}
    assert not duplicated, duplicated
    for pod in pods:
        found = active.get(pod["metadata"]["uid"])
        assert found, f"{pod['metadata']['name']} runs without an allocation"
        [(node, allocation)] = found
        assert node == pod["spec"]["nodeName"] and allocation.containers == grants(pod)
        i = int(pod["metadata"]["name"].removeprefix("burst-"))
        assert [g.memory_mib for c in grants(pod) for g in c] == [request_mib(i)]
    use: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for pod in pods:
        for grant in (g for c in grants(pod) for g in c):
            use[grant.uuid][0] += 1
            use[grant.uuid][1] += grant.memory_mib
    for gpu, (slots, mib) in use.items():
        assert slots <= SPLIT and mib <= GPU_MIB, (gpu, slots, mib)

