"""The extender over mutual TLS (real uvicorn, real TLS handshakes): callers without the client
certificate are refused, kube-sim's extender client (as kube-scheduler) is accepted, and the
probe listener serves only health and metrics."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from tessera.kube_sim.extender import ExtenderClient, ExtenderConfig

from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera_cli.certs import write_certificates, write_client_certificate

from .conftest import MakeService, register, unique, wait_until
from .factories import container, node, pod


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_listening(port: int, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    write_certificates(directory, ["localhost"], ["127.0.0.1"])
    write_client_certificate(directory, "kube-scheduler")
    # A client certificate from a CA the extender does not trust.
    write_certificates(tmp_path / "other", ["localhost"], ["127.0.0.1"])
    write_client_certificate(tmp_path / "other", "intruder")
    return directory


@pytest.fixture
async def tls_extender(
    make_service: MakeService, buckets: Buckets, certs: Path
) -> Any:
    service = await make_service(config={
        "tls_cert": str(certs / "tls.crt"), "tls_key": str(certs / "tls.key"),
        "tls_client_ca": str(certs / "ca.crt"),
    })  # fmt: skip
    port, probe_port = free_port(), free_port()
    tasks = [
        asyncio.create_task(service.serve_http("127.0.0.1", port)),
        asyncio.create_task(service.serve_http("127.0.0.1", probe_port, probes_only=True)),
    ]
    await wait_listening(port)
    await wait_listening(probe_port)
    yield service, port, probe_port
    service.stopping.set()
    await asyncio.gather(*tasks, return_exceptions=True)


def context(certs: Path, client: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if client is not None:
        ctx.load_cert_chain(client.with_suffix(".crt"), client.with_suffix(".key"))
    return ctx


async def test_callers_without_the_client_certificate_are_refused(
    tls_extender: Any, certs: Path, tmp_path: Path, cluster: InMemoryCluster
) -> None:
    _service, port, _ = tls_extender
    url = f"https://127.0.0.1:{port}"
    body = {"pod": cluster.add_pod(pod(container(mem=1000))), "nodenames": ["n"]}
    for client_cert in (None, tmp_path / "other" / "intruder"):
        async with httpx.AsyncClient(verify=context(certs, client_cert), timeout=5) as client:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await client.post(f"{url}/filter", json=body)
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await client.post(f"{url}/bind", json={"PodName": "p", "Node": "n"})
    # Plain HTTP on the TLS port gets nowhere either.
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.HTTPError):
            await client.post(f"http://127.0.0.1:{port}/filter", json=body)
    # With the certificate kube-scheduler is given, the same call is answered.
    async with httpx.AsyncClient(
        verify=context(certs, certs / "kube-scheduler"), timeout=5
    ) as client:
        response = await client.post(f"{url}/filter", json=body)
    assert response.status_code == 200
    assert "NodeUnregistered" in response.json()["failedNodes"]["n"]


async def test_kube_sims_extender_client_presents_its_certificate(
    tls_extender: Any, certs: Path, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service, port, _ = tls_extender
    registration = node(unique("n"), gpus=1)
    await register(buckets, registration)
    await wait_until(lambda: service.index.node(registration.node) is not None)
    config = ExtenderConfig(
        url_prefix=f"https://127.0.0.1:{port}", ca_file=str(certs / "ca.crt"),
        cert_file=str(certs / "kube-scheduler.crt"), key_file=str(certs / "kube-scheduler.key"),
    )  # fmt: skip
    client = ExtenderClient(config)
    spec = cluster.add_pod(pod(container(mem=1000)))
    try:
        result = await client.filter(spec, [registration.node])
        await client.bind(spec, registration.node)
    finally:
        await client.close()
    assert result.nodes == [registration.node]
    meta = spec["metadata"]
    assert cluster.pods[(meta["namespace"], meta["name"])]["spec"]["nodeName"] == registration.node


async def test_probe_listener_serves_health_and_metrics_only(tls_extender: Any) -> None:
    _service, _port, probe_port = tls_extender
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{probe_port}", timeout=5) as client:
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        assert "tessera_scheduler_filter_seconds" in (await client.get("/metrics")).text
        assert (await client.post("/filter", json={})).status_code == 404
        assert (await client.post("/bind", json={})).status_code == 404
        assert (await client.post("/metrics")).status_code == 405
