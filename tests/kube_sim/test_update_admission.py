"""Issue 34: kube-sim runs admission on pod UPDATE and on pods/status as kube-apiserver does, with
each client's own identity in `userInfo`; so a tenant cannot forge the allocation's annotations
(which the lost-store rebuild reads) with `kubectl annotate`, a patch, a PUT or a status update,
while Tessera's own components (service accounts in tessera-system, trusted as the chart trusts
them) still write them. kube-sim's HTTP face and the webhook's HTTP face, joined in-process."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics
from tessera.kube_sim.admission import AdmissionWebhook, admission_review
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.identity import CLIENTS, TokenTable
from tessera.kube_sim.kubeconfig import client_kubeconfig_path, write_kubeconfigs
from tessera.kube_sim.store import ObjectStore

from tessera import hami
from tessera.settings import TesseraSettings

PODS = "/api/v1/namespaces/team/pods"
GRANT = "GPU-a,NVIDIA,12000,30:;"
FORGED = "GPU-b,NVIDIA,24576,100:;"
MERGE = {"content-type": "application/merge-patch+json"}
DENIED = (f'admission webhook "vgpu.tessera.io" denied the request: annotation(s) '
          f"{hami.ANN_DEVICES_ALLOCATED} are written only by")


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.tokens = TokenTable.load_or_create(tmp_path / "tokens.json")
        settings = TesseraSettings(
            quota_enabled=False,
            admission_trusted_user_prefixes="system:serviceaccount:tessera-system:",
        )
        self.reviews: list[dict] = []
        app = AdmissionApp(settings, metrics=AdmissionMetrics())

        async def recording(scope, receive, send):  # the reviews kube-sim sends, kept
            if scope["type"] == "http" and scope["path"] == "/mutate":
                body = b""
                more = True
                while more:
                    message = await receive()
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                self.reviews.append(json.loads(body))

                async def replay():
                    return {"type": "http.request", "body": body, "more_body": False}

                return await app(scope, replay, send)
            return await app(scope, receive, send)

        self.webhook = AdmissionWebhook("http://webhook/mutate", None,
                                        transport=httpx.ASGITransport(app=recording))
        self.api = ApiServer(ObjectStore(), self.webhook, admit_update=self.webhook.update,
                             tokens=self.tokens)
        self.transport = httpx.ASGITransport(app=self.api.app())

    def client(self, who: str | None) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.tokens.issued[who]}"} if who else {}
        return httpx.AsyncClient(transport=self.transport, base_url="http://kube-sim",
                                 headers=headers)


@pytest.fixture
async def cluster(tmp_path: Path):
    cluster = Cluster(tmp_path)
    pod = {"metadata": {"name": "train"},
           "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    async with cluster.client("tenant") as tenant:
        assert (await tenant.post(PODS, json=pod)).status_code == 201
    async with cluster.client("scheduler") as scheduler:
        reply = await scheduler.patch(
            f"{PODS}/train", headers=MERGE,
            json={"metadata": {"annotations": {hami.ANN_DEVICES_ALLOCATED: GRANT}}})
        assert reply.status_code == 200, reply.text
    yield cluster
    await cluster.webhook.close()


async def allocated(cluster: Cluster) -> str:
    async with cluster.client("admin") as admin:
        pod = (await admin.get(f"{PODS}/train")).json()
    return pod["metadata"]["annotations"].get(hami.ANN_DEVICES_ALLOCATED)


def forging_requests(pod: dict) -> list[tuple[str, str, dict, object]]:
    """(method, path, headers, body): `kubectl annotate`, patches, PUT, and status writes."""
    forged = json.loads(json.dumps(pod))
    forged["metadata"]["annotations"][hami.ANN_DEVICES_ALLOCATED] = FORGED
    annotations = {"metadata": {"annotations": {hami.ANN_DEVICES_ALLOCATED: FORGED}}}
    json_patch = [{"op": "replace", "path": "/metadata/annotations/hami.io~1vgpu-devices-allocated",
                   "value": FORGED}]
    return [
        ("PATCH", f"{PODS}/train", MERGE, annotations),  # kubectl annotate --overwrite
        ("PATCH", f"{PODS}/train", {"content-type": "application/strategic-merge-patch+json"},
         annotations),
        ("PATCH", f"{PODS}/train", {"content-type": "application/json-patch+json"}, json_patch),
        ("PUT", f"{PODS}/train", {}, forged),
        ("PATCH", f"{PODS}/train/status", MERGE, annotations),
        ("PUT", f"{PODS}/train/status", {}, forged),
    ]


@pytest.mark.parametrize("who", ["tenant", "admin", None])
async def test_nobody_but_tessera_forges_the_allocation(cluster: Cluster, who: str | None):
    async with cluster.client("admin") as admin:
        pod = (await admin.get(f"{PODS}/train")).json()
    async with cluster.client(who) as client:
        for method, path, headers, body in forging_requests(pod):
            reply = await client.request(method, path, headers=headers, json=body)
            assert reply.status_code == 403, (method, path, reply.text)
            assert reply.json()["message"].startswith(DENIED), reply.json()["message"]
            assert (CLIENTS[who].username if who else "system:anonymous") in reply.text
    assert await allocated(cluster) == GRANT  # nothing changed
    review = cluster.reviews[-1]["request"]
    assert review["operation"] == "UPDATE" and review["subResource"] == "status"
    assert review["oldObject"]["metadata"]["annotations"][hami.ANN_DEVICES_ALLOCATED] == GRANT
    assert review["object"]["metadata"]["annotations"][hami.ANN_DEVICES_ALLOCATED] == FORGED


async def test_a_tenant_still_labels_and_annotates_its_pod(cluster: Cluster):
    async with cluster.client("tenant") as tenant:
        reply = await tenant.patch(f"{PODS}/train", headers=MERGE, json={"metadata": {
            "labels": {"team": "vision"}, "annotations": {"owner": "alice"}}})
        assert reply.status_code == 200, reply.text
        reply = await tenant.patch(f"{PODS}/train/status", headers=MERGE,
                                   json={"status": {"message": "warming up"}})
        assert reply.status_code == 200, reply.text
    assert cluster.reviews[-1]["request"]["userInfo"] == {
        "username": "tenant", "groups": ["system:authenticated"]}
    assert await allocated(cluster) == GRANT


@pytest.mark.parametrize("component", ["scheduler", "node-agent"])
async def test_tessera_components_write_the_allocation(cluster: Cluster, component: str):
    """The chart's match condition skips the webhook for the release's own service accounts
    (kube-apiserver never sends it their updates); the webhook trusts them too where it is
    asked (a cluster without match conditions): tests/security/test_webhook_subresources.py."""
    reviewed = len(cluster.reviews)
    async with cluster.client(component) as client:
        reply = await client.patch(f"{PODS}/train/status", headers=MERGE, json={
            "metadata": {"annotations": {hami.ANN_DEVICES_ALLOCATED: FORGED}}})
        assert reply.status_code == 200, reply.text
        reply = await client.patch(f"{PODS}/train", headers=MERGE, json={
            "metadata": {"annotations": {hami.ANN_DEVICES_ALLOCATED: GRANT}}})
        assert reply.status_code == 200, reply.text
    assert await allocated(cluster) == GRANT
    assert len(cluster.reviews) == reviewed  # neither update was sent to the webhook


async def test_a_status_write_that_keeps_the_annotations_is_not_reviewed(cluster: Cluster):
    """The chart's other match condition: a subresource update is reviewed only when it
    changes the pod's annotations (kubelet-style status writes never wait on the webhook)."""
    reviewed = len(cluster.reviews)
    async with cluster.client("tenant") as tenant:
        reply = await tenant.patch(f"{PODS}/train/status", headers=MERGE,
                                   json={"status": {"message": "warming up"}})
        assert reply.status_code == 200, reply.text
        assert len(cluster.reviews) == reviewed
        reply = await tenant.patch(f"{PODS}/train/status", headers=MERGE,
                                   json={"metadata": {"annotations": {"owner": "alice"}}})
        assert reply.status_code == 200, reply.text
    assert len(cluster.reviews) == reviewed + 1
    review = cluster.reviews[-1]["request"]
    assert review["subResource"] == "status" and review["userInfo"]["username"] == "tenant"


async def test_an_unknown_token_is_unauthorized(cluster: Cluster):
    async with httpx.AsyncClient(transport=cluster.transport, base_url="http://kube-sim",
                                 headers={"authorization": "Bearer guessed"}) as client:
        reply = await client.get(f"{PODS}/train")
    assert reply.status_code == 401 and reply.json()["reason"] == "Unauthorized"


def test_each_client_gets_its_own_kubeconfig_and_keeps_it_across_restarts(tmp_path: Path):
    main = tmp_path / "kubeconfig"
    tokens = TokenTable.load_or_create(tmp_path / "tokens.json")
    write_kubeconfigs(main, "http://127.0.0.1:1", tokens)
    seen = set()
    for client, user in CLIENTS.items():
        config = json.loads(client_kubeconfig_path(main, client).read_text())
        token = config["users"][0]["user"]["token"]
        assert tokens.user(f"Bearer {token}") == user
        seen.add(token)
    assert len(seen) == len(CLIENTS)  # no two clients share a token
    assert TokenTable.load_or_create(tmp_path / "tokens.json").issued == tokens.issued


def test_the_review_carries_the_old_pod_the_subresource_and_the_user():
    review = admission_review({"metadata": {"name": "p", "namespace": "n"}}, "UPDATE", "u",
                              old={"metadata": {"name": "p"}}, sub_resource="status",
                              user=CLIENTS["tenant"])["request"]
    assert review["oldObject"] == {"metadata": {"name": "p"}}
    assert review["subResource"] == review["requestSubResource"] == "status"
    assert review["options"]["kind"] == "UpdateOptions"
    assert review["userInfo"]["username"] == "tenant"
