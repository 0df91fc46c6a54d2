"""NATS loses its whole JetStream store under a running stack with GPU pods.

The broker is stopped, its store directory deleted, and it starts again empty on the same port.
Every service re-creates the buckets and the stream; the scheduler rebuilds the ledger from the
bound pods' annotations before it answers another filter. Shown: no running pod loses its
allocation, new pods fit only into truly free capacity (no double allocation), and the whole
recovery takes less than 30 s.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator

import pytest

from tessera.bus import connect, read
from tessera.models import NodeLedger
from tessera.settings import NatsSettings
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, grants, start_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GPU_MIB = 24576
POD_MIB = 12000  # two per GPU
NODES = [SimNode(name=f"wipe-{i}", gpus=2, gpu_memory_mib=GPU_MIB) for i in range(2)]
SLOTS = 2 * sum(n.gpus for n in NODES)  # 8 pods of POD_MIB fit in all
RUNNING_BEFORE = 6
RECOVERY_S = 30.0


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


async def read_ledgers(nats: NatsSettings, nodes: set[str]) -> dict[str, NodeLedger | None]:
    nc = await connect(nats, name="e2e-wipe-check", initial_attempts=5)
    try:
        kv = await nc.jetstream().key_value("tessera-ledger")
        return {name: (v.value if (v := await read(kv, name, NodeLedger)) else None)
                for name in nodes}  # fmt: skip
    finally:
        await nc.close()


def ledger_holds(nats: NatsSettings, pods: list[dict]) -> bool:
    """Every pod's allocation is in the ledger of its node, with the grants it runs on (also the
    vendor pods' check: test_vendors_lost_store.py)."""
    try:
        ledgers = asyncio.run(read_ledgers(nats, {p["spec"]["nodeName"] for p in pods}))
    except Exception:
        return False
    for pod in pods:
        ledger = ledgers.get(pod["spec"]["nodeName"])
        allocation = ledger.allocations.get(pod["metadata"]["uid"]) if ledger else None
        if allocation is None or not allocation.active or allocation.containers != grants(pod):
            return False
    return True


def scheduler_ready(sim: RunningStack) -> bool:
    """What `tessera up` shows in its ready column."""
    return sim.stack.readiness("scheduler") == "ready"


def gpu_use(pods: list[dict]) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for pod in pods:
        if pod["spec"].get("nodeName"):
            for grant in (g for c in grants(pod) for g in c):
                used[grant.uuid] += grant.memory_mib
    return used


def test_wiped_store_loses_no_allocation_and_allocates_nothing_twice(sim: RunningStack) -> None:
    kube, stack = sim.kube, sim.stack
    namespace = f"wipe-{uuid.uuid4().hex[:6]}"
    for i in range(RUNNING_BEFORE):
        kube.create_pod_retrying(gpu_pod(f"before-{i}", mem=POD_MIB), namespace)
    for i in range(RUNNING_BEFORE):
        kube.wait_running(namespace, f"before-{i}", 60)
    before = {p["metadata"]["uid"]: p for p in kube.pods(namespace)}
    admin = stack.nats_settings()  # the admin identity (NATS refuses anonymous clients)
    assert ledger_holds(admin, list(before.values()))

    # The disk under NATS is lost: stop it, delete the whole store, start it empty.
    assert stack.nats is not None
    stack.nats.stop()
    shutil.rmtree(stack.nats.data_dir / "jetstream")
    stack.nats.start()
    wiped_at = time.monotonic()

    kube.wait_for(
        "the ledger rebuilt and the scheduler ready",
        lambda: scheduler_ready(sim) and ledger_holds(admin, list(before.values())),
        RECOVERY_S, 0.25,
    )  # fmt: skip
    recovered_s = time.monotonic() - wiped_at
    print(f"\nrecovered {recovered_s:.1f} s after the store was wiped (target {RECOVERY_S:.0f} s)")
    # It was a rebuild (the store really was empty), not a ledger that survived.
    log = stack.find("scheduler").log_path.read_text()
    restored = [json.loads(line)["restored"] for line in log.splitlines()
                if "ledger rebuilt from the cluster" in line]  # fmt: skip
    assert sum(restored) == RUNNING_BEFORE, restored

    # Nothing running lost its place: same node, same grants, still Running.
    for uid, pod in before.items():
        now = kube.pod(namespace, pod["metadata"]["name"])
        assert now["metadata"]["uid"] == uid and now["status"]["phase"] == "Running"
        assert now["spec"]["nodeName"] == pod["spec"]["nodeName"]
        assert grants(now) == grants(pod)

    # Four more pods: only the two truly free halves of a GPU can take them.
    extra = SLOTS - RUNNING_BEFORE + 2
    for i in range(extra):
        kube.create_pod_retrying(gpu_pod(f"after-{i}", mem=POD_MIB), namespace)

    def two_more_running() -> bool:
        pods = kube.pods(namespace)
        return sum(p["status"].get("phase") == "Running" for p in pods) >= SLOTS

    kube.wait_for("the free capacity used", two_more_running, 60, 0.25)
    time.sleep(3.0)  # kube-sim keeps retrying the others; they must stay pending
    pods = kube.pods(namespace)
    running = [p for p in pods if p["status"].get("phase") == "Running"]
    assert len(running) == SLOTS, [p["metadata"]["name"] for p in running]
    unplaced = [p for p in pods if not p["spec"].get("nodeName")]
    assert len(unplaced) == extra - (SLOTS - RUNNING_BEFORE)
    for gpu, mib in gpu_use(pods).items():
        assert mib <= GPU_MIB, f"{gpu} granted {mib} MiB of {GPU_MIB}"
    assert ledger_holds(admin, running)
