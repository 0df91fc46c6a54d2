"""HAMi users' manifests through the real kubectl against the whole local stack: a Deployment
of GPU slices runs (pods made by kube-sim's controllers pass the admission webhook, the
extender places them, the node agent allocates), scales, and goes away with its pods; a pod
asking for a resource no device plugin registered stays Pending with kube-scheduler's reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera_cli.stack import make_nodes

from .conftest import RunningStack, grants, start_stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

KUBECTL = os.environ.get("KUBECTL") or str(Path(sys.executable).parent / "kubectl")

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: cuda-share
  namespace: {namespace}
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: cuda-share}}
  template:
    metadata:
      labels: {{app: cuda-share}}
    spec:
      containers:
      - name: ubuntu-container
        image: ubuntu:22.04
        command: ["bash", "-c", "sleep 86400"]
        resources:
          limits:
            nvidia.com/gpu: 1
            nvidia.com/gpumem: 3000
            nvidia.com/gpucores: 30
"""

MIG_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: mig-slice
  namespace: {namespace}
spec:
  containers:
  - name: main
    image: cuda:12
    resources:
      limits:
        nvidia.com/mig-1g.10gb: 1
"""


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(make_nodes(1, 2, 24576, "NVIDIA A10", prefix="kc-node"))


def kubectl(sim: RunningStack, *args: str, manifest: str | None = None) -> str:
    result = subprocess.run(
        [KUBECTL, "--kubeconfig", str(sim.stack.kubeconfig), *args],
        input=manifest, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def pods(sim: RunningStack, namespace: str) -> list[dict[str, Any]]:
    return json.loads(kubectl(sim, "get", "pods", "-n", namespace, "-o", "json"))["items"]


def test_a_hami_deployment_runs_scales_and_leaves(sim: RunningStack, namespace: str) -> None:
    manifest = DEPLOYMENT.format(namespace=namespace, replicas=2)
    assert "deployment.apps/cuda-share created" in kubectl(sim, "apply", "-f", "-",
                                                           manifest=manifest)
    kubectl(sim, "rollout", "status", "deployment/cuda-share", "-n", namespace, "--timeout=60s")
    running = pods(sim, namespace)
    assert len(running) == 2
    for pod in running:
        assert pod["status"]["phase"] == "Running"
        [[grant]] = grants(pod)  # HAMi's allocation annotation: one slice on one GPU
        assert (grant.memory_mib, grant.cores) == (3000, 30)
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"

    kubectl(sim, "scale", "deployment/cuda-share", "-n", namespace, "--replicas=3")
    kubectl(sim, "rollout", "status", "deployment/cuda-share", "-n", namespace, "--timeout=60s")
    assert sorted(p["status"]["phase"] for p in pods(sim, namespace)) == ["Running"] * 3

    kubectl(sim, "delete", "deployment", "cuda-share", "-n", namespace)
    sim.kube.wait_for("the deployment's pods gone", lambda: not pods(sim, namespace), 30)


def test_a_resource_no_plugin_registered_stays_pending(sim: RunningStack, namespace: str) -> None:
    kubectl(sim, "apply", "-f", "-", manifest=MIG_POD.format(namespace=namespace))
    expected = "0/1 nodes are available: 1 Insufficient nvidia.com/mig-1g.10gb."

    def reason() -> str | None:
        pod = sim.kube.pod(namespace, "mig-slice")
        condition = next((c for c in pod["status"].get("conditions") or []
                          if c["type"] == "PodScheduled" and c["status"] == "False"), None)
        return condition["message"] if condition else None

    assert sim.kube.wait_for("mig-slice unschedulable", reason, 20) == expected
    described = kubectl(sim, "describe", "pod", "mig-slice", "-n", namespace)
    assert "FailedScheduling" in described and expected in described
    pod = sim.kube.pod(namespace, "mig-slice")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    kubectl(sim, "delete", "pod", "mig-slice", "-n", namespace)


def test_a_pod_placed_by_hand_on_a_node_without_the_resource_is_rejected_by_kubelet(
    sim: RunningStack, namespace: str
) -> None:
    """`spec.nodeName` set by the author skips every scheduler; kubelet itself then refuses a
    resource the node does not offer (Failed, OutOf<resource>), never runs it without it."""
    manifest = MIG_POD.format(namespace=namespace).replace(
        "spec:\n  containers:", "spec:\n  nodeName: kc-node-0\n  containers:")
    kubectl(sim, "apply", "-f", "-", manifest=manifest)

    def phase() -> str | None:
        status = sim.kube.pod(namespace, "mig-slice")["status"]
        return status.get("phase") if status.get("phase") != "Pending" else None

    assert sim.kube.wait_for("mig-slice rejected", phase, 20) == "Failed"
    status = sim.kube.pod(namespace, "mig-slice")["status"]
    assert status["reason"] == "OutOfnvidia.com/mig-1g.10gb"
    assert status["message"] == ("Pod was rejected: Node didn't have enough resource: "
                                 "nvidia.com/mig-1g.10gb, requested: 1, used: 0, capacity: 0")
    assert "OutOfnvidia.com/mig-1g.10gb" in kubectl(sim, "get", "events", "-n", namespace)
    kubectl(sim, "delete", "pod", "mig-slice", "-n", namespace)


def kubectl_result(sim: RunningStack, *args: str,
                   manifest: str | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [KUBECTL, "--kubeconfig", str(sim.stack.kubeconfig), *args],
        input=manifest, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result


def test_rollout_undo_of_a_gpu_deployment_keeps_admitting(sim: RunningStack,
                                                           namespace: str) -> None:
    """kubectl re-serialises the template it restores (`gpumem: 4000` comes back `4k`, as Go's
    Quantity writes it): the new pods are admitted and get 4000 MiB, before and after undo."""
    manifest = DEPLOYMENT.format(namespace=namespace, replicas=1).replace(
        "nvidia.com/gpumem: 3000", "nvidia.com/gpumem: 4000")
    kubectl(sim, "apply", "-f", "-", manifest=manifest)
    kubectl(sim, "rollout", "status", "deployment/cuda-share", "-n", namespace, "--timeout=60s")
    stored = json.loads(kubectl(sim, "get", "deployment", "cuda-share", "-n", namespace,
                                "-o", "json"))
    limits = stored["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpumem"] == "4k"  # as kube-apiserver stores it
    kubectl(sim, "set", "image", "deployment/cuda-share", "-n", namespace,
            "ubuntu-container=ubuntu:24.04")
    kubectl(sim, "rollout", "status", "deployment/cuda-share", "-n", namespace, "--timeout=60s")
    kubectl(sim, "rollout", "undo", "deployment/cuda-share", "-n", namespace)
    kubectl(sim, "rollout", "status", "deployment/cuda-share", "-n", namespace, "--timeout=60s")

    def undone() -> list[dict[str, Any]] | None:
        now = [p for p in pods(sim, namespace) if p["status"].get("phase") == "Running"
               and p["spec"]["containers"][0]["image"] == "ubuntu:22.04"]
        return now or None

    [pod] = sim.kube.wait_for("the undone template's pod Running", undone, 30)
    [[grant]] = grants(pod)
    assert grant.memory_mib == 4000
    events = kubectl(sim, "get", "events", "-n", namespace)
    assert "FailedCreate" not in events, events
    kubectl(sim, "delete", "deployment", "cuda-share", "-n", namespace)
    sim.kube.wait_for("the deployment's pods gone", lambda: not pods(sim, namespace), 30)


TYPO_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: typo
  namespace: {namespace}
spec:
  containers:
  - name: main
    image: cuda:12
    resources:
      limits:
        nvidia.com/gpu: 1
        nvidia.com/gpumen: 3000
"""


def test_webhook_warnings_reach_kubectl_and_tessera_apply(sim: RunningStack, namespace: str,
                                                          tmp_path: Path) -> None:
    """The AdmissionReview's `warnings` come back as `Warning: 299` headers: kubectl prints each
    as `Warning: <text>`, and so does `tessera apply`."""
    created = kubectl_result(sim, "apply", "-f", "-",
                             manifest=TYPO_POD.format(namespace=namespace))
    assert "pod/typo created" in created.stdout
    warning = [line for line in created.stderr.splitlines() if line.startswith("Warning: ")]
    assert any("nvidia.com/gpumen" in w and "did you mean nvidia.com/gpumem?" in w
               for w in warning), created.stderr
    kubectl(sim, "delete", "pod", "typo", "-n", namespace)

    small = tmp_path / "small.yaml"
    small.write_text(TYPO_POD.format(namespace=namespace).replace("gpumen: 3000", "gpumem: 4"))
    result = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "apply", "-f", str(small), "--kubeconfig",
         str(sim.stack.kubeconfig)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pod/typo created" in result.stdout
    assert "Warning: container main: limits nvidia.com/gpumem: '4' is 4 MiB" in result.stderr
    assert "implausibly small" in result.stderr and "4096" in result.stderr
    kubectl(sim, "delete", "pod", "typo", "-n", namespace)


QUOTA = """
apiVersion: v1
kind: ResourceQuota
metadata:
  name: gpu
  namespace: {namespace}
spec:
  hard:
    limits.nvidia.com/gpumem: "8000"
    limits.nvidia.com/gpucores: "100"
    requests.nvidia.com/gpu: "2"
    pods: "5"
"""


def test_describe_quota_shows_what_is_used(sim: RunningStack, namespace: str) -> None:
    """Used of the `limits.` GPU keys is Tessera's charge (the quota service writes it), of
    `requests.nvidia.com/gpu` and `pods` the quota controller's count, as on a real cluster."""
    kubectl(sim, "apply", "-f", "-", manifest=QUOTA.format(namespace=namespace))

    def refused() -> bool:  # a pod over the quota is refused once the quota service knows it
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-much"},
                 "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {
                     "nvidia.com/gpu": 1, "nvidia.com/gpumem": 9000}}}]}}
        if sim.kube.create_pod(probe, namespace).status_code == 403:
            return True
        sim.kube.delete_pod(namespace, "too-much")
        sim.kube.wait_for("the probe gone", lambda: all(
            p["metadata"]["name"] != "too-much" for p in sim.kube.pods(namespace)))
        return False

    sim.kube.wait_for("the quota service to take the quota", refused, 30, every_s=0.5)
    kubectl(sim, "apply", "-f", "-", manifest=TYPO_POD.format(namespace=namespace).replace(
        "gpumen: 3000", "gpumem: 3000\n        nvidia.com/gpucores: 30").replace(
        "name: typo", "name: counted"))
    sim.kube.wait_running(namespace, "counted", 30)

    def used() -> dict[str, list[str]] | None:
        rows = {line.split()[0]: line.split()[1:] for line in kubectl(
            sim, "describe", "quota", "gpu", "-n", namespace).splitlines() if line.strip()}
        wanted = {"limits.nvidia.com/gpumem": ["3k", "8k"],
                  "limits.nvidia.com/gpucores": ["30", "100"],
                  "requests.nvidia.com/gpu": ["1", "2"], "pods": ["1", "5"]}
        return rows if all(rows.get(k) == v for k, v in wanted.items()) else None

    sim.kube.wait_for("describe quota to show the usage", used, 30)
    kubectl(sim, "delete", "pod", "counted", "-n", namespace)
