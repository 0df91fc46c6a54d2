"""Ascend on the local stack (`tessera up --nodes-file examples/vendors/nodes/ascend-cluster.yaml`):
a 910C node whose modules are two NPUs to kubelet and one device to Tessera, and a 910B2 chip
whose AI CPUs bound the vNPUs it can hold.

- 910C: the pod HAMi's docs write (`huawei.com/Ascend910C: 1`, rounded up to a module of 2) runs
  with a whole module (both dies visible), kubelet's two device IDs being one module's; a second
  module-sized pod takes the other module; a third pends; a release frees the module again.
- 910B2: one vir12_3c_32g and three vir03_1c_8g run (6 AI CPUs of 6); a fourth vir03_1c_8g
  pends saying the chip has no AI CPU left, though memory and AI cores are.
- The node agents write HAMi's `hami.io/node-handshake-<chip>` (`Reported_<time>`) with the
  register annotations, and each chip's slots are HAMi's vNPU count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.device_kinds.ascend import annotations as asc_ann
from tessera.simnodes import load_nodes

from .conftest import RunningStack, grants, start_stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vendors"
NODES = load_nodes(EXAMPLES / "nodes" / "ascend-cluster.yaml")
C_NODE, B2_NODE = "npu-910c", "npu-910b2"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


def allocatable(sim: RunningStack, node: str) -> dict[str, str]:
    reply = sim.kube.http.get(f"/api/v1/nodes/{node}")
    reply.raise_for_status()
    return reply.json()["status"].get("allocatable") or {}


def pending_message(sim: RunningStack, name: str) -> str:
    pod = sim.kube.pod("default", name)
    for c in pod["status"].get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or ""
    return ""


def envs(sim: RunningStack, node: str, pod: str) -> dict[str, str]:
    admitted = [a for a in sim.kube.containers(node) if a["name"] == pod]
    assert admitted, sim.kube.containers(node)
    return admitted[0]["containers"][0]["envs"]


def module_pod(name: str) -> dict[str, Any]:
    spec = yaml.safe_load((EXAMPLES / "ascend-910c-module.yaml").read_text())
    spec["metadata"]["name"] = name
    return spec


def vnpu_pod(name: str, memory: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "containers": [{"name": "main", "image": "mindspore", "resources": {"limits": {
            "huawei.com/Ascend910B2": 1, "huawei.com/Ascend910B2-memory": memory}}}]}}


def test_910c_modules_and_910b2_ai_cpus(sim: RunningStack) -> None:
    kube = sim.kube
    kube.wait_for("both nodes' NPUs in allocatable", lambda: (
        allocatable(sim, C_NODE).get("huawei.com/Ascend910C") == "4"
        and int(allocatable(sim, B2_NODE).get("huawei.com/Ascend910B2", "0")) > 0),
        timeout_s=40, every_s=0.25)
    annotations = {n["metadata"]["name"]: n["metadata"].get("annotations") or {}
                   for n in kube.nodes()}
    for node, word in ((C_NODE, "Ascend910C"), (B2_NODE, "Ascend910B2")):
        assert annotations[node][asc_ann.handshake_key(word)].startswith("Reported_"), node
    # HAMi's vNPU count per chip: 65536 MiB over vir03_1c_8g's 8192
    assert allocatable(sim, B2_NODE)["huawei.com/Ascend910B2"] == "8"

    # 910C: a module per pod, both of its dies visible; kubelet counted two NPUs for it
    kube.create_pod_retrying(module_pod("module-a"), "default")
    a = kube.wait_running("default", "module-a", timeout_s=40)
    assert a["spec"]["nodeName"] == C_NODE
    assert str(a["spec"]["containers"][0]["resources"]["limits"]["huawei.com/Ascend910C"]) == "2"
    [[grant_a]] = grants(a)
    assert (grant_a.type, grant_a.memory_mib) == ("Ascend910C", 131072)
    kube.create_pod_retrying(module_pod("module-b"), "default")
    b = kube.wait_running("default", "module-b", timeout_s=40)
    [[grant_b]] = grants(b)
    assert grant_b.uuid != grant_a.uuid
    visible = {envs(sim, C_NODE, "module-a")["ASCEND_VISIBLE_DEVICES"],
               envs(sim, C_NODE, "module-b")["ASCEND_VISIBLE_DEVICES"]}
    assert visible == {"0,1", "2,3"}
    kube.create_pod_retrying(module_pod("module-c"), "default")  # no module left
    kube.wait_for("the third module pod pending", lambda: pending_message(sim, "module-c"),
                  timeout_s=30)
    kube.delete_pod("default", "module-a")
    c = kube.wait_running("default", "module-c", timeout_s=40)
    assert [g.uuid for g in grants(c)[0]] == [grant_a.uuid]

    # 910B2: 6 AI CPUs: vir12_3c_32g (3) + 3 × vir03_1c_8g (1 each) fill them
    kube.create_pod_retrying(vnpu_pod("big", 32768), "default")
    assert envs(sim, B2_NODE, kube.wait_running("default", "big", timeout_s=40)["metadata"][
        "name"])["ASCEND_VNPU_SPECS"] == "vir12_3c_32g"
    for i in range(3):
        kube.create_pod_retrying(vnpu_pod(f"small-{i}", 8192), "default")
        kube.wait_running("default", f"small-{i}", timeout_s=40)
    kube.create_pod_retrying(vnpu_pod("small-3", 8192), "default")
    message = kube.wait_for("the vNPU beyond the AI CPUs pending with the reason", lambda: (
        pending_message(sim, "small-3") if "AI CPU" in pending_message(sim, "small-3")
        else None), timeout_s=30)
    assert "vir03_1c_8g needs 1 AI CPU(s)" in message and "0 of 6 left" in message, message
    kube.delete_pod("default", "small-0")
    kube.wait_running("default", "small-3", timeout_s=40)
