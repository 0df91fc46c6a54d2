"""kube-sim against kube-apiserver's documented behaviour, over HTTP (in process): one test per
row of the conformance table in services/kube-sim/README.md."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tessera.kube_sim.admission import AdmissionWebhook
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.response_warnings import parse_header
from tessera.kube_sim.store import ObjectStore

MEM = "nvidia.com/gpumem"
PODS = "/api/v1/namespaces/default/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}


def gpu_pod(name: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "busybox",
                                     "resources": {"limits": limits}}]}}


def limits(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]["resources"]["limits"]


def warnings_of(reply: httpx.Response) -> list[str]:
    return reply.headers.get_list("warning")


class FakeWebhook:
    """An admission webhook over HTTP that records each AdmissionReview and allows the pod
    with the warnings it is given (the real webhook's warnings are the e2e tests' business)."""

    def __init__(self, warnings: list[str]) -> None:
        self.reviews: list[dict[str, Any]] = []
        self.warnings = warnings

    async def mutate(self, request: Request) -> JSONResponse:
        review = json.loads(await request.body())
        self.reviews.append(review)
        return JSONResponse({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                             "response": {"uid": review["request"]["uid"], "allowed": True,
                                          "warnings": self.warnings}})


@pytest.fixture
async def api() -> Any:
    webhook = FakeWebhook(['resource nvidia.com/gpumen: did you mean "nvidia.com/gpumem"?',
                           "second warning"])
    admit = AdmissionWebhook(  # the webhook over HTTP, served in process
        "http://webhook/mutate", None, transport=httpx.ASGITransport(Starlette(routes=[
            Route("/mutate", webhook.mutate, methods=["POST"])])))
    server = ApiServer(ObjectStore(), admit_pod=admit)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(server.app()),
                                 base_url="http://kube-sim") as client:
        client.webhook = webhook  # type: ignore[attr-defined]
        yield client
    await admit.close()


async def test_quantities_are_stored_read_listed_and_watched_in_canonical_form(api) -> None:
    watch = asyncio.create_task(api.get(PODS, params={"watch": "true", "timeoutSeconds": "1"}))
    await asyncio.sleep(0.05)
    created = await api.post(PODS, json=gpu_pod("p", {"nvidia.com/gpu": 1, MEM: 3000,
                                                      "memory": "1.5Gi", "cpu": 1.5}))
    assert created.status_code == 201, created.text
    expected = {"nvidia.com/gpu": "1", MEM: "3k", "memory": "1536Mi", "cpu": "1500m"}
    assert limits(created.json()) == expected
    assert limits((await api.get(f"{PODS}/p")).json()) == expected
    assert limits((await api.get(PODS)).json()["items"][0]) == expected
    events = [json.loads(line) for line in (await watch).text.splitlines()]
    assert limits(next(e["object"] for e in events if e["type"] == "ADDED")) == expected
    # the exponent family is kept: 1e3 stays 1e3 (a string, or a JSON number as written)
    raw = b'{"metadata": {"name": "e"}, "spec": {"containers": [{"name": "c", "image": "b", ' \
          b'"resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1e3}}}]}}'
    created = await api.post(PODS, content=raw, headers={"Content-Type": "application/json"})
    assert limits(created.json())[MEM] == "1e3"


async def test_workload_templates_quotas_and_patches_are_canonical(api) -> None:
    deployment = {"metadata": {"name": "d"}, "spec": {
        "replicas": 0, "selector": {"matchLabels": {"a": "b"}},
        "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [
            {"name": "c", "image": "x", "resources": {"limits": {MEM: "4000"}}}]}}}}
    reply = await api.post("/apis/apps/v1/namespaces/default/deployments", json=deployment)
    assert limits(reply.json()["spec"]["template"]) == {MEM: "4k"}
    quota = {"metadata": {"name": "q"}, "spec": {"hard": {f"limits.{MEM}": "8000", "pods": 10}}}
    reply = await api.post("/api/v1/namespaces/default/resourcequotas", json=quota)
    assert reply.json()["spec"]["hard"] == {f"limits.{MEM}": "8k", "pods": "10"}
    assert reply.json()["status"]["hard"] == {f"limits.{MEM}": "8k", "pods": "10"}
    patched = await api.patch("/api/v1/namespaces/default/resourcequotas/q", headers=MERGE,
                              json={"spec": {"hard": {"pods": "20000"}}})
    assert patched.json()["spec"]["hard"]["pods"] == "20k"


async def test_a_value_that_is_no_quantity_is_a_decoding_error(api) -> None:
    reply = await api.post(PODS, json=gpu_pod("bad", {MEM: "lots"}))
    assert reply.status_code == 400 and reply.json()["reason"] == "BadRequest"
    assert reply.json()["message"] == (
        'Pod in version "v1" cannot be handled as a Pod: quantities must match the regular '
        "expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
    assert (await api.get(f"{PODS}/bad")).status_code == 404


async def test_an_update_compares_canonical_values(api) -> None:
    """A pod written with `3000` and put back with `3000` (stored `3k`) did not change its
    resources: the update is not refused as a forbidden pod change."""
    await api.post(PODS, json=gpu_pod("u", {"nvidia.com/gpu": "1", MEM: "3000"}))
    current = (await api.get(f"{PODS}/u")).json()
    limits(current)[MEM] = "3000"
    current["metadata"]["labels"] = {"x": "y"}
    reply = await api.put(f"{PODS}/u", json=current)
    assert reply.status_code == 200, reply.text
    assert limits(reply.json())[MEM] == "3k"


async def test_admission_review_carries_canonical_objects_and_warnings_reach_the_client(
        api) -> None:
    reply = await api.post(PODS, json=gpu_pod("w", {"nvidia.com/gpu": "1", MEM: "3000"}))
    assert reply.status_code == 201
    [review] = api.webhook.reviews
    assert limits(review["request"]["object"])[MEM] == "3k"
    assert warnings_of(reply) == [
        '299 - "resource nvidia.com/gpumen: did you mean \\"nvidia.com/gpumem\\"?"',
        '299 - "second warning"']


FIELD_TYPO = (b'{"metadata": {"name": "t"}, "spec": {"containers": [{"name": "c", "image": "b",'
              b' "image": "b2", "resources": {"limit": {"nvidia.com/gpu": "1"}}}]}}')


@pytest.mark.parametrize("mode", ["Strict", "Warn", "Ignore", None])
async def test_field_validation(api, mode: str | None) -> None:
    """Unknown and duplicate fields: 400 under Strict (kubectl's default), stored with a
    Warning each under Warn (the API's default), silently under Ignore."""
    params = {"fieldValidation": mode} if mode else {}
    reply = await api.post(PODS, params=params, content=FIELD_TYPO,
                           headers={"Content-Type": "application/json"})
    problems = ['unknown field "spec.containers[0].resources.limit"',
                'duplicate field "spec.containers[0].image"']
    if mode == "Strict":
        assert reply.status_code == 400
        assert reply.json()["message"] == ('Pod in version "v1" cannot be handled as a Pod: '
                                           f"strict decoding error: {', '.join(problems)}")
        return
    assert reply.status_code == 201, reply.text
    assert reply.json()["spec"]["containers"][0]["image"] == "b2"  # the last one wins
    warned = [parse_header(w) for w in warnings_of(reply)]
    assert [w for w in warned if w and "field" in w] == ([] if mode == "Ignore" else problems)


async def test_quota_status_used_is_what_the_quota_controller_computes() -> None:
    """kube-controller-manager's quota controller: `pods`, native resources and `requests.`
    extended resources counted from non-terminal pods; a key it does not evaluate
    (`limits.nvidia.com/gpumem`) keeps what Tessera's quota service wrote there."""
    from tessera.kube_sim.controllers import WorkloadControllers

    store = ObjectStore()
    server = ApiServer(store)
    controllers = WorkloadControllers(server)
    hard = {"pods": "10", "requests.cpu": "4", "limits.memory": "8Gi",
            "requests.nvidia.com/gpu": "4", f"limits.{MEM}": "8000"}
    await server.create_object("ResourceQuota", "team", {
        "metadata": {"name": "q"}, "spec": {"hard": hard}})
    for name, phase in (("a", "Running"), ("b", "Pending"), ("done", "Succeeded")):
        pod = gpu_pod(name, {"nvidia.com/gpu": "1", MEM: "3000", "cpu": "500m",
                             "memory": "1Gi"})
        created = await server.create_object("Pod", "team", pod)
        store.mutate("Pod", "team", created["metadata"]["name"],
                     lambda p, phase=phase: p["status"].update(phase=phase))

    def write_gpu_usage(quota: dict[str, Any]) -> None:  # as Tessera's quota service does
        quota["status"]["used"] = {**quota["status"].get("used", {}), f"limits.{MEM}": "6k"}

    store.mutate("ResourceQuota", "team", "q", write_gpu_usage)
    await controllers.reconcile()
    status = store.get("ResourceQuota", "team", "q")["status"]
    assert status["hard"] == {**hard, f"limits.{MEM}": "8k"}
    assert status["used"] == {"pods": "2", "requests.cpu": "1", "limits.memory": "2Gi",
                              "requests.nvidia.com/gpu": "2", f"limits.{MEM}": "6k"}


async def test_dry_run_writes_nothing(api) -> None:
    """`dryRun=All` on PATCH, PUT and server-side apply answers with the object as it would be
    (`kubectl apply --dry-run=server`, `kubectl label --dry-run=server`), and stores nothing."""
    await api.post(PODS, json=gpu_pod("d", {"nvidia.com/gpu": "1"}))
    before = (await api.get(f"{PODS}/d")).json()
    patched = await api.patch(f"{PODS}/d", params={"dryRun": "All"}, headers=MERGE,
                              json={"metadata": {"labels": {"tier": "gold"}}})
    assert patched.status_code == 200 and patched.json()["metadata"]["labels"]["tier"] == "gold"
    replaced = {**before, "metadata": {**before["metadata"], "labels": {"tier": "silver"}}}
    put = await api.put(f"{PODS}/d", params={"dryRun": "All"}, json=replaced)
    assert put.status_code == 200 and put.json()["metadata"]["labels"] == {"tier": "silver"}
    applied = await api.patch(f"{PODS}/d", params={"dryRun": "All", "fieldManager": "k"},
                              headers={"Content-Type": "application/apply-patch+yaml"},
                              content=b"apiVersion: v1\nkind: Pod\nmetadata:\n  name: d\n"
                                      b"  labels: {tier: bronze}\n")
    assert applied.status_code == 200 and applied.json()["metadata"]["labels"]["tier"] == "bronze"
    assert (await api.get(f"{PODS}/d")).json() == before  # resourceVersion and all


async def test_request_media_types(api) -> None:
    """YAML bodies are read; a body in a format the server does not read (CBOR, text) is 415
    with kube-apiserver's message, never a misleading 400 (on 415 for CBOR, client-go falls
    back to JSON)."""
    yaml_pod = (b"apiVersion: v1\nkind: Pod\nmetadata: {name: y}\nspec:\n  containers:\n"
                b"  - {name: c, image: b, resources: {limits: {nvidia.com/gpumem: 3000}}}\n")
    created = await api.post(PODS, content=yaml_pod, headers={"Content-Type": "application/yaml"})
    assert created.status_code == 201, created.text
    assert limits(created.json())[MEM] == "3k"
    for media_type in ("application/cbor", "text/plain"):
        refused = await api.post(PODS, content=b"\xa1", headers={"Content-Type": media_type})
        assert refused.status_code == 415 and refused.json()["reason"] == "UnsupportedMediaType"
        assert refused.json()["message"].startswith(
            "the body of the request was in an unknown format - accepted media types include: "
            "application/json, application/yaml")


async def test_limit_ranges_are_served_with_canonical_quantities(api) -> None:
    limit_range = {"metadata": {"name": "gpu"}, "spec": {"limits": [{
        "type": "Container", "max": {MEM: "24000"}, "default": {MEM: 1000},
        "defaultRequest": {"memory": "0.5Gi"}}]}}
    reply = await api.post("/api/v1/namespaces/default/limitranges", json=limit_range)
    assert reply.status_code == 201, reply.text
    [limit] = (await api.get("/api/v1/namespaces/default/limitranges/gpu")).json()["spec"]["limits"]
    assert (limit["max"], limit["default"], limit["defaultRequest"]) == (
        {MEM: "24k"}, {MEM: "1k"}, {"memory": "512Mi"})
