"""DRA mode through POST /mutate: HAMi's resources and annotations become ResourceClaims.

The templates are created through the cluster port (the in-memory cluster here; kube-sim and
real kubectl in tests/e2e/test_dra_stack.py)."""

from __future__ import annotations

import httpx
from admission_helpers import CORES, GPU, MEM, PCT, container, patched, pod, review
from tessera.admission.app import AdmissionApp
from tessera.admission.dra_templates import DraTemplates
from tessera.admission.metrics import AdmissionMetrics

from tessera.cluster.memory import InMemoryCluster
from tessera.settings import TesseraSettings


def client(cluster: InMemoryCluster | None, **values: object) -> httpx.AsyncClient:
    settings = TesseraSettings(quota_enabled=False, allocation_mode="dra", **values)
    app = AdmissionApp(settings, metrics=AdmissionMetrics(),
                       dra=DraTemplates(cluster, settings, cache_s=0))  # fmt: skip
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webhook")


async def admit(c: httpx.AsyncClient, obj: dict) -> dict:
    answer = await c.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


def template_spec(cluster: InMemoryCluster, namespace: str, name: str) -> dict:
    return cluster._dra()["templates"][(namespace, name)]["spec"]["spec"]


async def test_a_slice_request_becomes_a_claim_with_capacity_requests():
    cluster = InMemoryCluster()
    obj = pod(container("main", {GPU: 1, MEM: 4096, CORES: 30}), container("side"),
              annotations={"nvidia.com/use-gputype": "A100,H100",
                           "nvidia.com/nouse-gpuuuid": "GPU-bad"})  # fmt: skip
    async with client(cluster) as c:
        response = await admit(c, obj)
    out = patched(obj, response)
    main = out["spec"]["containers"][0]
    assert "limits" not in main["resources"]  # no extended resource left for kube-scheduler
    assert main["resources"]["claims"] == [{"name": "tessera-gpu-0"}]
    assert "claims" not in (out["spec"]["containers"][1].get("resources") or {})
    [entry] = out["spec"]["resourceClaims"]
    assert entry["name"] == "tessera-gpu-0"
    assert out["spec"].get("schedulerName") in (None, "default-scheduler")
    spec = template_spec(cluster, "team-a", entry["resourceClaimTemplateName"])
    [request] = spec["devices"]["requests"]
    exact = request["exactly"]
    assert exact["deviceClassName"] == "gpu.tessera.io" and exact["count"] == 1
    assert exact["capacity"]["requests"] == {"memory": "4096Mi", "cores": "30"}
    cel = [s["cel"]["expression"] for s in exact["selectors"]]
    assert cel[0] == (
        'device.attributes["gpu.tessera.io"].type.matches("(?i)A100") || '
        'device.attributes["gpu.tessera.io"].type.matches("(?i)H100")'
    )
    assert cel[1] == '!(device.attributes["gpu.tessera.io"].uuid in ["GPU-bad"])'


async def test_same_asks_share_one_template_and_several_gpus_are_distinct_cards():
    cluster = InMemoryCluster()
    async with client(cluster) as c:
        one = patched(p := pod(container("a", {GPU: 2, MEM: 1000}),
                               annotations={"nvidia.com/numa-bind": "true"}),
                      await admit(c, p))  # fmt: skip
        two = patched(q := pod(container("b", {GPU: 2, MEM: 1000}),
                               annotations={"nvidia.com/numa-bind": "true"}),
                      await admit(c, q))  # fmt: skip
    name = one["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    assert two["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == name
    spec = template_spec(cluster, "team-a", name)
    assert spec["devices"]["requests"][0]["exactly"]["capacity"]["requests"] == {
        "memory": "1000Mi",
        "cores": "0",
    }
    assert spec["devices"]["constraints"] == [
        {"requests": ["gpu"], "distinctAttribute": "gpu.tessera.io/uuid"},
        {"requests": ["gpu"], "matchAttribute": "gpu.tessera.io/numa"},
    ]


async def test_a_bare_gpu_is_a_whole_card_and_a_percentage_follows_the_published_sizes():
    cluster = InMemoryCluster()
    for node, size in (("n1", "81920Mi"), ("n2", "40Gi")):
        await cluster.create_resource_slice(
            {
                "metadata": {"name": f"{node}-gpu"},
                "spec": {
                    "driver": "gpu.tessera.io",
                    "nodeName": node,
                    "devices": [{"name": "gpu-0", "capacity": {"memory": {"value": size}}}],
                },
            }
        )
    async with client(cluster) as c:
        whole = patched(p := pod(container("w", {GPU: 1})), await admit(c, p))
        half = patched(q := pod(container("h", {GPU: 1, PCT: 50})), await admit(c, q))
    spec = template_spec(
        cluster, "team-a", whole["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    )
    # no memory asked: the request policy's default (the card); cores 100 as HAMi adds them
    assert spec["devices"]["requests"][0]["exactly"]["capacity"]["requests"] == {"cores": "100"}
    spec = template_spec(
        cluster, "team-a", half["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    )
    options = spec["devices"]["requests"][0]["firstAvailable"]
    assert [o["capacity"]["requests"]["memory"] for o in options] == ["40960Mi", "20480Mi"]
    assert options[0]["selectors"][-1]["cel"]["expression"] == (
        'device.capacity["gpu.tessera.io"].memory.compareTo(quantity("81920Mi")) == 0'
    )


async def test_percentage_without_published_gpus_is_denied_with_a_way_out():
    async with client(InMemoryCluster()) as c:
        response = await admit(c, pod(container("h", {GPU: 1, PCT: 50})))
    assert response["allowed"] is False
    assert "ask nvidia.com/gpumem" in response["status"]["message"]


async def test_an_extender_pod_in_a_dra_cluster_keeps_its_resources():
    async with client(InMemoryCluster()) as c:
        obj = pod(
            container("m", {GPU: 1, MEM: 2000}),
            annotations={"tessera.io/allocation-mode": "extender"},
        )
        out = patched(obj, await admit(c, obj))
    assert out["spec"]["schedulerName"] == "tessera-scheduler"
    assert out["spec"]["containers"][0]["resources"]["limits"][GPU] == 1
    assert "resourceClaims" not in out["spec"]


def _selected(expressions: list[str], device_type: str, uuid: str = "GPU-1") -> bool:
    """kube-sim's CEL (cel-python, as the allocator evaluates selectors) on one device."""
    from fractions import Fraction

    from tessera.kube_sim.dra import cel

    activation = cel.device_activation(
        "gpu.tessera.io",
        {"gpu.tessera.io/type": {"string": device_type}, "gpu.tessera.io/uuid": {"string": uuid},
         "gpu.tessera.io/mode": {"string": "hami-core"}},
        {"gpu.tessera.io/memory": Fraction(80 << 30)}, True,
    )  # fmt: skip
    return all(cel.evaluate(e, activation) for e in expressions)


async def test_hostile_annotations_stay_literals_in_the_selectors():
    cluster = InMemoryCluster()
    hostile = 'A100") || true || ("'
    obj = pod(container("m", {GPU: 1, MEM: 1000}),
              annotations={"nvidia.com/use-gputype": f"{hostile},a.*",
                           "nvidia.com/use-gpuuuid": 'GPU-1"] || true || ["x'})  # fmt: skip
    async with client(cluster) as c:
        out = patched(obj, await admit(c, obj))
    spec = template_spec(cluster, "team-a", out["spec"]["resourceClaims"][0][
        "resourceClaimTemplateName"])  # fmt: skip
    cel = [s["cel"]["expression"] for s in spec["devices"]["requests"][0]["exactly"]["selectors"]]
    # neither the quote nor the regex metacharacters escape their literal: no device matches
    assert not _selected(cel, "NVIDIA-A100-SXM4-80GB")
    assert not _selected(cel, "NVIDIA-H100", uuid="GPU-1")
    # HAMi's own matching still works: case-insensitive substring, exact UUIDs
    assert _selected(selectors_for({"nvidia.com/use-gputype": "a100"}), "NVIDIA-A100-SXM4-80GB")
    assert not _selected(selectors_for({"nvidia.com/use-gputype": "a100"}), "NVIDIA-H100")
    assert not _selected(selectors_for({"nvidia.com/nouse-gpuuuid": "GPU-1"}), "NVIDIA-H100")


def selectors_for(annotations: dict[str, str]) -> list[str]:
    from tessera.admission.dra_claims import selectors

    return selectors(annotations)


async def test_a_dry_run_creates_no_template():
    cluster = InMemoryCluster()
    async with client(cluster) as c:
        answer = await c.post("/mutate", json=review(pod(container("m", {GPU: 1, MEM: 1000})),
                                                     dry_run=True))  # fmt: skip
    assert answer.json()["response"]["allowed"] is True
    assert cluster._dra()["templates"] == {}



async def test_a_priority_without_a_gpu_keeps_its_env_and_loses_the_resource_nothing_serves():
    """`nvidia.com/priority` alone asks no GPU; in DRA mode no device plugin serves that name, so
    kubelet would refuse the pod for good. The webhook keeps HAMi's env and drops the resource."""
    obj = pod(container("main", {"nvidia.com/priority": 1}))
    async with client(InMemoryCluster()) as c:
        response = await admit(c, obj)
    assert response["allowed"]
    main = patched(obj, response)["spec"]["containers"][0]
    assert not any(k.startswith("nvidia.com/") for k in (main.get("resources") or {}).get(
        "limits", {}))
    assert {"name": "CUDA_TASK_PRIORITY", "value": "1"} in main["env"]
    assert "resourceClaims" not in patched(obj, response)["spec"]


async def publish_mig_and_mps_cards(cluster: InMemoryCluster) -> None:
    """What a DRA node agent publishes for an A100 in dynamic MIG and a 16 GiB card in MPS
    mode."""
    from tessera.node_agent.dra.slices import build_slices

    from tessera.models import DeviceInfo, MigCapability

    cards = [
        DeviceInfo(uuid="GPU-mig", index=0, type="NVIDIA-A100-SXM4-80GB", memory_mib=81920,
                   mode="mig", mig=MigCapability(model="A100-SXM4-80GB")),
        DeviceInfo(uuid="GPU-mps", index=1, type="NVIDIA-A100-SXM4-80GB", memory_mib=16384,
                   mode="mps"),
    ]  # fmt: skip
    for published in build_slices("node-a", cards, generation=1, driver_version="560.35.03"):
        await cluster.create_resource_slice(published)


async def test_hami_mig_mode_asks_the_smallest_covering_mig_profile():
    cluster = InMemoryCluster()
    await publish_mig_and_mps_cards(cluster)
    obj = pod(container("main", {GPU: 1, MEM: 15000, CORES: 20}),
              annotations={"nvidia.com/vgpu-mode": "mig"})  # fmt: skip
    async with client(cluster) as c:
        out = patched(obj, await admit(c, obj))
    name = out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    [request] = template_spec(cluster, "team-a", name)["devices"]["requests"]
    choices = request["firstAvailable"]
    # 1g.10gb and 1g.20gb give 14 % of the compute: too little; the others by size
    assert [c["name"] for c in choices] == ["mig-2g-20gb", "mig-3g-40gb", "mig-4g-40gb",
                                            "mig-7g-80gb"]  # fmt: skip
    first = choices[0]
    assert first["deviceClassName"] == "mig.gpu.tessera.io" and "capacity" not in first
    assert first["selectors"][-1]["cel"]["expression"] == (
        'device.attributes["gpu.tessera.io"].profile == "2g.20gb"')


async def test_hami_mps_mode_asks_the_mps_class_and_no_profile_too_big_is_a_denial():
    cluster = InMemoryCluster()
    await publish_mig_and_mps_cards(cluster)
    mps = pod(container("main", {GPU: 1, MEM: 4096, CORES: 30}),
              annotations={"nvidia.com/vgpu-mode": "mps"})  # fmt: skip
    huge = pod(container("main", {GPU: 1, MEM: 100000, CORES: 20}),
               annotations={"nvidia.com/vgpu-mode": "mig"})  # fmt: skip
    async with client(cluster) as c:
        out = patched(mps, await admit(c, mps))
        refused = await admit(c, huge)
    name = out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    [request] = template_spec(cluster, "team-a", name)["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mps.gpu.tessera.io"
    assert request["exactly"]["capacity"]["requests"] == {"memory": "4096Mi", "cores": "30"}
    two = pod(container("main", {GPU: 2, MEM: 4096}), annotations={"nvidia.com/vgpu-mode": "mps"})
    async with client(cluster) as c:
        two_cards = await admit(c, two)
    assert two_cards["allowed"] is False and "an MPS container holds one GPU" in (
        two_cards["status"]["message"])
    assert refused["allowed"] is False
    assert "no MIG profile published in DRA mode covers 100000 MiB" in (
        refused["status"]["message"])


async def test_nvidia_mig_resources_become_a_claim_per_profile_and_bad_ones_a_denial():
    cluster = InMemoryCluster()
    await publish_mig_and_mps_cards(cluster)
    obj = pod(container("vllm", {"nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": "1"}),
              container("side"))  # fmt: skip
    bad = pod(container("vllm", {"nvidia.com/mig-huge": 1}))
    both = pod(container("vllm", {GPU: 1, MEM: 1000, "nvidia.com/mig-1g.10gb": 1}))
    async with client(cluster) as c:
        out = patched(obj, await admit(c, obj))
        refused = await admit(c, bad)
        mixed = await admit(c, both)
    vllm = out["spec"]["containers"][0]
    assert "limits" not in vllm["resources"]  # nothing left for a device plugin that is not there
    [entry] = out["spec"]["resourceClaims"]
    assert vllm["resources"]["claims"] == [{"name": entry["name"]}]
    requests = template_spec(cluster, "team-a", entry["resourceClaimTemplateName"])[
        "devices"]["requests"]
    assert [(r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"],
             r["exactly"]["selectors"][-1]["cel"]["expression"]) for r in requests] == [
        ("mig-1g-10gb", "mig.gpu.tessera.io", 2,
         'device.attributes["gpu.tessera.io"].profile == "1g.10gb"'),
        ("mig-3g-40gb", "mig.gpu.tessera.io", 1,
         'device.attributes["gpu.tessera.io"].profile == "3g.40gb"')]  # fmt: skip
    assert refused["allowed"] is False and "is not a MIG profile name" in (
        refused["status"]["message"])
    assert mixed["allowed"] is False and "one Tessera claim per container" in (
        mixed["status"]["message"])
