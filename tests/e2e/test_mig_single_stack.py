"""Static MIG with migStrategy single on the local stack: an A100 node whose instances all have
one profile offers them as `nvidia.com/gpu` (NVIDIA's device-plugin semantics); a pod asking
`nvidia.com/gpu: 1` is placed by Tessera's scheduler on one whole instance and its container gets
exactly that instance's MIG UUID; when every instance is taken the next pod waits with the
scheduler's reason; a pod asking more memory than an instance has is refused. The metrics
service's dashboard shows MIG instances on their cards with the pod holding each: a mixed node's
static instances (from its registration) and a dynamic node's instance (from the ledger)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tessera import hami
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, grants, start_stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

NODE = "mig-single"
A100 = "NVIDIA A100-SXM4-80GB"
MIXED, DYNAMIC = "mig-mixed", "mig-dyn"
NODES = [SimNode(name=NODE, gpus=1, gpu_memory_mib=81920, gpu_model=A100, mig="single",
                 mig_instances="1g.10gb@0,1g.10gb@1"),
         SimNode(name=MIXED, gpus=1, gpu_memory_mib=81920, gpu_model=A100, mig="mixed",
                 mig_instances="1g.10gb@0,3g.40gb@4"),
         SimNode(name=DYNAMIC, gpus=1, gpu_memory_mib=81920, gpu_model=A100, mig="dynamic")]
INSTANCES = [f"MIG-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{NODE}/gpu0/gi{i}')}" for i in (1, 2)]


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


def _events(sim: RunningStack, name: str) -> str:
    items = sim.kube.http.get("/api/v1/namespaces/default/events").json()["items"]
    return " ".join(e["message"] for e in items if e["involvedObject"].get("name") == name
                    and e["reason"] == "FailedScheduling")


def test_single_strategy_pods_get_whole_instances(sim: RunningStack) -> None:
    kube = sim.kube
    node = kube.http.get(f"/api/v1/nodes/{NODE}").json()
    assert node["status"]["allocatable"].get("nvidia.com/gpu") == "2"  # one per instance
    assert not [r for r in node["status"]["allocatable"] if r.startswith("nvidia.com/mig-")]
    register = json.loads(node["metadata"]["annotations"]["hami.io/node-nvidia-register"])
    assert sorted(d["id"] for d in register) == sorted(INSTANCES), register

    kube.create_pod_retrying(gpu_pod("too-big", mem=20000, node=NODE), "default")
    kube.wait_for("a pod asking more than an instance holds is refused",
                  lambda: "CardInsufficientMemory" in _events(sim, "too-big"), timeout_s=30)

    given = []
    for name in ("infer-a", "infer-b"):
        kube.create_pod_retrying(gpu_pod(name, node=NODE), "default")
        running = kube.wait_running("default", name, timeout_s=40)
        [[grant]] = grants(running)
        assert grant.type == f"NVIDIA-{A100}-MIG-1g.10gb" and grant.memory_mib == 10240
        [admitted] = [a for a in kube.containers(NODE) if a["name"] == name]
        [container] = admitted["containers"]
        assert container["envs"]["NVIDIA_VISIBLE_DEVICES"] == grant.uuid
        assert container["mounts"] == []  # a whole instance: no libvgpu
        given.append(grant.uuid)
    assert sorted(given) == sorted(INSTANCES)  # each pod its own instance

    kube.create_pod_retrying(gpu_pod("infer-c", node=NODE), "default")
    said = kube.wait_for("the third pod refused: both instances are held",
                         lambda: _events(sim, "infer-c"), timeout_s=30)
    assert "2/2 CardTimeSlicingExhausted" in said, said  # split count 1: never shared


def _dashboard_instances(sim: RunningStack, node: str) -> list[dict]:
    state = httpx.get(f"http://127.0.0.1:{sim.stack.ports.metrics}/api/state", timeout=10).json()
    return [i for n in state["nodes"] if n["name"] == node for g in n["gpus"]
            for i in g["mig_instances"]]


def test_the_dashboard_shows_static_and_dynamic_instances_with_their_pods(
        sim: RunningStack) -> None:
    kube = sim.kube
    static_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm-static"},
                  "spec": {"containers": [{"name": "main", "image": "vllm",
                                           "resources": {"limits": {
                                               "nvidia.com/mig-3g.40gb": 1}}}]}}
    kube.create_pod_retrying(static_pod, "default")
    kube.wait_running("default", "vllm-static", timeout_s=40)
    dynamic_pod = gpu_pod("finetune", mem=15000, cores=25, annotations={
        hami.ANN_VGPU_MODE: "mig", hami.ANN_USE_GPUUUID: gpu_uuid(DYNAMIC, 0)})
    kube.create_pod_retrying(dynamic_pod, "default")
    kube.wait_running("default", "finetune", timeout_s=40)

    def static_held() -> list[dict]:
        found = _dashboard_instances(sim, MIXED)
        return found if any(i["pod"] == "default/vllm-static" for i in found) else []

    shown = kube.wait_for("the mixed card's instances with their pod", static_held, 30)
    assert sorted((i["source"], i["profile"], i["start"], i["size"], i["pod"]) for i in shown) == [
        ("static", "1g.10gb", 0, 1, ""), ("static", "3g.40gb", 4, 4, "default/vllm-static")]

    def dynamic_made() -> list[dict]:
        return [i for i in _dashboard_instances(sim, DYNAMIC)
                if i["state"] == "created" and i["pod"] == "default/finetune"]

    [made] = kube.wait_for("the dynamic card's instance with its pod", dynamic_made, 30)
    assert (made["source"], made["profile"], made["size"]) == ("dynamic", "2g.20gb", 2)
    assert made["uuid"].startswith("MIG-")
