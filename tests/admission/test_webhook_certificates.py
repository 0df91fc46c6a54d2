"""The webhook provisions its own certificate on a cluster without cert-manager: against
kube-sim's API server (Secrets, MutatingWebhookConfigurations) through the real Kubernetes
adapter, and checked with real TLS handshakes against the caBundle it publishes."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import socket
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from tessera.admission.certificates import (
    CertificateProvisioner,
    CertProvisionSettings,
    bundle_from_secret,
)
from tessera.admission.server import TlsFiles, WebhookServer
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.kubeconfig import write_kubeconfig
from tessera.kube_sim.store import ObjectStore

from tessera.cluster.kubernetes_api import KubeClientSettings, KubernetesCluster
from tessera.embedded_http import EmbeddedUvicorn
from tessera_cli.nats_embedded import free_port

pytestmark = pytest.mark.timeout(60)

NAMESPACE = "tessera-system"
SECRET = "tessera-admission-certs"
CONFIG = "tessera-admission-tessera-system"
SERVICE = f"tessera-admission.{NAMESPACE}.svc"
DNS_NAMES = ["tessera-admission", f"tessera-admission.{NAMESPACE}", SERVICE]


class Clock:
    """The provisioner's time. TLS handshakes check certificates against the real clock, so a
    test that moves time forward starts in the past and ends at about the real now."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self.start = start or dt.datetime.now(dt.UTC)
        self.now = self.start

    def advance_to(self, days: float) -> None:
        self.now = self.start + dt.timedelta(days=days)

    def __call__(self) -> dt.datetime:
        return self.now


class Cluster:
    def __init__(self, store: ObjectStore, url: str, adapter: KubernetesCluster) -> None:
        self.store, self.url, self.adapter = store, url, adapter
        self.http = httpx.AsyncClient(base_url=url)

    def secret(self) -> dict[str, Any]:
        return self.store.get("Secret", NAMESPACE, SECRET)

    def ca_bundle(self) -> bytes:
        config = self.store.get("MutatingWebhookConfiguration", "", CONFIG)
        return base64.b64decode(config["webhooks"][0]["clientConfig"].get("caBundle", ""))

    async def create_webhook_configuration(self) -> None:
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIG},
            "webhooks": [{
                "name": "pods.admission.tessera.io",
                "clientConfig": {"service": {"name": "tessera-admission",
                                             "namespace": NAMESPACE, "path": "/mutate"}},
                "admissionReviewVersions": ["v1"], "sideEffects": "None",
            }],
        }
        reply = await self.http.post(
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", json=config)
        assert reply.status_code == 201, reply.text


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """kube-sim's API server with what the chart installs: an empty Secret and the webhook
    configuration without a caBundle."""
    store = ObjectStore(history_size=50)
    api = ApiServer(store)
    port = free_port()
    server = EmbeddedUvicorn(uvicorn.Config(api.app(), host="127.0.0.1", port=port,
                                           lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    write_kubeconfig(tmp_path / "kubeconfig", url)
    adapter = KubernetesCluster.from_environment(
        KubeClientSettings(kubeconfig=str(tmp_path / "kubeconfig")))
    running = Cluster(store, url, adapter)
    reply = await running.http.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json={
        "metadata": {"name": SECRET, "labels": {"app.kubernetes.io/part-of": "tessera"}},
        "type": "Opaque"})
    assert reply.status_code == 201, reply.text
    await running.create_webhook_configuration()
    try:
        yield running
    finally:
        await running.http.aclose()
        adapter.close()
        server.should_exit = True
        await task


def provisioner(cluster: Cluster, directory: Path, clock: Clock,
                **settings: Any) -> CertificateProvisioner:
    directory.mkdir(exist_ok=True)
    config = CertProvisionSettings(secret=f"{NAMESPACE}/{SECRET}", dns_names=DNS_NAMES,
                                   configurations=[f"mutating/{CONFIG}"], **settings)
    return CertificateProvisioner(cluster.adapter, config, str(directory / "tls.crt"),
                                  str(directory / "tls.key"), now=clock)


async def handshake(port: int, ca_bundle: bytes, server_name: str = SERVICE) -> dict[str, Any]:
    """A TLS client as the API server is: trusts only the caBundle, checks the name."""
    context = ssl.create_default_context(cadata=ca_bundle.decode())

    def connect() -> dict[str, Any]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=server_name) as tls:
            return tls.getpeercert()

    return await asyncio.to_thread(connect)


async def serve(directory: Path) -> WebhookServer:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = WebhookServer(app, "127.0.0.1", 0,
                           TlsFiles(str(directory / "tls.crt"), str(directory / "tls.key")))
    await server.start()
    return server


async def test_on_a_bare_cluster_the_webhook_makes_its_certificate_and_sets_its_ca_bundle(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock()
    bundle = await provisioner(cluster, tmp_path / "a", clock).ensure()
    stored = bundle_from_secret(cluster.secret())
    assert stored == bundle
    # Others' metadata on the Secret is kept.
    assert cluster.secret()["metadata"]["labels"] == {"app.kubernetes.io/part-of": "tessera"}
    assert cluster.ca_bundle() == bundle.ca.cert_pem
    key_mode = stat.S_IMODE((tmp_path / "a" / "tls.key").stat().st_mode)
    assert key_mode == 0o600
    server = await serve(tmp_path / "a")
    try:
        peer = await handshake(server.port, cluster.ca_bundle())
        assert ("DNS", SERVICE) in peer["subjectAltName"]
        with pytest.raises(ssl.SSLCertVerificationError):
            await handshake(server.port, cluster.ca_bundle(), server_name="evil.example")
    finally:
        await server.stop()


async def test_replicas_starting_together_share_one_certificate(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock()
    replicas = [provisioner(cluster, tmp_path / name, clock) for name in ("a", "b", "c")]
    bundles = await asyncio.gather(*(r.ensure() for r in replicas))
    assert bundles[0] == bundles[1] == bundles[2] == bundle_from_secret(cluster.secret())
    certs = {(tmp_path / name / "tls.crt").read_bytes() for name in ("a", "b", "c")}
    assert certs == {bundles[0].serving.cert_pem}


async def test_a_restart_serves_the_stored_certificate_without_writing(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock()
    first = await provisioner(cluster, tmp_path / "a", clock).ensure()
    version = cluster.secret()["metadata"]["resourceVersion"]
    clock.advance_to(100)
    again = await provisioner(cluster, tmp_path / "restarted", clock).ensure()
    assert again == first
    assert cluster.secret()["metadata"]["resourceVersion"] == version


async def test_the_serving_certificate_is_renewed_before_expiry_and_served_without_a_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock(dt.datetime.now(dt.UTC) - dt.timedelta(days=61))
    replica = provisioner(cluster, tmp_path / "a", clock, validity_days=90, renew_before_days=30)
    first = await replica.ensure()
    server = await serve(tmp_path / "a")
    try:
        before = await handshake(server.port, cluster.ca_bundle())
        clock.advance_to(59)  # 31 days left: nothing to do yet
        assert await replica.ensure() == first
        clock.advance_to(61)  # 29 days left: renew
        renewed = await replica.ensure()
        assert renewed.serving != first.serving
        assert renewed.ca == first.ca and cluster.ca_bundle() == first.ca.cert_pem
        assert server.reload_if_changed()
        after = await handshake(server.port, cluster.ca_bundle())
        assert after["serialNumber"] != before["serialNumber"]
    finally:
        await server.stop()


async def test_a_renewed_ca_is_trusted_alongside_the_old_one_until_that_expires(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock(dt.datetime.now(dt.UTC) - dt.timedelta(days=380))
    a = provisioner(cluster, tmp_path / "a", clock, ca_validity_days=400, validity_days=1000,
                    renew_before_days=30)
    b = provisioner(cluster, tmp_path / "b", clock, ca_validity_days=400, validity_days=1000,
                    renew_before_days=30)
    old = await a.ensure()
    await b.ensure()
    clock.advance_to(380)  # the CA has 20 days left
    new = await a.ensure()
    assert new.ca != old.ca
    bundle = cluster.ca_bundle()
    assert old.ca.cert_pem in bundle and new.ca.cert_pem in bundle
    # Replica b still serves the old CA's certificate: the API server still trusts it.
    server_b = await serve(tmp_path / "b")
    try:
        await handshake(server_b.port, bundle)
    finally:
        await server_b.stop()
    clock.advance_to(401)  # the old CA has expired: only the new one
    await a.ensure()
    assert cluster.ca_bundle() == new.ca.cert_pem


async def test_a_corrupt_secret_is_replaced_by_a_valid_certificate(
    cluster: Cluster, tmp_path: Path
) -> None:
    secret = cluster.secret()
    secret["data"] = {"ca.crt": base64.b64encode(b"not a certificate").decode(),
                      "tls.key": "!!not base64"}
    cluster.store.replace("Secret", secret)
    bundle = await provisioner(cluster, tmp_path / "a", Clock()).ensure()
    assert bundle_from_secret(cluster.secret()) == bundle


async def test_a_ca_bundle_lost_or_created_late_is_set_again_by_the_running_webhook(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock()
    cluster.store.delete("MutatingWebhookConfiguration", "", CONFIG)
    replica = provisioner(cluster, tmp_path / "a", clock, check_interval_s=0.1)
    bundle = await replica.ensure()  # the configuration does not exist yet: not fatal
    stop = asyncio.Event()
    running = asyncio.create_task(replica.run(stop))
    try:
        await cluster.create_webhook_configuration()  # as Helm does, after the Deployment
        await wait_for(lambda: cluster.ca_bundle() == bundle.ca.cert_pem)
        config = cluster.store.get("MutatingWebhookConfiguration", "", CONFIG)
        del config["webhooks"][0]["clientConfig"]["caBundle"]  # e.g. re-applied by hand
        cluster.store.replace("MutatingWebhookConfiguration", config)
        await wait_for(lambda: cluster.ca_bundle() == bundle.ca.cert_pem)
    finally:
        stop.set()
        await running


async def test_the_api_server_unreachable_keeps_the_current_certificate(
    cluster: Cluster, tmp_path: Path
) -> None:
    clock = Clock()
    replica = provisioner(cluster, tmp_path / "a", clock, check_interval_s=0.1)
    bundle = await replica.ensure()
    dead = KubernetesCluster.from_environment(KubeClientSettings(
        kubeconfig=str(write_dead_kubeconfig(tmp_path)), max_attempts=1))
    replica.cluster = dead
    stop = asyncio.Event()
    running = asyncio.create_task(replica.run(stop))
    try:
        await asyncio.sleep(0.5)  # several failed checks
        assert not running.done()
        assert (tmp_path / "a" / "tls.crt").read_bytes() == bundle.serving.cert_pem
    finally:
        stop.set()
        await running
        dead.close()


def write_dead_kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "dead-kubeconfig"
    write_kubeconfig(path, f"http://127.0.0.1:{free_port()}")
    return path


async def wait_for(condition: Any, deadline_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not condition():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_the_service_provisions_before_serving_from_its_environment(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the chart sets (TESSERA_WEBHOOK_CERT_*, JSON lists) is what the service reads."""
    from tessera.admission.service import provision_certificate

    monkeypatch.setenv("TESSERA_KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.setenv("TESSERA_WEBHOOK_CERT_SECRET", f"{NAMESPACE}/{SECRET}")
    monkeypatch.setenv("TESSERA_WEBHOOK_CERT_DNS_NAMES", json.dumps(DNS_NAMES))
    monkeypatch.setenv("TESSERA_WEBHOOK_CERT_CONFIGURATIONS", json.dumps([f"mutating/{CONFIG}"]))
    stop = asyncio.Event()
    with pytest.raises(ValueError, match="TESSERA_TLS_CERT"):
        await provision_certificate(None, stop)
    files = TlsFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    provisioner = await provision_certificate(files, stop)
    assert provisioner is not None
    assert (tmp_path / "tls.crt").read_bytes() == provisioner.current.serving.cert_pem
    assert cluster.ca_bundle() == provisioner.current.ca.cert_pem
    monkeypatch.delenv("TESSERA_WEBHOOK_CERT_SECRET")
    assert await provision_certificate(files, stop) is None  # off without a Secret
