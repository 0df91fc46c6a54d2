"""A mixed cluster on the local stack (`tessera up --nodes-file
examples/vendors/nodes/mixed-cluster.yaml`): an NVIDIA, an Ascend 910B3, a Cambricon MLU370 and a
Hygon Z100L node, each served by a node agent over its vendor's simulated management library.

The issue's "Done when", per vendor: the pod written as HAMi's docs write it is admitted,
placed on a fitting device of its own vendor, prepared with the env/devices its vendor runtime
expects, and released on delete; the Ascend request is granted the smallest covering template,
and a request no template covers pends with the reason. Kubernetes' ResourceQuota counts each
vendor's devices, the simulated DCMI's usage reaches HAMi's host metrics, and the metrics show
every kind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tessera.device_kinds.ascend import annotations as asc_ann
from tessera.device_kinds.ascend.chips import active_chip
from tessera.device_kinds.ascend.dcmi_fake import SimulatedDcmi
from tessera.device_kinds.hygon import annotations as dcu_ann
from tessera.simnodes import load_nodes

from .conftest import RunningStack, grants, start_stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vendors"
NODES = load_nodes(EXAMPLES / "nodes" / "mixed-cluster.yaml")
GPU, NPU, MLU, DCU = "gpu-a10", "npu-910b3", "mlu-370", "dcu-z100"
VENDOR_RESOURCES = {NPU: "huawei.com/Ascend910B3", MLU: "cambricon.com/vmlu",
                    DCU: "hygon.com/dcunum", GPU: "nvidia.com/gpu"}


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def allocatable(sim: RunningStack, node: str) -> dict[str, str]:
    reply = sim.kube.http.get(f"/api/v1/nodes/{node}")
    reply.raise_for_status()
    return reply.json()["status"].get("allocatable") or {}


def container_of(sim: RunningStack, node: str, pod: str) -> dict[str, Any]:
    admitted = [a for a in sim.kube.containers(node) if a["name"] == pod]
    assert admitted, sim.kube.containers(node)
    return admitted[0]["containers"][0]


def pending_message(sim: RunningStack, name: str) -> str:
    pod = sim.kube.pod("default", name)
    for c in pod["status"].get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or ""
    return ""


def paths(entries: list[dict[str, Any]]) -> list[str]:
    return [e["container_path"] for e in entries]


def test_every_vendor_end_to_end(sim: RunningStack) -> None:
    kube = sim.kube
    kube.wait_for("every vendor's devices in the nodes' allocatable", lambda: all(
        int(allocatable(sim, node).get(resource, "0")) > 0
        for node, resource in VENDOR_RESOURCES.items()), timeout_s=40, every_s=0.25)
    node_annotations = {n["metadata"]["name"]: n["metadata"].get("annotations") or {}
                        for n in kube.nodes()}
    npus = asc_ann.decode_register(node_annotations[NPU][asc_ann.register_key("Ascend910B3")])
    assert [(n.type, n.memory_mib, n.ai_core) for n in npus] == [("Ascend910B3", 65536, 20)] * 2
    dcus = dcu_ann.decode_register(node_annotations[DCU][dcu_ann.NODE_REGISTER])
    assert [d.type for d in dcus] == ["DCU-Z100L"] * 2

    # Kubernetes' own ResourceQuota counts each vendor's devices (Tessera's counts NVIDIA's)
    hard = {f"requests.{r}": "4" for r in VENDOR_RESOURCES.values()}
    created = kube.http.post("/api/v1/namespaces/default/resourcequotas", json={
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "devices"},
        "spec": {"hard": hard}})
    assert created.status_code == 201, created.text

    for file in ("ascend-910b3-vnpu.yaml", "cambricon-mlu-smlu.yaml", "hygon-dcu-vdcu.yaml",
                 "nvidia-slice.yaml", "ascend-too-big.yaml"):
        kube.create_pod_retrying(example(file), "default")

    # Ascend: the smallest covering template, handed to the Ascend docker runtime
    npu = kube.wait_running("default", "ascend910b3-pod", timeout_s=40)
    assert npu["spec"]["nodeName"] == NPU
    limits = npu["spec"]["containers"][0]["resources"]["limits"]
    assert str(limits["huawei.com/Ascend910B3-memory"]) == "16384"  # rewritten at admission
    [[grant]] = grants(npu)
    grant_npu = grant
    assert (grant.type, grant.memory_mib, grant.cores) == ("Ascend910B3", 16384, 5)
    main = container_of(sim, NPU, "ascend910b3-pod")
    assert main["envs"]["ASCEND_VNPU_SPECS"] == "vir05_1c_16g"
    assert main["envs"]["ASCEND_VISIBLE_DEVICES"] == str(next(
        n.index for n in npus if n.uuid == grant.uuid))
    info = json.loads(npu["metadata"]["annotations"]["huawei.com/Ascend910B3"])
    assert info == [{"UUID": grant.uuid, "temp": "vir05_1c_16g"}]

    # Cambricon: an sMLU of 16 × 256 MiB and 50 %, its device nodes
    mlu = kube.wait_running("default", "mlu-inference", timeout_s=40)
    assert mlu["spec"]["nodeName"] == MLU
    [[grant]] = grants(mlu)
    assert (grant.type, grant.memory_mib, grant.cores) == ("MLU370-X4", 4096, 50)
    devices = paths(container_of(sim, MLU, "mlu-inference")["devices"])
    assert "/dev/cambricon_ctl" in devices
    assert any(p.startswith("/dev/cambricon-caps/cap_dev") for p in devices), devices

    # Hygon: a vDCU of 2000 MiB and 60 % of the CUs, its vdev file and device nodes
    dcu = kube.wait_running("default", "alexnet-tf-gpu-pod-mem", timeout_s=40)
    assert dcu["spec"]["nodeName"] == DCU
    [[grant]] = grants(dcu)
    assert (grant.type, grant.memory_mib, grant.cores) == ("DCU-Z100L", 2000, 60)
    main = container_of(sim, DCU, "alexnet-tf-gpu-pod-mem")
    assert paths(main["devices"])[:2] == ["/dev/kfd", "/dev/mkfd"]
    vdev_dir = next(m["host_path"] for m in main["mounts"]
                    if m["container_path"] == dcu_ann.VDEV_CONTAINER_DIR)
    (conf_file,) = list(Path(vdev_dir).iterdir())
    conf = dcu_ann.VdevConfig.parse(conf_file.read_text())
    assert (conf.memory_mib, conf.cu_count) == (2000, 36)

    # NVIDIA beside them, on its own card only
    cuda = kube.wait_running("default", "cuda-slice", timeout_s=40)
    assert cuda["spec"]["nodeName"] == GPU

    # each pod's grants under its own vendor's HAMi keys only (HAMi writes NVIDIA's
    # hami.io/vgpu-… for NVIDIA devices only): what HAMi's per-vendor tools read
    keys = {"ascend910b3-pod": "hami.io/Ascend910B3", "mlu-inference": "hami.io/cambricon-mlu",
            "alexnet-tf-gpu-pod-mem": "hami.io/dcu", "cuda-slice": "hami.io/vgpu"}
    for name, prefix in keys.items():
        def recorded(name: str = name, prefix: str = prefix) -> dict[str, str] | None:
            annotations = kube.pod("default", name)["metadata"].get("annotations") or {}
            return annotations if f"{prefix}-devices-allocated" in annotations else None

        annotations = kube.wait_for(f"{name}'s {prefix}-devices-allocated", recorded, 20)
        held = {k for k in annotations if k.endswith(("-devices-to-allocate",
                                                      "-devices-allocated"))}
        assert held == {f"{prefix}-devices-to-allocate", f"{prefix}-devices-allocated"}, held
        assert (annotations[f"{prefix}-devices-allocated"]
                == annotations[f"{prefix}-devices-to-allocate"])

    # no vNPU template covers 90000 MiB: it pends, saying so
    message = kube.wait_for("the uncovered request's reason", lambda: (
        pending_message(sim, "ascend910b3-too-big") if "NoVnpuTemplateCovers" in
        pending_message(sim, "ascend910b3-too-big") else None), timeout_s=30)
    assert "no vNPU template of Ascend910B3 covers 90000" in message
    assert "CardTypeMismatch" in message  # the other vendors' devices are never considered

    def quota_used() -> dict[str, str] | None:
        quota = kube.http.get("/api/v1/namespaces/default/resourcequotas/devices").json()
        used = (quota.get("status") or {}).get("used") or {}
        return used if used.get("requests.huawei.com/Ascend910B3") == "2" else None

    # the NPU pods (one running, one pending: pods count) and one each of the others
    used = kube.wait_for("each vendor's devices in the ResourceQuota", quota_used, timeout_s=30)
    assert (used["requests.cambricon.com/vmlu"], used["requests.hygon.com/dcunum"]) == ("1", "1")

    # usage through the simulated DCMI: what a workload holds on the vNPU's chip, under
    # HAMi's host metric names (its Ascend monitor's too)
    SimulatedDcmi(NPU, active_chip("Ascend910B3"), 2, state_path=str(
        sim.stack.state_dir / "regions" / NPU / "dcmi-Ascend910B3.json")).set_usage(
        next(n.index for n in npus if n.uuid == grant_npu.uuid), 6000, 42)
    metrics_url = f"http://127.0.0.1:{sim.stack.ports.metrics}/metrics"

    def host_usage() -> dict[str, float] | None:
        samples = {s.labels.get("device_uuid"): s.value
                   for f in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text)
                   if f.name == "hami_host_gpu_memory_used_bytes" for s in f.samples}
        return samples if samples.get(grant_npu.uuid) == 6000 << 20 else None

    kube.wait_for("the NPU's used memory in the metrics", host_usage, timeout_s=30)

    # metrics: HAMi's names for every kind
    metrics = httpx.get(metrics_url, timeout=10).text
    for device_type in ("Ascend910B3", "MLU370-X4", "DCU-Z100L", "NVIDIA-NVIDIA A10"):
        assert f'device_type="{device_type}"' in metrics, device_type

    # released on delete: the sMLU and the vDCU are gone, the room is free again
    for name in ("ascend910b3-pod", "mlu-inference", "alexnet-tf-gpu-pod-mem", "cuda-slice",
                 "ascend910b3-too-big"):
        kube.delete_pod("default", name)
    region = sim.stack.state_dir / "regions"
    kube.wait_for("the sMLU and the vDCU destroyed", lambda: not (
        json.loads((region / MLU / "cndev.json").read_text()).get("instances")
        or json.loads((region / DCU / "hysmi.json").read_text()).get("vdevs")), timeout_s=30)
    # both NPUs whole: placed only once the deleted vNPU's chip is free again
    kube.create_pod_retrying(example("ascend-910b3-whole.yaml"), "default")
    whole = kube.wait_running("default", "ascend910b3-whole", timeout_s=40)
    assert sorted(g.memory_mib for g in grants(whole)[0]) == [65536, 65536]
    assert container_of(sim, NPU, "ascend910b3-whole")["envs"] == {
        "ASCEND_VISIBLE_DEVICES": "0,1"}
    kube.delete_pod("default", "ascend910b3-whole")
