"""Issue 34: the allocation's annotations are protected on every UPDATE that carries the pod's
metadata, its subresources included (`pods/status` writers, e.g. a node's kubelet credential,
could forge a grant there on a real cluster). Through the webhook's HTTP face."""

from __future__ import annotations

import copy
import uuid

import httpx
import pytest
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics

from tessera import hami, signing
from tessera.settings import TesseraSettings

TRUSTED = "system:serviceaccount:tessera-system:"


def update(old: dict, new: dict, username: str, sub_resource: str | None) -> dict:
    resource = {"group": "", "version": "v1", "resource": "pods"}
    kind = {"group": "", "version": "v1", "kind": "Pod"}
    request = {
        "uid": str(uuid.uuid4()), "kind": kind, "resource": resource, "requestKind": kind,
        "requestResource": resource, "name": "train", "namespace": "team",
        "operation": "UPDATE", "userInfo": {"username": username}, "object": new,
        "oldObject": old,
    }  # fmt: skip
    if sub_resource:
        request["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@pytest.fixture
async def webhook():
    settings = TesseraSettings(quota_enabled=False, admission_trusted_user_prefixes=TRUSTED)
    app = AdmissionApp(settings, metrics=AdmissionMetrics())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://webhook") as client:  # fmt: skip
        yield client


BOUND = {
    "metadata": {"name": "train", "namespace": "team", "uid": "u-1", "annotations": {
        hami.ANN_DEVICES_ALLOCATED: "GPU-a,NVIDIA,12000,30:;"}},
    "spec": {"nodeName": "gpu-1", "containers": [{"name": "main"}]},
    "status": {"phase": "Running"},
}  # fmt: skip


@pytest.mark.parametrize("sub_resource", [None, "status", "ephemeralcontainers", "resize"])
@pytest.mark.parametrize("key", [hami.ANN_DEVICES_ALLOCATED, hami.ANN_DEVICES_TO_ALLOCATE,
                                 signing.RECORD_ANNOTATION])
async def test_nobody_but_tessera_sets_the_allocation_record(webhook, sub_resource, key):
    forged = copy.deepcopy(BOUND)
    forged["metadata"]["annotations"][key] = "GPU-b,NVIDIA,24576,100:;"
    for user in ("system:node:gpu-1", "alice"):
        answer = (await webhook.post("/mutate", json=update(BOUND, forged, user, sub_resource))
                  ).json()["response"]  # fmt: skip
        assert answer["allowed"] is False, (sub_resource, key, user)
        assert key in answer["status"]["message"] and user in answer["status"]["message"]
    # The node agent (a trusted Tessera service account) still records what it allocated.
    answer = (await webhook.post("/mutate", json=update(
        BOUND, forged, TRUSTED + "tessera-node-agent", sub_resource))).json()["response"]
    assert answer["allowed"] is True


async def test_a_status_update_leaving_the_record_alone_passes(webhook):
    running = copy.deepcopy(BOUND)
    running["status"] = {"phase": "Running", "podIP": "10.0.0.7"}
    answer = (await webhook.post("/mutate", json=update(BOUND, running, "system:node:gpu-1",
                                                         "status"))).json()["response"]
    assert answer["allowed"] is True
