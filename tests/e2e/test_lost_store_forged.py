"""Issue 34, end to end: a running pod's allocation annotations are forged to name another card
of its node (within that card's capacity and the pod's request, with a leaked component
credential the webhook lets through), then NATS loses its whole store. The rebuild restores the
forged claim (it cannot tell), the node agent reports that its sealed container disagrees and
puts the ledger back on the card it sealed; no card is ever over capacity in the ledger nor in
what is sealed on the node, even as new pods fill every card."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tessera import hami
from tessera.bus import connect, read
from tessera.models import NodeLedger
from tessera.region import read_limits
from tessera.settings import NatsSettings
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, grants, start_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GPU_MIB = 24576
POD_MIB = 8000
NODE = SimNode(name="forged-0", gpus=2, gpu_memory_mib=GPU_MIB)


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack([NODE])


async def read_ledger(nats: NatsSettings) -> NodeLedger | None:
    nc = await connect(nats, name="e2e-forged-check", initial_attempts=5)
    try:
        kv = await nc.jetstream().key_value("tessera-ledger")
        found = await read(kv, NODE.name, NodeLedger)
        return found.value if found else None
    finally:
        await nc.close()


def ledger(nats: NatsSettings) -> NodeLedger | None:
    try:
        return asyncio.run(read_ledger(nats))
    except Exception:
        return None


def ledger_per_card(value: NodeLedger) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for allocation in value.allocations.values():
        if allocation.active:
            for grant in (g for c in allocation.containers for g in c):
                used[grant.uuid] += grant.memory_mib
    return used


def sealed_per_card(sim: RunningStack) -> dict[str, int]:
    """What the node agent sealed in each admitted container's limits directory."""
    used: dict[str, int] = defaultdict(int)
    for admission in sim.kube.containers(NODE.name):
        for container in admission.get("containers") or []:
            for mount in container.get("mounts") or []:
                limits = read_limits(mount["host_path"]) if Path(mount["host_path"]).is_dir() \
                    else None
                for device in (limits.devices if limits else []):
                    used[device.uuid] += device.mem_limit_bytes >> 20
    return used


def test_a_forged_move_to_another_card_is_reported_and_never_overcommits(
    sim: RunningStack,
) -> None:
    kube, stack = sim.kube, sim.stack
    namespace = f"forged-{uuid.uuid4().hex[:6]}"
    for i in range(2):
        kube.create_pod_retrying(gpu_pod(f"before-{i}", mem=POD_MIB), namespace)
    for i in range(2):
        kube.wait_running(namespace, f"before-{i}", 60)
    victim = kube.pod(namespace, "before-0")
    [[real]] = grants(victim)
    target = next(u for u in (gpu_uuid(NODE.name, i) for i in range(NODE.gpus))
                  if u != real.uuid)
    # The forgery: a component's leaked kube credential (the webhook trusts it) moves the pod's
    # record to the other card, 8000 MiB as asked: within capacity and the request.
    forged = hami.encode_pod_devices([[real.model_copy(update={"uuid": target})]])
    patch = {"metadata": {"annotations": {hami.ANN_DEVICES_ALLOCATED: forged,
                                          hami.ANN_DEVICES_TO_ALLOCATE: forged}}}
    config = json.loads((stack.state_dir / "kubeconfig-scheduler").read_text())
    token = config["users"][0]["user"]["token"]
    reply = httpx.patch(f"{stack.api_url}/api/v1/namespaces/{namespace}/pods/before-0",
                        json=patch, timeout=30, headers={
                            "authorization": f"Bearer {token}",
                            "content-type": "application/merge-patch+json"})
    assert reply.status_code == 200, reply.text

    assert stack.nats is not None
    stack.nats.stop()
    shutil.rmtree(stack.nats.data_dir / "jetstream")
    stack.nats.start()
    admin = stack.nats_settings()

    def back_on_the_sealed_card() -> bool:
        value = ledger(admin)
        allocation = value.allocations.get(victim["metadata"]["uid"]) if value else None
        return allocation is not None and allocation.containers[0][0].uuid == real.uuid

    kube.wait_for("the ledger rebuilt and put back on the sealed card", back_on_the_sealed_card,
                  60, 0.25)
    agent_log = stack.find(f"node-agent/{NODE.name}").log_path.read_text()
    assert "sealed_grant_disagrees" in agent_log and "before-0" in agent_log

    # Fill every card: nothing sealed or granted beyond any card's capacity.
    for i in range(6):
        kube.create_pod_retrying(gpu_pod(f"after-{i}", mem=POD_MIB), namespace)
    kube.wait_for("the cards filled", lambda: sum(
        p["status"].get("phase") == "Running" for p in kube.pods(namespace)) >= 6, 60, 0.25)
    for card, mib in sealed_per_card(sim).items():
        assert mib <= GPU_MIB, f"{card}: {mib} MiB sealed of {GPU_MIB}"
    for card, mib in ledger_per_card(ledger(admin)).items():
        assert mib <= GPU_MIB, f"{card}: {mib} MiB in the ledger of {GPU_MIB}"
