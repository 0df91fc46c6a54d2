"""The HTTP face: bad input gets a 4xx or a denial with a message, never a 5xx; metrics count."""

from __future__ import annotations

import json

import httpx
import pytest
from admission_helpers import GPU, PRIORITY, container, pod, review
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics
from tessera.admission.review import parse_review

from tessera.settings import TesseraSettings


async def test_non_json_body_is_400_with_a_message(client):
    answer = await client.post("/mutate", content=b"{not json")
    assert answer.status_code == 400
    assert "not JSON" in answer.json()["error"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([1, 2], "JSON object"),
        ({"kind": "Pod", "apiVersion": "v1"}, "expected kind AdmissionReview"),
        ({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v2"}, "unsupported"),
        ({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}, "no request"),
        ({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {}},
         "request.uid"),
        ({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
          "request": {"uid": 7}}, "request.uid"),
    ],
)
async def test_wrong_kinds_and_missing_uid_are_400(client, body, words):
    answer = await client.post("/mutate", json=body)
    assert answer.status_code == 400
    assert words in answer.json()["error"]


async def test_deeply_nested_json_is_400_not_a_crash(client):
    answer = await client.post("/mutate", content=b"[" * 100_000 + b"]" * 100_000)
    assert answer.status_code == 400


async def test_huge_body_is_413_before_it_is_read():
    app = AdmissionApp(
        TesseraSettings(quota_enabled=False, admission_max_body_bytes=64 * 1024),
        metrics=AdmissionMetrics(),
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        big = pod(container(env=[{"name": f"V{i}", "value": "x" * 100} for i in range(1000)]))
        answer = await c.post("/mutate", json=review(big))
        assert answer.status_code == 413
        assert "larger than 65536 bytes" in answer.json()["error"]

        async def chunks():  # no Content-Length: the cap applies while reading
            for _ in range(100):
                yield b" " * 4096

        answer = await c.post("/mutate", content=chunks())
        assert answer.status_code == 413


@pytest.mark.parametrize(
    ("kind", "resource"),
    [
        ({"group": "apps", "version": "v1", "kind": "Deployment"}, "deployments"),
        ({"group": "", "version": "v1", "kind": "ConfigMap"}, "configmaps"),
    ],
)
async def test_non_pod_objects_are_denied_with_a_message(client, kind, resource):
    answer = await client.post("/mutate", json=review({"metadata": {}}, kind=kind,
                                                      resource=resource))
    response = answer.json()["response"]
    assert response["allowed"] is False
    assert "pods only" in response["status"]["message"]
    assert kind["kind"] in response["status"]["message"]


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE"])
async def test_a_too_wide_registration_never_blocks_updates_or_deletions(client, operation):
    kind = {"group": "apps", "version": "v1", "kind": "Deployment"}
    answer = await client.post("/mutate", json=review({"metadata": {}}, kind=kind,
                                                      resource="deployments", operation=operation))
    assert answer.json()["response"] == {"uid": answer.json()["response"]["uid"], "allowed": True}


def test_namespace_comes_from_the_pod_when_the_request_has_none():
    body = review(pod(container(limits={GPU: "1"}), namespace="from-pod"))
    body["request"]["namespace"] = ""
    assert parse_review(json.dumps(body).encode()).namespace == "from-pod"


@pytest.mark.parametrize("obj", [None, "a pod", 42, {"spec": "nope"}, {"metadata": {}}])
async def test_pod_request_without_a_usable_object_is_denied(client, obj):
    answer = await client.post("/mutate", json=review(obj))
    assert answer.status_code == 200
    response = answer.json()["response"]
    assert response["allowed"] is False and response["status"]["message"]


async def test_containers_of_the_wrong_shape_are_denied(client):
    for bad in ({"containers": "x"}, {"containers": [1]}, {"containers": [{"resources": 5}]},
                {"containers": [{"resources": {"limits": [GPU]}}]},
                {"containers": [{"resources": {"limits": {PRIORITY: "1"}}, "env": {}}]}):
        obj = {"metadata": {"name": "p"}, "spec": bad}
        response = (await client.post("/mutate", json=review(obj))).json()["response"]
        assert response["allowed"] is False, bad
        assert response["status"]["message"]


@pytest.mark.parametrize("operation", ["DELETE", "CONNECT"])
async def test_only_creations_and_updates_are_reviewed(client, operation):
    obj = pod(container(limits={GPU: "1"}), annotations={"hami.io/bind-phase": "success"})
    response = (await client.post("/mutate", json=review(obj, operation=operation))).json()
    assert response["response"]["allowed"] is True
    assert "patch" not in response["response"]


def update_review(old: dict, new: dict, username: str) -> dict:
    body = review(new, operation="UPDATE")
    body["request"]["oldObject"] = old
    body["request"]["userInfo"]["username"] = username
    return body


async def test_a_user_cannot_change_scheduler_owned_annotations_by_update(client):
    bound = pod(container(limits={GPU: "1"}), annotations={
        "hami.io/vgpu-devices-to-allocate": "GPU-a,NVIDIA,1000,10:;", "team": "a"})
    forged = json.loads(json.dumps(bound))
    forged["metadata"]["annotations"]["hami.io/vgpu-devices-to-allocate"] = "GPU-a,NVIDIA,99,100:;"
    answer = (await client.post("/mutate", json=update_review(bound, forged, "alice"))).json()
    assert answer["response"]["allowed"] is False
    message = answer["response"]["status"]["message"]
    assert "hami.io/vgpu-devices-to-allocate" in message and "alice" in message
    # Adding one is refused too; removing one as well.
    added = json.loads(json.dumps(bound))
    added["metadata"]["annotations"]["hami.io/bind-phase"] = "success"
    assert (await client.post("/mutate", json=update_review(bound, added, "alice"))
            ).json()["response"]["allowed"] is False
    # Other annotations and labels are the user's to change.
    relabelled = json.loads(json.dumps(bound))
    relabelled["metadata"]["annotations"]["team"] = "b"
    answer = (await client.post("/mutate", json=update_review(bound, relabelled, "alice"))).json()
    assert answer["response"]["allowed"] is True and "patch" not in answer["response"]


async def test_another_schedulers_pod_is_its_own_to_annotate(client):
    """HAMi's scheduler annotates its pods while a cluster migrates (rule 2, as on creation);
    ours stay protected whatever the update claims its scheduler is."""
    hami_pod = pod(container(limits={GPU: "1"}))
    hami_pod["spec"]["schedulerName"] = "hami-scheduler"
    annotated = json.loads(json.dumps(hami_pod))
    annotated["metadata"]["annotations"] = {
        "hami.io/vgpu-devices-allocated": "GPU-a,NVIDIA,99,10:;"}
    hami = "system:serviceaccount:kube-system:hami-scheduler"
    review = update_review(hami_pod, annotated, hami)
    assert (await client.post("/mutate", json=review)).json()["response"]["allowed"] is True
    ours = pod(container(limits={GPU: "1"}))
    ours["spec"]["schedulerName"] = "tessera-scheduler"
    review = update_review(ours, annotated, "alice")
    assert (await client.post("/mutate", json=review)).json()["response"]["allowed"] is False


async def test_tessera_components_may_write_their_annotations():
    trusted = "system:serviceaccount:tessera-system:"
    settings = TesseraSettings(quota_enabled=False, admission_trusted_user_prefixes=trusted)
    app = AdmissionApp(settings, metrics=AdmissionMetrics())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://webhook"
    ) as client:
        old = pod(container(limits={GPU: "1"}))
        new = json.loads(json.dumps(old))
        new["metadata"]["annotations"] = {"hami.io/bind-phase": "allocating"}
        ok = update_review(old, new, trusted + "tessera-scheduler")
        assert (await client.post("/mutate", json=ok)).json()["response"]["allowed"] is True
        other = update_review(old, new, "system:serviceaccount:team-a:default")
        assert (await client.post("/mutate", json=other)).json()["response"]["allowed"] is False


async def test_health_readiness_and_unknown_routes(client):
    assert (await client.get("/healthz")).status_code == 200
    assert (await client.get("/readyz")).json() == {"ready": True}
    assert (await client.get("/mutate")).status_code == 405
    assert (await client.get("/nope")).status_code == 404
    for path in ("/metrics", "/healthz", "/readyz"):
        response = await client.post(path, content=b"x")
        assert response.status_code == 405, path
        assert response.headers["allow"] == "GET, HEAD"


async def test_readyz_follows_the_bus_connection():
    connected = {"up": False}
    app = AdmissionApp(TesseraSettings(quota_enabled=False), metrics=AdmissionMetrics(),
                       is_ready=lambda: connected["up"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        assert (await c.get("/readyz")).status_code == 503
        connected["up"] = True
        assert (await c.get("/readyz")).status_code == 200


async def test_metrics_count_results_denials_by_reason_and_latency(client):
    await client.post("/mutate", json=review(pod(container(limits={GPU: "1"}))))
    await client.post("/mutate", json=review(pod(container())))
    await client.post("/mutate", json=review(pod(container(limits={GPU: "abc"}))))
    await client.post("/mutate", json=review(pod(container(limits={GPU: "1"}), nodeName="n")))
    await client.post("/mutate", content=b"garbage")
    text = (await client.get("/metrics")).text
    assert 'tessera_admission_reviews_total{result="mutated"} 1.0' in text
    assert 'tessera_admission_reviews_total{result="allowed"} 1.0' in text
    assert 'tessera_admission_reviews_total{result="denied"} 2.0' in text
    assert 'tessera_admission_reviews_total{result="rejected"} 1.0' in text
    assert 'tessera_admission_denials_total{reason="InvalidRequest"} 1.0' in text
    assert 'tessera_admission_denials_total{reason="NodeNamePreset"} 1.0' in text
    assert "tessera_admission_review_duration_seconds_count 4.0" in text


async def test_response_is_compact_json_with_the_request_uid(client):
    answer = await client.post("/mutate", json=review(pod(container()), uid="abc-123"))
    assert answer.headers["content-type"] == "application/json"
    assert json.loads(answer.content)["response"] == {"uid": "abc-123", "allowed": True}
