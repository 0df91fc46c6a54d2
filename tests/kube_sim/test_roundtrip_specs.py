"""Every pod spec a user can copy (examples, charts, README/docs snippets) keeps its meaning once
an API server has put its quantities in canonical form (`gpumem: 3000` arrives as `3k`): the
request Tessera reads is the one the user wrote, and the webhook admits it exactly as it admits
the spec as written. The whole-stack half is tests/e2e/test_roundtrip.py."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import httpx
import jsonpatch
import pytest
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics
from tessera.kube_sim.store import decoded

from kube_sim.spec_sources import PodSpec, pod_specs
from tessera import hami
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings(quota_enabled=False)
SPECS = pod_specs()


def test_the_sources_are_found() -> None:
    sources = {s.source.split(":")[0] for s in SPECS}
    assert "charts/examples/verify-slice.yaml" in sources
    assert {"examples/01-three-pods-share-a-gpu.yaml", "examples/04-four-gpus-topology-aware.yaml"
            } <= sources


def as_the_api_server_stores(pod: dict[str, Any]) -> dict[str, Any]:
    return decoded("Pod", json.loads(json.dumps(pod)))  # YAML → JSON (kubectl) → canonical


async def webhook(pod: dict[str, Any]) -> dict[str, Any]:
    app = AdmissionApp(SETTINGS, metrics=AdmissionMetrics())
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE",
        "namespace": "default", "userInfo": {"username": "someone"}, "object": pod}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="https://webhook") as client:
        reply = await client.post("/mutate", json=review)
    return reply.json()["response"]


def mutated(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if not response.get("patch"):
        return pod
    return jsonpatch.apply_patch(copy.deepcopy(pod),
                                 json.loads(base64.b64decode(response["patch"])))


@pytest.mark.parametrize("spec", SPECS, ids=[f"{s.source}/{s.name}" for s in SPECS])
async def test_canonical_quantities_keep_the_request_and_the_verdict(spec: PodSpec) -> None:
    written = json.loads(json.dumps(spec.pod))
    stored = as_the_api_server_stores(spec.pod)
    assert hami.parse_pod_request(stored, SETTINGS) == hami.parse_pod_request(written, SETTINGS)
    as_written, as_stored = await webhook(written), await webhook(stored)
    assert as_stored["allowed"] == as_written["allowed"], (as_written, as_stored)
    if as_written["allowed"]:
        assert (hami.parse_pod_request(mutated(stored, as_stored), SETTINGS)
                == hami.parse_pod_request(mutated(written, as_written), SETTINGS))
    assert as_stored.get("warnings") == as_written.get("warnings")
