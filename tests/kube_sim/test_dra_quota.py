"""ResourceQuota for DRA devices in kube-sim, as the Resource Quotas page ("Quota for DRA resource
claims") and the claim evaluator describe it: `<class>.deviceclass.resource.k8s.io/devices`
counts the devices a namespace's claims may get (exact counts summed, `All` as 32, a
`firstAvailable` request as its largest alternative), and the class's extended resource names
count the same devices in their `requests.` form; a ResourceClaim CREATE over a quota is refused
with kube-apiserver's sentence, a claim from a template pends with a warning until the quota has
room; the quota controller writes `status.used` for those keys. In process, over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.controllers import WorkloadControllers
from tessera.kube_sim.dra.claims import ClaimController
from tessera.kube_sim.dra.quota import claim_usage
from tessera.kube_sim.store import ObjectStore, Selector

from kube_sim.dra_cluster import running_cluster
from kube_sim.test_dra_cluster import CLASS, exclusive_slice, running

RESOURCE = "/apis/resource.k8s.io/v1"
NS = "team"
CLAIMS = f"{RESOURCE}/namespaces/{NS}/resourceclaims"
QUOTAS = f"/api/v1/namespaces/{NS}/resourcequotas"
DEVICES = "gpu.tessera.io.deviceclass.resource.k8s.io/devices"
IMPLICIT = "requests.deviceclass.resource.kubernetes.io/gpu.tessera.io"


def exactly(count: int | None = None, cls: str = "gpu.tessera.io", **more: Any) -> dict:
    request: dict[str, Any] = {"deviceClassName": cls, **more}
    if count is not None:
        request["count"] = count
    return request


def claim(name: str, *requests: dict, annotations: dict | None = None,
          owner: dict | None = None) -> dict:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "namespace": NS}
    if annotations:
        meta["annotations"] = annotations
    if owner:
        meta["ownerReferences"] = [owner]
    return {"metadata": meta, "spec": {"devices": {"requests": [
        {"name": f"r{i}", **r} for i, r in enumerate(requests)]}}}  # fmt: skip


def test_what_one_claim_counts() -> None:
    classes = {"gpu.tessera.io": "nvidia.com/gpu"}  # the class's extendedResourceName
    two = claim("a", {"exactly": exactly(2)}, {"exactly": exactly()})
    assert claim_usage(two, classes) == {
        "count/resourceclaims.resource.k8s.io": 1, DEVICES: 3, IMPLICIT: 3,
        "requests.nvidia.com/gpu": 3}
    every = claim("b", {"exactly": exactly(allocationMode="All")})
    assert claim_usage(every, {})[DEVICES] == 32  # the most one allocation can hold
    first = claim("c", {"firstAvailable": [
        {"name": "big", **exactly(4)}, {"name": "small", **exactly(1)},
        {"name": "nic", **exactly(2, cls="nic.example.com")}]})
    usage = claim_usage(first, {})
    assert (usage[DEVICES], usage["nic.example.com.deviceclass.resource.k8s.io/devices"]) == (4, 2)
    assert "requests.nvidia.com/gpu" not in usage  # no extended name without the class's


def test_the_claim_made_for_an_extended_resource_does_not_count_the_pods_request_twice() -> None:
    """The pod asked `nvidia.com/gpu: 2`: the pod evaluator counts `requests.nvidia.com/gpu`;
    the scheduler's claim for it counts the devices and the implicit name, not that again."""
    pod = {"metadata": {"name": "p", "uid": "u1"}, "spec": {"containers": [
        {"name": "main", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}}
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u1", "controller": True}
    special = claim("p-extended-resources-x", {"exactly": exactly(2)}, owner=owner,
                    annotations={"resource.kubernetes.io/extended-resource-claim": "true"})
    classes = {"gpu.tessera.io": "nvidia.com/gpu"}
    assert claim_usage(special, classes, {"u1": pod}) == {
        "count/resourceclaims.resource.k8s.io": 1, DEVICES: 2, IMPLICIT: 2}
    assert claim_usage(special, classes, {})["requests.nvidia.com/gpu"] == 2  # pod gone


@pytest.fixture
async def cluster():
    api = ApiServer(ObjectStore())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(api.app()),
                                 base_url="http://kube-sim") as client:
        client.api = api  # type: ignore[attr-defined]
        assert (await client.post(f"{RESOURCE}/deviceclasses", json={
            "metadata": {"name": "gpu.tessera.io"},
            "spec": {"extendedResourceName": "nvidia.com/gpu"}})).status_code == 201
        yield client


async def test_a_claim_over_the_quota_is_refused_with_kube_apiservers_sentence(cluster) -> None:
    quota = {"metadata": {"name": "gpus"}, "spec": {"hard": {DEVICES: "3", "cpu": "8"}}}
    assert (await cluster.post(QUOTAS, json=quota)).status_code == 201
    assert (await cluster.post(CLAIMS, json=claim("one", {"exactly": exactly(2)}))
            ).status_code == 201  # fmt: skip
    reply = await cluster.post(CLAIMS, json=claim("two", {"exactly": exactly(2)}))
    assert reply.status_code == 403, reply.text
    assert reply.json()["reason"] == "Forbidden"
    assert reply.json()["message"] == (
        'resourceclaims.resource.k8s.io "two" is forbidden: exceeded quota: gpus, requested: '
        f"{DEVICES}=2, used: {DEVICES}=2, limited: {DEVICES}=3")
    assert (await cluster.get(f"{CLAIMS}/two")).status_code == 404  # nothing stored
    every = await cluster.post(CLAIMS, json=claim("all", {"exactly": exactly(
        allocationMode="All")}))  # fmt: skip
    assert every.status_code == 403 and f"requested: {DEVICES}=32" in every.text
    assert (await cluster.post(CLAIMS, json=claim("three", {"exactly": exactly(1)}))
            ).status_code == 201  # fmt: skip
    assert (await cluster.delete(f"{CLAIMS}/one")).status_code == 200
    assert (await cluster.post(CLAIMS, json=claim("two", {"exactly": exactly(2)}))
            ).status_code == 201  # room again once a claim went  # fmt: skip

    # the extended resource's key counts claims of its class too (and pods' requests)
    extended = {"metadata": {"name": "ext"}, "spec": {"hard": {"requests.nvidia.com/gpu": "3"}}}
    assert (await cluster.post(QUOTAS, json=extended)).status_code == 201
    reply = await cluster.post(CLAIMS, json=claim("four", {"exactly": exactly(1)}))
    assert reply.status_code == 403
    assert "exceeded quota: ext, requested: requests.nvidia.com/gpu=1, used: " \
           "requests.nvidia.com/gpu=3, limited: requests.nvidia.com/gpu=3" in reply.text
    # a claim of another class is not this quota's
    other = claim("nic", {"exactly": exactly(1, cls="nic.example.com")})
    assert (await cluster.post(CLAIMS, json=other)).status_code == 201

    # the quota controller writes status.used for the DRA keys
    WorkloadControllers(cluster.api).sync_quotas()
    used = (await cluster.get(f"{QUOTAS}/gpus")).json()["status"]["used"]
    assert used == {DEVICES: "3", "cpu": "0"}
    used = (await cluster.get(f"{QUOTAS}/ext")).json()["status"]["used"]
    assert used == {"requests.nvidia.com/gpu": "3"}


async def wait_for(condition, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_claim_from_a_template_waits_for_room_in_the_quota(cluster) -> None:
    store: ObjectStore = cluster.api.store
    controller = ClaimController(store)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        quota = {"metadata": {"name": "gpus"}, "spec": {"hard": {DEVICES: "1"}}}
        assert (await cluster.post(QUOTAS, json=quota)).status_code == 201
        assert (await cluster.post(CLAIMS, json=claim("held", {"exactly": exactly(1)}))
                ).status_code == 201  # fmt: skip
        template = {"metadata": {"name": "slice"},
                    "spec": {"spec": claim("x", {"exactly": exactly(1)})["spec"]}}
        assert (await cluster.post(f"{RESOURCE}/namespaces/{NS}/resourceclaimtemplates",
                                   json=template)).status_code == 201  # fmt: skip
        pod = {"metadata": {"name": "trainer"}, "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "slice"}],
            "containers": [{"name": "main", "image": "cuda",
                            "resources": {"claims": [{"name": "gpu"}]}}]}}  # fmt: skip
        assert (await cluster.post(f"/api/v1/namespaces/{NS}/pods", json=pod)
                ).status_code == 201  # fmt: skip

        def warnings() -> list[str]:
            return [e["message"] for e in store.list("Event", Selector(namespace=NS))
                    if e.get("reason") == "FailedResourceClaimCreation"]

        await wait_for(lambda: warnings())
        assert warnings() == [
            "PodResourceClaim gpu: create ResourceClaim trainer-gpu-: resourceclaims.resource."
            f"k8s.io is forbidden: exceeded quota: gpus, requested: {DEVICES}=1, used: "
            f"{DEVICES}=1, limited: {DEVICES}=1"]
        names = {c["metadata"]["name"] for c in store.list("ResourceClaim", Selector())}
        assert names == {"held"}

        assert (await cluster.delete(f"{CLAIMS}/held")).status_code == 200

        def recorded() -> list:
            found = store.get("Pod", NS, "trainer")
            return (found.get("status") or {}).get("resourceClaimStatuses") or []

        await wait_for(lambda: recorded())
        [status] = recorded()
        assert status["name"] == "gpu" and status["resourceClaimName"].startswith("trainer-gpu-")
        assert len(warnings()) == 1  # told once
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_the_claim_for_an_extended_resource_is_held_to_the_quota() -> None:
    """The scheduler creates a pod's extended-resource claim through the API upstream, so quota
    admission judges it: a pod whose devices would exceed the class's quota is not bound (the
    sentence in its FailedScheduling event) and runs once the quota has room; the quota counts
    its devices once, though the pod's own `requests.example.com/gpu` counts it too."""
    cls = CLASS["metadata"]["name"]
    async with running_cluster(["node-a"]) as cluster:
        await cluster.plugin("node-a")
        mapped = {**CLASS, "spec": {**CLASS["spec"], "extendedResourceName": "example.com/gpu"}}
        await cluster.create(f"{RESOURCE}/deviceclasses", mapped)
        exclusive = exclusive_slice("node-a", gpus=2)
        await cluster.create(f"{RESOURCE}/resourceslices", exclusive)
        key = f"{cls}.deviceclass.resource.k8s.io/devices"
        await cluster.create("/api/v1/namespaces/default/resourcequotas", {
            "metadata": {"name": "gpus"},
            "spec": {"hard": {key: "1", "requests.example.com/gpu": "2"}}})
        body = {"metadata": {"name": "first"}, "spec": {"containers": [
            {"name": "main", "image": "cuda:12",
             "resources": {"limits": {"example.com/gpu": "1"}}}]}}
        await cluster.create("/api/v1/namespaces/default/pods", body)
        await running(cluster, "first")
        await cluster.create("/api/v1/namespaces/default/pods",
                             {**body, "metadata": {"name": "second"}})
        sentence = (f"exceeded quota: gpus, requested: {key}=1, used: {key}=1, "
                    f"limited: {key}=1")

        async def refused() -> bool:
            return any(sentence in m for m in await cluster.events("FailedScheduling",
                                                                   "second"))

        await cluster.wait_for("second refused by the quota", refused)

        async def used() -> dict | None:
            quota = await cluster.get("/api/v1/namespaces/default/resourcequotas/gpus")
            return (quota.get("status") or {}).get("used") or {}

        async def counted() -> bool:  # both pods' requests (2), the one claim's device once
            return await used() == {key: "1", "requests.example.com/gpu": "2"}

        await cluster.wait_for("the quota controller's count", counted)
        await cluster.http.delete("/api/v1/namespaces/default/pods/first")
        await running(cluster, "second")
