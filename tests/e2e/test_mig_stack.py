"""Static MIG on the local stack: a node whose A100 holds MIG instances (migStrategy mixed) offers
them as `nvidia.com/mig-<profile>`; the example vLLM pod asking `nvidia.com/mig-1g.10gb: 1` is
placed on that node and its container gets exactly that instance's MIG UUID; a second one stays
pending with kube-scheduler's reason; libvgpu slices never land on the MIG card."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, grants, start_stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mig" / "vllm-mig-1g.10gb.yaml"
MIG_NODE, PLAIN_NODE = "mig-a", "plain-b"
NODES = [
    SimNode(name=MIG_NODE, gpus=1, gpu_memory_mib=81920, gpu_model="NVIDIA A100-SXM4-80GB",
            mig="mixed", mig_instances="1g.10gb@0,3g.40gb@4"),
    SimNode(name=PLAIN_NODE, gpus=1, gpu_memory_mib=24576, gpu_model="NVIDIA A10"),
]


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


def _allocatable(sim: RunningStack, node: str) -> dict[str, str]:
    reply = sim.kube.http.get(f"/api/v1/nodes/{node}")
    reply.raise_for_status()
    return reply.json()["status"].get("allocatable") or {}


def _pending_message(sim: RunningStack, name: str) -> str | None:
    pod = sim.kube.pod("default", name)
    for c in pod["status"].get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or None
    return None


def test_the_vllm_mig_pod_gets_its_instance(sim: RunningStack) -> None:
    kube = sim.kube
    kube.wait_for("the MIG resources on the node", lambda: _allocatable(sim, MIG_NODE).get(
        "nvidia.com/mig-1g.10gb") == "1" and _allocatable(sim, MIG_NODE).get(
        "nvidia.com/mig-3g.40gb") == "1", timeout_s=30)
    assert "nvidia.com/mig-1g.10gb" not in _allocatable(sim, PLAIN_NODE)

    pod = yaml.safe_load(EXAMPLE.read_text())
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-1g.10gb": 1}
    kube.create_pod_retrying(pod, "default")
    running = kube.wait_running("default", "vllm-mig", timeout_s=40)
    assert running["spec"]["nodeName"] == MIG_NODE
    # the instance the simulated A100 holds at slice 0 (GPU instance 1), by its MIG UUID
    expected = f"MIG-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{MIG_NODE}/gpu0/gi1')}"
    admitted = [a for a in kube.containers(MIG_NODE) if a["name"] == "vllm-mig"]
    assert admitted, kube.containers(MIG_NODE)
    (container,) = admitted[0]["containers"]
    assert container["device_ids"] == [expected]
    assert container["envs"] == {"NVIDIA_VISIBLE_DEVICES": expected}
    assert container["mounts"] == []  # no libvgpu in a MIG container

    # the node's only 1g.10gb instance is taken: a second pod waits, with the reason
    second = {**pod, "metadata": {"name": "vllm-mig-2"}}
    kube.create_pod_retrying(second, "default")
    kube.wait_for("kube-scheduler's reason", lambda: (_pending_message(sim, "vllm-mig-2") or "")
                  .find("Insufficient nvidia.com/mig-1g.10gb") >= 0, timeout_s=20)

    # a libvgpu slice goes to the plain card, never onto the card in MIG mode
    kube.create_pod_retrying(gpu_pod("slice", mem=4000, cores=20), "default")
    placed = kube.wait_running("default", "slice", timeout_s=40)
    assert placed["spec"]["nodeName"] == PLAIN_NODE
    assert "A10" in grants(placed)[0][0].type

    # deleting the first pod frees its instance for the waiting one
    kube.delete_pod("default", "vllm-mig")
    running2 = kube.wait_running("default", "vllm-mig-2", timeout_s=60)
    assert running2["spec"]["nodeName"] == MIG_NODE


def test_tessera_up_mig_flag_needs_a_mig_capable_model() -> None:
    """`tessera up --mig mixed` marks every node; a GPU model without MIG or an unknown
    strategy is refused with the reason (before anything starts)."""
    import typer

    from tessera_cli.stack import make_nodes, node_agent_env
    from tessera_cli.up import with_mig

    nodes = with_mig(make_nodes(2, 1, 81920, "NVIDIA A100-SXM4-80GB"), "mixed")
    assert {n.mig for n in nodes} == {"mixed"}
    env = node_agent_env(nodes[0], Path("/tmp/x"), Path("/tmp/y"))
    assert env["TESSERA_MIG_STRATEGY"] == "mixed"
    assert env["TESSERA_STATIC_MIG_INSTANCES"] == ",".join(f"1g.10gb@{s}" for s in range(7))
    with pytest.raises(typer.BadParameter, match="MIG-capable"):
        with_mig(make_nodes(1, 1, 24576, "NVIDIA A10"), "mixed")
    with pytest.raises(typer.BadParameter, match="--mig must be one of"):
        with_mig(nodes, "sometimes")
