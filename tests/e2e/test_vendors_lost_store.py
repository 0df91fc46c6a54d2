"""NATS loses its whole store under running Ascend, Cambricon and Hygon pods (the local stack:
one node per vendor, each served by its node agent over the vendor's simulated library).

The scheduler rebuilds the ledger from each vendor's own allocation annotations before it
places anything again: every running pod keeps its device, with the grant it runs on (an
Ascend pod asking one AI core runs on, and keeps, the template the chip cut: before, the node
agent refused to seal such a template as a forged grant), and a new pod of each vendor
pends because its vendor's only device is full, never placed on what a running pod holds.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tessera_cli.stack import SimNode

from .conftest import RunningStack, grants, start_stack
from .test_lost_store import ledger_holds, scheduler_ready

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODES = [SimNode(name="wipe-npu", gpus=1, gpu_model="Ascend910B3"),
         SimNode(name="wipe-mlu", gpus=1, gpu_model="MLU370-X4", gpu_memory_mib=24576),
         SimNode(name="wipe-dcu", gpus=1, gpu_model="Z100L", gpu_memory_mib=32768)]  # fmt: skip
NPU = "huawei.com/Ascend910B3"
MLU = "cambricon.com/vmlu"
DCU = "hygon.com/dcunum"
# vendor node -> the pods that fill its one device, and a small pod that then finds no room
FILL: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    # 910B3 (64 GiB, 20 AI cores): asking one AI core, each gets vir10_3c_32g (32 GiB, 10 AI
    # cores): two fill the chip
    "wipe-npu": ([{NPU: 1, f"{NPU}-memory": 20000, f"{NPU}-core": 1}] * 2,
                 {NPU: 1, f"{NPU}-memory": 2000}),
    # one share holding the MLU's whole memory (96 × 256 MiB), one the DCU's
    "wipe-mlu": ([{MLU: 1, "cambricon.com/mlu.smlu.vmemory": 96,
                   "cambricon.com/mlu.smlu.vcore": 50}],
                 {MLU: 1, "cambricon.com/mlu.smlu.vmemory": 4,
                  "cambricon.com/mlu.smlu.vcore": 10}),
    "wipe-dcu": ([{DCU: 1, "hygon.com/dcumem": 32768, "hygon.com/dcucores": 50}],
                 {DCU: 1, "hygon.com/dcumem": 1000, "hygon.com/dcucores": 10}),
}  # fmt: skip


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


def vendor_pod(name: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox",
                                     "command": ["sleep", "86400"],
                                     "resources": {"limits": limits}}]}}  # fmt: skip


def refused_for_room(sim: RunningStack, namespace: str, name: str) -> str:
    """The scheduler's refusal of a pending pod once it judged it ('' until then)."""
    pod = sim.kube.pod(namespace, name)
    assert not pod["spec"].get("nodeName"), f"{name} was placed on a device a running pod holds"
    for condition in pod["status"].get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            message = condition.get("message") or ""
            return message if "CardInsufficient" in message else ""
    return ""


def test_wiped_store_keeps_every_vendor_pods_device(sim: RunningStack) -> None:
    kube, stack = sim.kube, sim.stack
    namespace = f"vwipe-{uuid.uuid4().hex[:6]}"
    names = []
    for node, (fill, _small) in FILL.items():
        for i, limits in enumerate(fill):
            names.append(f"{node}-{i}")
            kube.create_pod_retrying(vendor_pod(names[-1], limits), namespace)
    for name in names:
        kube.wait_running(namespace, name, 60)
    before = {p["metadata"]["uid"]: p for p in kube.pods(namespace)}
    assert {p["spec"]["nodeName"] for p in before.values()} == set(FILL)
    admin = stack.nats_settings()
    assert ledger_holds(admin, list(before.values()))

    assert stack.nats is not None
    stack.nats.stop()
    shutil.rmtree(stack.nats.data_dir / "jetstream")
    stack.nats.start()
    kube.wait_for(
        "the ledger rebuilt from every vendor's annotations and the scheduler ready",
        lambda: scheduler_ready(sim) and ledger_holds(admin, list(before.values())),
        60, 0.25,
    )  # fmt: skip
    for uid, pod in before.items():  # nothing running lost its place or its grant
        now = kube.pod(namespace, pod["metadata"]["name"])
        assert now["metadata"]["uid"] == uid and now["status"]["phase"] == "Running"
        assert grants(now) == grants(pod)
    npu = [grants(p)[0][0] for p in before.values() if p["spec"]["nodeName"] == "wipe-npu"]
    assert sorted((g.memory_mib, g.cores) for g in npu) == [(32768, 10), (32768, 10)]

    for node, (_fill, small) in FILL.items():
        kube.create_pod_retrying(vendor_pod(f"{node}-after", small), namespace)
    for node in FILL:
        kube.wait_for(f"{node}-after refused for room",
                      lambda n=node: refused_for_room(sim, namespace, f"{n}-after"), 60)
