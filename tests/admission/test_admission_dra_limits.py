"""The ResourceClaimTemplate the DRA webhook writes stays inside resource.k8s.io/v1's limits,
whatever the cluster publishes and whatever the tenant writes in HAMi's annotations.

kube-apiserver refuses a claim spec with more than 8 `firstAvailable` alternatives, more than
32 selectors in a request, or a CEL expression over 10 KiB (kube-sim's validation, tests/
kube_sim, applies the same limits; it is the judge here). The webhook used to write such
templates: a cluster publishing 9 card sizes (or 9 MIG profiles covering an ask) refused
every percentage (or MIG-mode) pod with "cannot create ResourceClaimTemplate", and a tenant's
long `nouse-gputype` list got the API server's field error under a 500. Now: the first 8
alternatives in the order the allocator would try them, with a warning naming what was left
out; a tenant's list too long for a selector is a denial naming the annotation."""

from __future__ import annotations

import httpx
import pytest
from admission_helpers import CORES, GPU, MEM, PCT, container, patched, pod, review
from tessera.admission.app import AdmissionApp
from tessera.admission.dra_templates import DraTemplates
from tessera.admission.metrics import AdmissionMetrics
from tessera.kube_sim.dra.objects import validate_claim_spec

from tessera.cluster.memory import InMemoryCluster
from tessera.settings import TesseraSettings

# nine card sizes a mixed fleet publishes (T4 16G, A10 24G, V100 32G, A100 40/80G, L40S 48G,
# H100 NVL 94G, H200 141G, B200 180G), MiB
SIZES = (16384, 24576, 32768, 40960, 46068, 81920, 95830, 143771, 183359)
# MIG profiles of A100-40GB, A100-80GB, H100-80GB and H200 (name, MiB, compute %)
PROFILES = (("1g.5gb", 4864, 14), ("1g.10gb", 9856, 14), ("2g.10gb", 9856, 28),
            ("1g.12gb", 11008, 14), ("1g.18gb", 16384, 14), ("1g.20gb", 19968, 14),
            ("2g.20gb", 19968, 28), ("3g.20gb", 19968, 42), ("2g.35gb", 33280, 28),
            ("3g.40gb", 40192, 42), ("4g.40gb", 40192, 57), ("7g.80gb", 80384, 100))  # fmt: skip


def client(cluster: InMemoryCluster) -> httpx.AsyncClient:
    settings = TesseraSettings(quota_enabled=False, allocation_mode="dra")
    app = AdmissionApp(settings, metrics=AdmissionMetrics(),
                       dra=DraTemplates(cluster, settings, cache_s=0))  # fmt: skip
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webhook")


async def admit(cluster: InMemoryCluster, obj: dict) -> dict:
    async with client(cluster) as c:
        answer = await c.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


def the_template(cluster: InMemoryCluster, obj: dict, response: dict) -> dict:
    out = patched(obj, response)
    name = out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    spec = cluster._dra()["templates"][("team-a", name)]["spec"]["spec"]
    assert validate_claim_spec(spec, "spec.spec") == []  # what kube-apiserver would store
    return spec


async def publish(cluster: InMemoryCluster, devices: list[dict]) -> None:
    for i in range(0, len(devices), 4):
        await cluster.create_resource_slice({
            "metadata": {"name": f"node-{i}-gpu"},
            "spec": {"driver": "gpu.tessera.io", "nodeName": f"node-{i}",
                     "devices": devices[i:i + 4]},
        })  # fmt: skip


def card(index: int, mib: int) -> dict:
    return {"name": f"gpu-{index}", "capacity": {"memory": {"value": f"{mib}Mi"},
                                                  "cores": {"value": "100"}}}  # fmt: skip


def partition(index: int, name: str, mib: int, cores: int) -> dict:
    return {"name": f"gpu-{index}-mig", "attributes": {"mode": {"string": "mig"},
                                                       "profile": {"string": name}},
            "capacity": {"memory": {"value": f"{mib}Mi"}, "cores": {"value": str(cores)}}}


async def test_a_percentage_on_a_fleet_of_nine_card_sizes_tries_the_eight_largest() -> None:
    cluster = InMemoryCluster()
    await publish(cluster, [card(i, mib) for i, mib in enumerate(SIZES)])
    obj = pod(container("main", {GPU: 1, PCT: 50}))
    response = await admit(cluster, obj)
    assert response["allowed"], response.get("status")
    spec = the_template(cluster, obj, response)
    asked = [o["capacity"]["requests"]["memory"]
             for o in spec["devices"]["requests"][0]["firstAvailable"]]  # fmt: skip
    assert asked == [f"{mib // 2}Mi" for mib in sorted(SIZES, reverse=True)[:8]]
    [warning] = response["warnings"]
    assert "16384 MiB" in warning and "at most 8" in warning and "nvidia.com/gpumem" in warning


def tried_profiles(spec: dict) -> list[str]:
    """The MIG profiles a template's firstAvailable tries, in order (each alternative's last
    selector names its profile)."""
    return [o["selectors"][-1]["cel"]["expression"].rsplit('"', 2)[1]
            for o in spec["devices"]["requests"][0]["firstAvailable"]]  # fmt: skip


async def test_hamis_mig_mode_over_many_covering_profiles_tries_the_eight_smallest() -> None:
    cluster = InMemoryCluster()
    await publish(cluster, [partition(i, *p) for i, p in enumerate(PROFILES)])
    obj = pod(container("main", {GPU: 1, MEM: 4000, CORES: 10}),
              annotations={"nvidia.com/vgpu-mode": "mig"})  # fmt: skip
    response = await admit(cluster, obj)
    assert response["allowed"], response.get("status")
    spec = the_template(cluster, obj, response)
    tried = tried_profiles(spec)
    assert tried == ["1g.5gb", "1g.10gb", "2g.10gb", "1g.12gb", "1g.18gb", "1g.20gb",
                     "2g.20gb", "3g.20gb"]  # fmt: skip
    [warning] = response["warnings"]
    assert "7g.80gb" in warning and "at most 8" in warning


async def test_a_long_nouse_gputype_list_is_one_selector() -> None:
    cluster = InMemoryCluster()
    types = [f"T{i}" for i in range(40)]
    obj = pod(container("main", {GPU: 1, MEM: 1000}),
              annotations={"nvidia.com/nouse-gputype": ",".join(types)})  # fmt: skip
    response = await admit(cluster, obj)
    assert response["allowed"], response.get("status")
    [selector] = the_template(cluster, obj, response)["devices"]["requests"][0]["exactly"][
        "selectors"]  # fmt: skip
    expression = selector["cel"]["expression"]
    assert all(f'"(?i){t}"' in expression for t in types)


@pytest.mark.parametrize(("key", "value"), [
    ("nvidia.com/use-gputype", ",".join(f"Type{i}" for i in range(1000))),
    ("nvidia.com/nouse-gputype", ",".join(f"Type{i}" for i in range(1000))),
    ("nvidia.com/use-gpuuuid", ",".join(f"GPU-{i:036d}" for i in range(400))),
    ("nvidia.com/nouse-gpuuuid", ",".join(f"GPU-{i:036d}" for i in range(400))),
])  # fmt: skip
async def test_a_selection_too_long_for_a_selector_is_denied_naming_the_annotation(
        key: str, value: str) -> None:  # fmt: skip
    cluster = InMemoryCluster()
    response = await admit(cluster, pod(container("main", {GPU: 1, MEM: 1000}),
                                        annotations={key: value}))  # fmt: skip
    assert response["allowed"] is False
    assert response["status"]["code"] == 400
    message = response["status"]["message"]
    assert key in message and "10240" in message, message
    assert not cluster._dra()["templates"]  # nothing half-made


async def test_a_mig_count_in_other_digits_is_denied_not_a_crash() -> None:
    cluster = InMemoryCluster()
    await publish(cluster, [partition(0, "1g.10gb", 9856, 14)])
    for value in ("²", "١", "9" * 5000):
        response = await admit(cluster, pod(container("main", {"nvidia.com/mig-1g.10gb": value})))
        assert response["allowed"] is False
        assert "nvidia.com/mig-1g.10gb" in response["status"]["message"]


async def test_a_review_nested_too_deep_is_a_400_not_a_crash() -> None:
    """A free-form field (managedFields' fieldsV1, a claim's opaque parameters) can nest deeper
    than the DRA conversion's copies and diffs recurse: refused whole, before any rule runs."""
    import json
    import sys

    cluster = InMemoryCluster()
    body = json.dumps(review(pod(container("main", {GPU: 1, MEM: 1000}))))
    depth = sys.getrecursionlimit() - 100  # JSON decodes it; a copy (two frames a level) not
    deep = "[" * depth + "]" * depth
    body = body.replace('"name": "main"', f'"name": "main", "args": {deep}', 1)
    async with client(cluster) as c:
        try:
            answer = await c.post("/mutate", content=body,
                                  headers={"content-type": "application/json"})  # fmt: skip
        except RecursionError:
            pytest.fail("the webhook crashed (RecursionError): a 500 for kube-apiserver")
    assert answer.status_code == 400, answer.text[:300]
    assert "nested deeper than" in answer.json()["error"]
    assert not cluster._dra()["templates"]


async def test_hamis_mig_mode_at_100_percent_of_memory_asks_a_whole_card_instance() -> None:
    """`gpumem-percentage: 100` in HAMi's MIG mode is the card's whole memory (the extender
    fits it after taking the percentage of the card, as HAMi does): only a full-card profile
    covers it. The conversion used to read it as no memory at all and try 1g.5gb first."""
    cluster = InMemoryCluster()
    await publish(cluster, [partition(i, *p) for i, p in enumerate(PROFILES)])
    obj = pod(container("main", {GPU: 1, PCT: 100, CORES: 10}),
              annotations={"nvidia.com/vgpu-mode": "mig"})  # fmt: skip
    response = await admit(cluster, obj)
    assert response["allowed"], response.get("status")
    spec = the_template(cluster, obj, response)
    tried = tried_profiles(spec)
    assert tried == ["7g.80gb"]
