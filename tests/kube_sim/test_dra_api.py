"""The resource.k8s.io/v1 kinds as kube-apiserver serves them (in process, over HTTP):
discovery, defaults, validation worded as kube-apiserver's, immutable fields, the claim's
status subresource, canonical quantities, Table columns and field selectors."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

RESOURCE = "/apis/resource.k8s.io/v1"
CLAIMS = f"{RESOURCE}/namespaces/default/resourceclaims"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"



def claim(name: str = "c", **exactly: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com", **exactly}}]}}}


def slice_(name: str = "s", node: str = "node-a", **device: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {
        "driver": "gpu.example.com", "nodeName": node,
        "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0", **device}]}}


async def test_discovery_lists_the_four_kinds(http: httpx.AsyncClient) -> None:
    groups = {g["name"]: g["preferredVersion"]["groupVersion"]
              for g in (await http.get("/apis")).json()["groups"]}
    assert groups["resource.k8s.io"] == "resource.k8s.io/v1"
    listed = (await http.get(RESOURCE)).json()
    by_name = {r["name"]: r for r in listed["resources"]}
    assert {n: (r["kind"], r["namespaced"]) for n, r in by_name.items()} == {
        "deviceclasses": ("DeviceClass", False),
        "resourceclaims": ("ResourceClaim", True),
        "resourceclaims/status": ("ResourceClaim", True),
        "resourceclaimtemplates": ("ResourceClaimTemplate", True),
        "resourceslices": ("ResourceSlice", False),
    }


async def test_requests_are_defaulted_and_invalid_claims_refused(http: httpx.AsyncClient) -> None:
    created = await http.post(CLAIMS, json=claim(tolerations=[{"key": "k", "value": "v"}]))
    assert created.status_code == 201, created.text
    exact = created.json()["spec"]["devices"]["requests"][0]["exactly"]
    assert (exact["allocationMode"], exact["count"]) == ("ExactCount", 1)
    assert exact["tolerations"] == [{"key": "k", "value": "v", "operator": "Equal"}]
    assert created.json()["apiVersion"] == "resource.k8s.io/v1"

    missing = {"metadata": {"name": "m"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {}}]}}}
    refused = await http.post(CLAIMS, json=missing)
    assert refused.status_code == 422
    assert refused.json()["message"] == (
        'ResourceClaim.resource.k8s.io "m" is invalid: '
        "spec.devices.requests[0].exactly.deviceClassName: Required value")
    bad_cel = await http.post(CLAIMS, json=claim("b", selectors=[
        {"cel": {"expression": "device.driver =="}}]))
    assert bad_cel.status_code == 422
    cause = bad_cel.json()["details"]["causes"][0]
    assert cause["field"] == "spec.devices.requests[0].exactly.selectors[0].cel.expression"
    assert "compilation failed" in cause["message"]
    zero = await http.post(CLAIMS, json=claim("z", count=0))
    assert zero.status_code == 422 and "must be greater than zero" in zero.json()["message"]
    constraint = claim("k")
    constraint["spec"]["devices"]["constraints"] = [{"requests": ["nic"],
                                                     "matchAttribute": "numa"}]
    both = (await http.post(CLAIMS, json=constraint)).json()
    assert {c["field"] for c in both["details"]["causes"]} == {
        "spec.devices.constraints[0].requests[0]", "spec.devices.constraints[0].matchAttribute"}


async def test_strict_decoding_refuses_unknown_fields(http: httpx.AsyncClient) -> None:
    typo = {"metadata": {"name": "t"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exact": {"deviceClassName": "gpu.example.com"}}]}}}
    refused = await http.post(CLAIMS, params={"fieldValidation": "Strict"}, json=typo)
    assert refused.status_code == 400
    assert refused.json()["message"] == (
        'ResourceClaim in version "v1" cannot be handled as a ResourceClaim: strict decoding '
        'error: unknown field "spec.devices.requests[0].exact"')
    capacity = claim("k", capacity={"request": {"memory": "1Gi"}})
    refused = await http.post(CLAIMS, params={"fieldValidation": "Strict"}, json=capacity)
    assert 'unknown field "spec.devices.requests[0].exactly.capacity.request"' in (
        refused.json()["message"])


async def test_admin_access_needs_the_namespace_label(http: httpx.AsyncClient) -> None:
    refused = await http.post(CLAIMS, json=claim("admin", adminAccess=True))
    assert refused.status_code == 422
    assert refused.json()["message"] == (
        'ResourceClaim.resource.k8s.io "admin" is invalid: '
        "spec.devices.requests[0].exactly.adminAccess: Forbidden: admin access to devices "
        "requires the `resource.kubernetes.io/admin-access: true` label on the containing "
        "namespace")
    namespace = {"metadata": {"name": "monitoring",
                              "labels": {"resource.kubernetes.io/admin-access": "true"}}}
    assert (await http.post("/api/v1/namespaces", json=namespace)).status_code == 201
    allowed = await http.post(f"{RESOURCE}/namespaces/monitoring/resourceclaims",
                              json=claim("admin", adminAccess=True))
    assert allowed.status_code == 201, allowed.text


async def test_claim_spec_is_immutable_and_status_is_a_subresource(
        http: httpx.AsyncClient) -> None:
    assert (await http.post(CLAIMS, json=claim())).status_code == 201
    patch = {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "other"}}]}}}
    refused = await http.patch(f"{CLAIMS}/c", json=patch,
                               headers={"Content-Type": "application/merge-patch+json"})
    assert refused.status_code == 422
    assert refused.json()["message"] == (
        'ResourceClaim.resource.k8s.io "c" is invalid: spec: Invalid value: "...": '
        "field is immutable")
    status = {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}}
    written = await http.patch(f"{CLAIMS}/c/status", json=status,
                               headers={"Content-Type": "application/merge-patch+json"})
    assert written.status_code == 200, written.text
    assert written.json()["status"]["reservedFor"][0]["name"] == "p"
    table = (await http.get(CLAIMS, headers={"Accept": TABLE})).json()
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "State", "Age"]
    assert table["rows"][0]["cells"][:2] == ["c", "reserved"]


async def test_slices_are_validated_canonical_and_selectable(http: httpx.AsyncClient) -> None:
    slices = f"{RESOURCE}/resourceslices"
    policy = {"value": "4096Mi", "requestPolicy": {"default": "1024Mi",
                                                   "validRange": {"min": "512Mi"}}}
    forbidden = await http.post(slices, json=slice_(capacity={"memory": policy}))
    assert forbidden.status_code == 422
    assert forbidden.json()["details"]["causes"][0] == {
        "reason": "FieldValueForbidden", "field":
        "spec.devices[0].capacity[memory].requestPolicy",
        "message": "Forbidden: allowMultipleAllocations must be true"}
    shared = slice_(capacity={"memory": policy}, allowMultipleAllocations=True)
    created = await http.post(slices, json=shared)
    assert created.status_code == 201, created.text
    memory = created.json()["spec"]["devices"][0]["capacity"]["memory"]
    assert memory == {"value": "4Gi", "requestPolicy": {"default": "1Gi",
                                                        "validRange": {"min": "512Mi"}}}
    assert (await http.post(slices, json=slice_("s2", node="node-b"))).status_code == 201
    two_ways = slice_("s3")
    two_ways["spec"]["allNodes"] = True
    assert (await http.post(slices, json=two_ways)).status_code == 422
    picked = (await http.get(slices, params={"fieldSelector": "spec.nodeName=node-b"})).json()
    assert [s["metadata"]["name"] for s in picked["items"]] == ["s2"]
    moved = await http.patch(f"{slices}/s2", json={"spec": {"nodeName": "node-c"}},
                             headers={"Content-Type": "application/merge-patch+json"})
    assert moved.status_code == 422 and "spec.nodeName" in moved.json()["message"]
    table = (await http.get(slices, headers={"Accept": TABLE})).json()
    assert [c["name"] for c in table["columnDefinitions"]] == [
        "Name", "Node", "Driver", "Pool", "Age"]


async def test_counter_sets_live_in_their_own_slices_of_the_pool(http: httpx.AsyncClient) -> None:
    """KEP-4815 as `resource.k8s.io/v1` has it: a slice holds devices or shared counters, never
    both; a device consumes a counter set another slice of its pool defines."""
    slices = f"{RESOURCE}/resourceslices"
    sets = [{"name": "gpu-0-counters", "counters": {"memory-slice-0": {"value": "1"}}}]
    partition = {"consumesCounters": [{"counterSet": "gpu-0-counters",
                                       "counters": {"memory-slice-0": {"value": "1"}}}]}
    both = slice_("both", **partition)
    both["spec"]["sharedCounters"] = sets
    refused = await http.post(slices, json=both)
    assert refused.status_code == 422
    assert "exactly one of `devices`, `sharedCounters`" in refused.json()["message"]
    two = {"generation": 0, "resourceSliceCount": 2}
    devices = slice_("pool-devices", **partition)
    devices["spec"]["pool"].update(two)
    counters = {"metadata": {"name": "pool-counters"}, "spec": {
        "driver": "gpu.example.com", "nodeName": "node-a", "pool": {"name": "node-a", **two},
        "sharedCounters": sets}}
    assert (await http.post(slices, json=devices)).status_code == 201
    assert (await http.post(slices, json=counters)).status_code == 201
    many = {"metadata": {"name": "many-sets"}, "spec": {
        **counters["spec"], "sharedCounters": [
            {"name": f"set-{i}", "counters": {"c": {"value": "1"}}} for i in range(9)]}}
    too_many = await http.post(slices, json=many)
    assert too_many.status_code == 422 and "at most 8" in too_many.json()["message"]
    crowded = slice_("crowded")
    crowded["spec"]["devices"] = [{"name": f"p-{i}", **partition} for i in range(65)]
    over = await http.post(slices, json=crowded)
    assert over.status_code == 422 and "at most 64" in over.json()["message"]


async def test_device_classes_and_pod_claim_references(http: httpx.AsyncClient) -> None:
    classes = f"{RESOURCE}/deviceclasses"
    bad = {"metadata": {"name": "x"}, "spec": {"selectors": [{"cel": {"expression": "1 +"}}]}}
    assert (await http.post(classes, json=bad)).status_code == 422
    good = {"metadata": {"name": "gpu.example.com"},
            "spec": {"extendedResourceName": "example.com/gpu"}}
    assert (await http.post(classes, json=good)).status_code == 201
    pod = {"metadata": {"name": "p"}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
        "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "nic"}]}}]}}
    refused = await http.post("/api/v1/namespaces/default/pods", json=pod)
    assert refused.status_code == 422
    assert "spec.containers[0].resources.claims[0].name" in refused.json()["message"]


@pytest.mark.parametrize(("path", "body"), [
    (CLAIMS, {"metadata": {"name": "a"}, "spec": {"devices": "x"}}),
    (CLAIMS, {"metadata": {"name": "b"}, "spec": {"devices": {"requests": {"name": "gpu"}}}}),
    (CLAIMS, {"metadata": {"name": "c"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "d", "count": "2",
                                    "capacity": {"requests": "1Gi"}}}]}}}),
    (CLAIMS, {"metadata": {"name": "d"}, "spec": {"devices": {"requests": [
        {"name": ["gpu"], "firstAvailable": "x"}]}}}),
    (f"{RESOURCE}/deviceclasses", {"metadata": {"name": "e"}, "spec": {
        "selectors": [{"cel": [None]}], "config": 1.5}}),
    (f"{RESOURCE}/resourceslices", {"metadata": {"name": "f"}, "spec": {
        "driver": "d.io", "nodeName": "n", "pool": {"name": "n", "resourceSliceCount": "1"},
        "devices": [{"name": "g", "attributes": {"a": "x"}, "capacity": {"m": 1}}]}}),
    (f"{RESOURCE}/namespaces/default/resourceclaimtemplates", {"metadata": {"name": "g"},
                                                              "spec": {"spec": 7}}),
    ("/api/v1/namespaces/default/pods", {"metadata": {"name": "h"}, "spec": {
        "resourceClaims": [{"name": {"a": 1}, "resourceClaimTemplateName": "t"}],
        "containers": [{"name": "c", "image": "i", "resources": 1}]}}),
])
async def test_hostile_bodies_are_refused_never_a_500(http: httpx.AsyncClient, path: str,
                                                      body: dict[str, Any]) -> None:
    response = await http.post(path, json=body)
    assert response.status_code in (400, 422), response.text
    assert response.json()["kind"] == "Status" and response.json()["message"]
