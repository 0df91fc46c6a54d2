"""kube-sim's API over HTTP (in process): discovery documents, OpenAPI v3, Table output, Status
errors for unknown paths and methods, the scale subresource."""

from __future__ import annotations

import httpx

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"



async def test_discovery_and_openapi(http: httpx.AsyncClient) -> None:
    assert (await http.get("/api")).json()["versions"] == ["v1"]
    groups = {g["name"]: g["preferredVersion"]["groupVersion"]
              for g in (await http.get("/apis")).json()["groups"]}
    assert groups == {"apps": "apps/v1", "batch": "batch/v1",
                      "admissionregistration.k8s.io": "admissionregistration.k8s.io/v1",
                      "scheduling.k8s.io": "scheduling.k8s.io/v1", "policy": "policy/v1",
                      "resource.k8s.io": "resource.k8s.io/v1"}
    apps = (await http.get("/apis/apps/v1")).json()
    assert apps["kind"] == "APIResourceList" and apps["groupVersion"] == "apps/v1"
    by_name = {r["name"]: r for r in apps["resources"]}
    assert by_name["deployments/scale"]["kind"] == "Scale"
    assert set(by_name["deployments"]["verbs"]) >= {"create", "get", "list", "watch", "patch"}
    root = (await http.get("/openapi/v3")).json()["paths"]
    doc = (await http.get(root["apis/batch/v1"]["serverRelativeURL"])).json()
    patch = doc["paths"]["/apis/batch/v1/namespaces/{namespace}/jobs/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "batch", "version": "v1",
                                                        "kind": "Job"}
    assert "fieldValidation" in {p["name"] for p in patch["parameters"]}
    missing = await http.get("/openapi/v2")
    assert missing.status_code == 404 and missing.json()["reason"] == "NotFound"
    wrong = await http.put("/api/v1/pods")
    assert wrong.status_code == 405 and wrong.json()["kind"] == "Status"
    assert (await http.get("/api/v1/namespaces/default/deployments")).status_code == 404


async def test_tables_and_scale(http: httpx.AsyncClient) -> None:
    deployment = {
        "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "c", "image": "nginx"}]}}},
    }
    created = await http.post("/apis/apps/v1/namespaces/shop/deployments", json=deployment)
    assert created.status_code == 201 and created.json()["apiVersion"] == "apps/v1"
    table = (await http.get("/apis/apps/v1/namespaces/shop/deployments",
                            headers={"Accept": TABLE})).json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"] if c["priority"] == 0] == [
        "Name", "Ready", "Up-to-date", "Available", "Age"]
    assert table["rows"][0]["cells"][:2] == ["web", "0/2"]
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    scale = "/apis/apps/v1/namespaces/shop/deployments/web/scale"
    assert (await http.get(scale)).json()["spec"] == {"replicas": 2}
    patched = await http.patch(scale, json={"spec": {"replicas": 5}},
                               headers={"Content-Type": "application/merge-patch+json"})
    assert patched.json()["spec"]["replicas"] == 5
    negative = await http.patch(scale, json={"spec": {"replicas": -1}},
                                headers={"Content-Type": "application/merge-patch+json"})
    assert negative.status_code == 422
    namespaces = (await http.get("/api/v1/namespaces")).json()["items"]
    assert {"default", "kube-system", "shop"} <= {n["metadata"]["name"] for n in namespaces}
