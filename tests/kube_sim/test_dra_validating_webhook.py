"""kube-sim calls the DRA validating webhook as kube-apiserver calls the chart's
ValidatingWebhookConfiguration (issue 31): a ResourceClaim, ResourceClaimTemplate or DeviceClass
with configuration for gpu.tessera.io is sent to /validate after its own validation, and a claim
whose GpuConfig is invalid is refused when it is created, with the webhook's sentence. An object
without configuration for the driver is not sent (the chart's match condition, in CEL). kube-sim's
HTTP face and the webhook's HTTP face, joined in-process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics
from tessera.kube_sim.admission import AdmissionWebhook
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.dra.validating_webhook import DraValidatingWebhook
from tessera.kube_sim.identity import TokenTable
from tessera.kube_sim.store import ObjectStore

from tessera.settings import TesseraSettings

BASE = "/apis/resource.k8s.io/v1"
GPU_CONFIG = {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig"}


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.tokens = TokenTable.load_or_create(tmp_path / "tokens.json")
        app = AdmissionApp(TesseraSettings(quota_enabled=False), metrics=AdmissionMetrics())
        self.sent: list[dict] = []

        async def recording(scope, receive, send):  # the reviews kube-sim sends, kept
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            self.sent.append({"path": scope["path"], **json.loads(body)})

            async def replay():
                return {"type": "http.request", "body": body, "more_body": False}

            return await app(scope, replay, send)

        self.webhook = AdmissionWebhook("http://webhook/validate", None,
                                        transport=httpx.ASGITransport(app=recording))
        self.api = ApiServer(ObjectStore(), None, tokens=self.tokens)
        self.api.validate_dra = DraValidatingWebhook(self.webhook)
        self.transport = httpx.ASGITransport(app=self.api.app())

    def client(self) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.tokens.issued['admin']}"}
        return httpx.AsyncClient(transport=self.transport, base_url="http://kube-sim",
                                 headers=headers)


@pytest.fixture
async def cluster(tmp_path: Path):
    cluster = Cluster(tmp_path)
    yield cluster
    await cluster.webhook.close()


def claim(name: str, config: list) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.tessera.io"}}], "config": config}}}  # fmt: skip


def opaque(parameters: object, driver: str = "gpu.tessera.io") -> dict:
    return {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}


async def test_an_invalid_gpu_config_is_refused_when_the_claim_is_created(cluster: Cluster) -> None:
    async with cluster.client() as c:
        bad = claim("bad", [opaque({**GPU_CONFIG, "sharing": {"strategy": "Exclusive"}})])
        reply = await c.post(f"{BASE}/namespaces/team/resourceclaims", json=bad)
        assert reply.status_code == 403, reply.text
        message = reply.json()["message"]
        assert message.startswith('admission webhook "resourceclaims.dra.admission.tessera.io" '
                                  "denied the request: ResourceClaim bad: invalid configuration "
                                  "for gpu.tessera.io: ")  # fmt: skip
        assert "sharing.strategy" in message and "TimeSlicing or MPS" in message
        missing = await c.get(f"{BASE}/namespaces/team/resourceclaims/bad")
        assert missing.status_code == 404  # nothing stored

        good = claim("good", [opaque({**GPU_CONFIG, "sharing": {"strategy": "MPS"}})])
        assert (await c.post(f"{BASE}/namespaces/team/resourceclaims", json=good)
                ).status_code == 201  # fmt: skip
        template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                    "metadata": {"name": "t"}, "spec": {"spec": bad["spec"]}}  # fmt: skip
        reply = await c.post(f"{BASE}/namespaces/team/resourceclaimtemplates", json=template)
        assert reply.status_code == 403 and "resourceclaimtemplates.dra" in reply.text
    assert [s["path"] for s in cluster.sent] == ["/validate"] * 3
    assert [s["request"]["kind"]["kind"] for s in cluster.sent] == [
        "ResourceClaim", "ResourceClaim", "ResourceClaimTemplate"]


async def test_objects_without_configuration_for_the_driver_are_not_sent(
    cluster: Cluster,
) -> None:
    async with cluster.client() as c:
        plain = claim("plain", [])
        del plain["spec"]["devices"]["config"]
        other = claim("nic", [opaque("anything", driver="nic.example.com")])
        for obj in (plain, other):
            reply = await c.post(f"{BASE}/namespaces/team/resourceclaims", json=obj)
            assert reply.status_code == 201, reply.text
        cls = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
               "metadata": {"name": "gpu.tessera.io"},
               "spec": {"selectors": [{"cel": {"expression": "true"}}]}}  # fmt: skip
        assert (await c.post(f"{BASE}/deviceclasses", json=cls)).status_code == 201
    assert cluster.sent == []


def device_class(config: list) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu.tessera.io"},
            "spec": {"selectors": [{"cel": {"expression": "true"}}], "config": config}}  # fmt: skip


async def test_a_deviceclass_update_is_reviewed_and_an_invalid_config_change_refused(
    cluster: Cluster,
) -> None:
    """kube-apiserver sends UPDATE as the rules name it (PUT, merge patch, JSON patch), with
    the stored object as oldObject; a denied update stores nothing."""
    mps = {"opaque": {"driver": "gpu.tessera.io",
                      "parameters": {**GPU_CONFIG, "sharing": {"strategy": "MPS"}}}}  # fmt: skip
    bad = {"opaque": {"driver": "gpu.tessera.io",
                      "parameters": {**GPU_CONFIG, "sharing": {"strategy": "Exclusive"}}}}
    async with cluster.client() as c:
        url = f"{BASE}/deviceclasses/gpu.tessera.io"
        assert (await c.post(f"{BASE}/deviceclasses", json=device_class([mps]))
                ).status_code == 201  # fmt: skip
        stored = (await c.get(url)).json()
        merge = {"content-type": "application/merge-patch+json"}
        reply = await c.patch(url, json={"spec": {"config": [bad]}}, headers=merge)
        assert reply.status_code == 403, reply.text
        assert reply.json()["message"].startswith(
            'admission webhook "deviceclasses.dra.admission.tessera.io" denied the request: '
            "DeviceClass gpu.tessera.io: invalid configuration for gpu.tessera.io: ")
        json_patch = {"content-type": "application/json-patch+json"}
        reply = await c.patch(url, headers=json_patch, content=json.dumps([
            {"op": "replace", "path": "/spec/config/0", "value": bad}]))
        assert reply.status_code == 403, reply.text
        put = {**stored, "spec": {**stored["spec"], "config": [bad]}}
        assert (await c.put(url, json=put)).status_code == 403
        assert (await c.get(url)).json() == stored  # nothing of the three stored

        time_slicing = {"opaque": {"driver": "gpu.tessera.io", "parameters": {
            **GPU_CONFIG, "sharing": {"strategy": "TimeSlicing"}}}}  # fmt: skip
        reply = await c.put(url, json={**stored, "spec": {**stored["spec"],
                                                          "config": [time_slicing]}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["spec"]["config"] == [time_slicing]
        stale = await c.put(url, json=stored)  # the resourceVersion read before: a conflict
        assert stale.status_code == 409, stale.text
    creates = [s["request"] for s in cluster.sent if s["request"]["operation"] == "CREATE"]
    updates = [s["request"] for s in cluster.sent if s["request"]["operation"] == "UPDATE"]
    assert len(creates) == 1 and creates[0]["oldObject"] is None
    assert len(updates) == 4
    assert all(u["oldObject"] == stored for u in updates)  # the stored class, unchanged
    assert [u["object"]["spec"]["config"] for u in updates] == [[bad]] * 3 + [[time_slicing]]
    assert {u["options"]["kind"] for u in updates} == {"UpdateOptions"}


async def test_a_metadata_update_passes_even_when_the_stored_config_is_invalid(
    cluster: Cluster,
) -> None:
    """A claim stored while the webhook let it through (failurePolicy Ignore, or before the
    chart was installed) can still take a label or lose its finalizer: only a change of the
    driver's configuration is judged. A status write is a subresource the rules do not name."""
    bad = claim("old", [opaque({**GPU_CONFIG, "sharing": {"strategy": "Exclusive"}})])
    bad["metadata"].update(namespace="team", finalizers=["example.com/keep"])
    cluster.api.store.create("ResourceClaim", bad)  # as if written while nobody reviewed
    async with cluster.client() as c:
        url = f"{BASE}/namespaces/team/resourceclaims/old"
        merge = {"content-type": "application/merge-patch+json"}
        reply = await c.patch(url, json={"metadata": {"labels": {"team": "a"}}}, headers=merge)
        assert reply.status_code == 200, reply.text
        reply = await c.patch(url + "/status", headers=merge,
                              json={"status": {"devices": []}})  # fmt: skip
        assert reply.status_code == 200, reply.text
        reply = await c.patch(url, json={"metadata": {"finalizers": None}}, headers=merge)
        assert reply.status_code == 200, reply.text
        assert "finalizers" not in reply.json()["metadata"]
        assert reply.json()["metadata"]["labels"] == {"team": "a"}
    sent = [s["request"] for s in cluster.sent]
    assert [r["operation"] for r in sent] == ["UPDATE", "UPDATE"]  # label, finalizer; no status
    assert all(r["oldObject"]["metadata"]["name"] == "old" for r in sent)
