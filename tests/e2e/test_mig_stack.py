"""MIG on the local stack.

Static: a node whose A100 holds MIG instances (migStrategy mixed) offers them as
`nvidia.com/mig-<profile>`; the example vLLM pod asking `nvidia.com/mig-1g.10gb: 1` is placed on
that node and its container gets exactly that instance's MIG UUID; a second one stays pending
with kube-scheduler's reason; libvgpu slices never land on the MIG card.

Dynamic (HAMi's `mig` mode, a node in migStrategy dynamic): 3g.40gb-, 2g.20gb- and 1g.10gb-sized
asks pack one A100-80GB into a geometry NVIDIA allows, each container given its instance's MIG
UUID; deleting the pods destroys the instances (`mig.destroyed`, the ledger and the simulated
NVML empty); a card holding a libvgpu slice is refused for a MIG pod with the reason.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tessera import bus, hami, mig
from tessera.bus import connect
from tessera.codec import decode
from tessera.models import MigEvent, NodeLedger
from tessera_cli.app import build_app
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, grants, start_stack, stored_events

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mig" / "vllm-mig-1g.10gb.yaml"
MIG_NODE, PLAIN_NODE, DYNAMIC_NODE = "mig-a", "plain-b", "dyn-c"
NODES = [
    SimNode(name=MIG_NODE, gpus=1, gpu_memory_mib=81920, gpu_model="NVIDIA A100-SXM4-80GB",
            mig="mixed", mig_instances="1g.10gb@0,3g.40gb@4"),
    SimNode(name=PLAIN_NODE, gpus=1, gpu_memory_mib=24576, gpu_model="NVIDIA A10"),
    SimNode(name=DYNAMIC_NODE, gpus=1, gpu_memory_mib=81920, gpu_model="A100-SXM4-80GB",
            mig="dynamic"),
]
DYNAMIC_GPU = gpu_uuid(DYNAMIC_NODE, 0)


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    # an instance nobody claims is destroyed 2 s after it is first seen (default 30 s)
    yield from start_stack(NODES, env={"TESSERA_MIG_ORPHAN_GRACE_S": "2"})


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

    # a libvgpu slice goes to the plain card, never onto the card in MIG mode (the dynamic
    # card is kept out: it would take the slice as an instance)
    kube.create_pod_retrying(gpu_pod("slice", mem=4000, cores=20, annotations={
        hami.ANN_NOUSE_GPUUUID: DYNAMIC_GPU}), "default")
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
    dynamic = with_mig(make_nodes(1, 1, 24576, "A100-SXM4-80GB"), "dynamic")
    assert dynamic[0].gpu_memory_mib == 81920  # the model's memory: profiles are its fractions
    env = node_agent_env(dynamic[0], Path("/tmp/x"), Path("/tmp/y"))
    assert env["TESSERA_MIG_STRATEGY"] == "dynamic" and "TESSERA_STATIC_MIG_INSTANCES" not in env
    assert env["TESSERA_STATIC_MIG_STATE"] == f"/tmp/y/mig/{dynamic[0].name}.json"
    with pytest.raises(typer.BadParameter, match="MIG-capable"):
        with_mig(make_nodes(1, 1, 24576, "NVIDIA A10"), "mixed")
    with pytest.raises(typer.BadParameter, match="--mig must be one of"):
        with_mig(nodes, "sometimes")


# --- dynamic MIG ------------------------------------------------------------------------------


def _instances(sim: RunningStack) -> list[dict]:
    """What the dynamic node's simulated NVML holds (the static source's MIG state file)."""
    path = sim.stack.state_dir / "mig" / f"{DYNAMIC_NODE}.json"
    try:
        return json.loads(path.read_text()).get(DYNAMIC_GPU, [])
    except FileNotFoundError:
        return []


async def _ledger_and_events(sim: RunningStack) -> tuple[NodeLedger | None, list[MigEvent]]:
    nc = await connect(sim.stack.nats_settings(), name="e2e-mig", initial_attempts=5)
    try:
        js = nc.jetstream()
        ledger = await bus.read(await js.key_value(bus.LEDGER_BUCKET), DYNAMIC_NODE, NodeLedger)
        stored = await stored_events(js, f"tessera.events.mig.{DYNAMIC_NODE}.>")
        events = [decode(data, MigEvent) for data in stored]
        return (ledger.value if ledger else None), events
    finally:
        await nc.close()


def _recorded(sim: RunningStack, name: str) -> str:
    annotations = sim.kube.pod("default", name)["metadata"].get("annotations") or {}
    return annotations.get(hami.ANN_MIG_INSTANCES) or ""


def _mig_pod(name: str, mem: int, cores: int | None = None, mode: str = "mig") -> dict:
    return gpu_pod(name, mem=mem, cores=cores, annotations={
        hami.ANN_VGPU_MODE: mode, hami.ANN_USE_GPUUUID: DYNAMIC_GPU})


def test_dynamic_mig_packs_one_card_then_destroys_the_instances(sim: RunningStack) -> None:
    kube = sim.kube
    asks = [("m3g", 35000, None, "3g.40gb"), ("m2g", 15000, 25, "2g.20gb"),
            ("m1g-a", 8000, None, "1g.10gb"), ("m1g-b", 8000, None, "1g.10gb")]
    seen: set[str] = set()
    for name, mem, cores, profile in asks:
        kube.create_pod_retrying(_mig_pod(name, mem, cores), "default")
        pod = kube.wait_running("default", name, timeout_s=40)
        assert pod["spec"]["nodeName"] == DYNAMIC_NODE
        (grant,) = grants(pod)[0]  # the charge is the profile's, not the ask's
        model = mig.MODELS["A100-SXM4-80GB"]
        assert (grant.memory_mib, grant.cores) == (
            model.profile_memory_mib(model.profile(profile)),
            model.profile_cores(model.profile(profile)))
        (entry,) = [a for a in kube.containers(DYNAMIC_NODE) if a["name"] == name]
        (container,) = entry["containers"]
        made = {i["uuid"]: i for i in _instances(sim)}
        visible = container["envs"]["NVIDIA_VISIBLE_DEVICES"]
        assert visible in made and made[visible]["profile"] == profile, (visible, made)
        assert container["envs"]["CUDA_VISIBLE_DEVICES"] == visible
        assert container["mounts"] == []  # MIG isolates in hardware: no libvgpu
        assert visible not in seen
        seen.add(visible)
        # the cluster's record (for a ledger rebuilt from the pods) names the instance
        kube.wait_for("the pod's tessera.io/mig-instances",
                      lambda n=name, v=visible: _recorded(sim, n).endswith(f"={v}:;"),
                      timeout_s=20)

    held = [mig.Instance(i["profile"], i["start"]) for i in _instances(sim)]
    assert sorted(i.profile for i in held) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    mig.occupied(mig.MODELS["A100-SXM4-80GB"], held)  # no overlap, a layout NVIDIA allows
    ledger, _ = asyncio.run(_ledger_and_events(sim))
    assert ledger is not None
    recorded = {g.mig.mig_uuid for a in ledger.allocations.values() for g in a.mig_grants()}
    assert recorded == seen

    for name, *_ in asks:
        kube.delete_pod("default", name)
    kube.wait_for("every instance destroyed", lambda: _instances(sim) == [], timeout_s=40)

    def released() -> bool:
        ledger, events = asyncio.run(_ledger_and_events(sim))
        destroyed = {e.mig_uuid for e in events if e.action == "destroyed"}
        return (ledger is None or not ledger.allocations) and seen <= destroyed

    kube.wait_for("the ledger empty and mig.destroyed for each instance", released,
                  timeout_s=30, every_s=0.5)


def test_a_card_holding_a_libvgpu_slice_is_refused_for_mig_with_the_reason(
    sim: RunningStack,
) -> None:
    kube = sim.kube
    kube.create_pod_retrying(_mig_pod("core", 4000, 20, mode="hami-core"), "default")
    pod = kube.wait_running("default", "core", timeout_s=40)
    (grant,) = grants(pod)[0]
    assert grant.uuid == DYNAMIC_GPU and grant.memory_mib == 4000  # a libvgpu slice

    kube.create_pod_retrying(_mig_pod("wants-mig", 8000), "default")
    reason = kube.wait_for("the refusal", lambda: _pending_message(sim, "wants-mig"),
                           timeout_s=20)
    assert "CardMigTopologyInfeasible (the card holds 1 libvgpu slice(s)" in reason, reason
    described = CliRunner().invoke(build_app(), [
        "describe", "pod", "wants-mig", "-n", "default", "--state-dir",
        str(sim.stack.state_dir)])
    assert "the card holds 1 libvgpu slice(s)" in described.output, described.output
    assert _instances(sim) == []

    # once the slice is gone the card switches to MIG and the waiting pod gets its instance
    kube.delete_pod("default", "core")
    kube.wait_running("default", "wants-mig", timeout_s=60)
    assert [i["profile"] for i in _instances(sim)] == ["1g.10gb"]
    kube.delete_pod("default", "wants-mig")
    kube.wait_for("its instance destroyed", lambda: _instances(sim) == [], timeout_s=40)


def test_a_creation_nvml_refuses_fails_the_allocation_with_the_reason(sim: RunningStack) -> None:
    """An operator's instance sits where the scheduler places the pod (it cannot know): NVML
    refuses, the allocation is released (failed) with NVML's reason, the pod gets a Warning
    event saying so. The operator's instance, claimed by no allocation, is destroyed once no
    process runs in it."""
    kube = sim.kube
    state = sim.stack.state_dir / "mig" / f"{DYNAMIC_NODE}.json"
    busy = Path(f"{state}.busy")
    busy.write_text("MIG-operator\n")  # a process runs in it: kept while it does
    tmp = state.with_suffix(".e2e")
    tmp.write_text(json.dumps({DYNAMIC_GPU: [
        {"gi_id": 1, "profile": "1g.10gb", "start": 6, "uuid": "MIG-operator"}]}))
    tmp.rename(state)

    kube.create_pod_retrying(_mig_pod("blocked", 8000), "default")  # 1g.10gb, placed at 6

    def refusal() -> str | None:
        items = kube.http.get("/api/v1/namespaces/default/events").json()["items"]
        return next((e["message"] for e in items if e["reason"] == "MigInstanceFailed"
                     and e["involvedObject"]["name"] == "blocked"), None)

    message = kube.wait_for("the pod's MigInstanceFailed event", refusal, timeout_s=40)
    assert "1g.10gb at slice 6" in message and "Insufficient Resources" in message, message
    ledger, _ = asyncio.run(_ledger_and_events(sim))
    (held,) = [a for a in ledger.allocations.values() if a.name == "blocked"]
    assert held.state == "failed" and "Insufficient Resources" in held.reason
    assert [i["uuid"] for i in _instances(sim)] == ["MIG-operator"]
    kube.delete_pod("default", "blocked")

    busy.write_text("")  # the process ended: the orphan goes after its grace period
    kube.wait_for("the operator's instance destroyed", lambda: _instances(sim) == [],
                  timeout_s=30)

    def operator_destroyed() -> bool:  # the event follows the instance's destruction
        _, events = asyncio.run(_ledger_and_events(sim))
        return "MIG-operator" in {e.mig_uuid for e in events if e.action == "destroyed"}

    kube.wait_for("mig.destroyed for the operator's instance", operator_destroyed,
                  timeout_s=30, every_s=0.5)
