"""A claim whose configuration for gpu.tessera.io is not a valid GpuConfig is refused when it is
written (issue 31), through POST /validate as kube-apiserver sends it (the validating webhook
the chart registers in DRA mode): the API server never checks
a driver's opaque parameters (its reference leaves that to an admission policy of the driver,
as NVIDIA's DRA driver does with a webhook), and before this the mistake surfaced only at
prepare, after the allocator had placed the pod. Other drivers' configuration passes."""

from __future__ import annotations

import httpx
import pytest
from admission_helpers import review
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics

from tessera.settings import TesseraSettings

GPU_CONFIG = {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig"}


def client() -> httpx.AsyncClient:
    app = AdmissionApp(TesseraSettings(quota_enabled=False), metrics=AdmissionMetrics())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webhook")


def claim(config: list, template: bool = False) -> dict:
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.tessera.io"}}], "config": config}}
    return {"apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate" if template else "ResourceClaim",
            "metadata": {"name": "slice", "namespace": "team-a"},
            "spec": {"spec": spec} if template else spec}  # fmt: skip


async def send(obj: dict, operation: str = "CREATE") -> dict:
    kind = {"group": "resource.k8s.io", "version": "v1", "kind": obj["kind"]}
    resource = "resourceclaimtemplates" if obj["kind"] == "ResourceClaimTemplate" else (
        "resourceclaims")  # fmt: skip
    async with client() as c:
        answer = await c.post("/validate", json=review(obj, kind=kind, resource=resource,
                                                     operation=operation))  # fmt: skip
    assert answer.status_code == 200, answer.text
    response: dict = answer.json()["response"]
    return response


def opaque(parameters: object, driver: str = "gpu.tessera.io") -> dict:
    return {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}


@pytest.mark.parametrize("template", [False, True])
@pytest.mark.parametrize(("parameters", "says"), [
    ({**GPU_CONFIG, "sharing": {"strategy": "Exclusive"}}, "sharing.strategy"),
    ({**GPU_CONFIG, "sharing": {"strategy": "MPS"}, "limits": 3}, "limits"),
    ({**GPU_CONFIG, "apiVersion": "gpu.tessera.io/v2"}, "apiVersion"),
    ("MPS", "parameters must be an object"),
])  # fmt: skip
async def test_an_invalid_gpu_config_is_refused_when_written(
    template: bool, parameters: object, says: str
) -> None:
    response = await send(claim([opaque(parameters)], template))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "invalid configuration for gpu.tessera.io" in message, message
    assert says in message, message
    assert "gpu.tessera.io/v1alpha1" in message  # what would be accepted


async def test_valid_configurations_and_other_drivers_pass() -> None:
    good = claim([opaque({**GPU_CONFIG, "sharing": {"strategy": "MPS"}}),
                  opaque({"anything": True}, driver="nic.example.com"),
                  {"requests": ["gpu"]}])  # fmt: skip
    for operation in ("CREATE", "UPDATE"):
        response = await send(good, operation)
        assert response["allowed"] is True and "patch" not in response
    assert (await send(claim([opaque({**GPU_CONFIG})], template=True)))["allowed"] is True


async def test_a_deviceclass_with_an_invalid_gpu_config_is_refused() -> None:
    cls = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
           "metadata": {"name": "mps.gpu.tessera.io"},
           "spec": {"config": [{"opaque": {"driver": "gpu.tessera.io",
                                           "parameters": {"kind": "GpuConfig"}}}]}}  # fmt: skip
    kind = {"group": "resource.k8s.io", "version": "v1", "kind": "DeviceClass"}
    async with client() as c:
        answer = await c.post("/validate", json=review(cls, kind=kind, resource="deviceclasses",
                                                     namespace=""))  # fmt: skip
    response = answer.json()["response"]
    assert response["allowed"] is False
    assert "apiVersion" in response["status"]["message"]


async def test_the_validating_webhook_judges_only_dra_objects() -> None:
    """A pod (the mutating webhook's) or a DELETE reaching /validate passes untouched."""
    pod = {"metadata": {"name": "p", "namespace": "team-a"}, "spec": {"containers": []}}
    async with client() as c:
        answer = await c.post("/validate", json=review(pod))
        assert answer.json()["response"]["allowed"] is True
        bad = claim([opaque("MPS")])
        kind = {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"}
        answer = await c.post("/validate", json=review(bad, kind=kind, operation="DELETE",
                                                       resource="resourceclaims"))  # fmt: skip
        assert answer.json()["response"]["allowed"] is True
        assert (await c.get("/validate")).status_code == 405
        assert (await c.post("/validate", content=b"{")).status_code == 400
