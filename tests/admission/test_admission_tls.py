"""The webhook over real TLS (the client verifies the CA from `tessera certs`), certificate
reload, plain HTTP without certificates, the service's main, and the certs command."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from admission_helpers import GPU, container, patched, pod, review
from cryptography import x509
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics
from tessera.admission.server import TlsFiles, WebhookServer, parse_listen
from tessera.admission.service import run_admission, tls_files
from typer.testing import CliRunner

from tessera.bus import Buckets
from tessera.service import ServiceContext
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.app import build_app
from tessera_cli.certs import CertificateFiles, write_certificates
from tessera_cli.nats_embedded import free_port


@pytest.fixture
def cert_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="tessera-adm-tls-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def app() -> AdmissionApp:
    return AdmissionApp(TesseraSettings(quota_enabled=False), metrics=AdmissionMetrics())


def trusting(ca_file: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_file))


async def post_review(url: str, verify: ssl.SSLContext | bool) -> dict:
    obj = pod(container(limits={GPU: "1"}))
    async with httpx.AsyncClient(verify=verify) as http:
        reply = await http.post(f"{url}/mutate", json=review(obj))
    assert reply.status_code == 200
    return patched(obj, reply.json()["response"])


async def test_served_over_tls_that_the_generated_ca_verifies(cert_dir):
    files = write_certificates(cert_dir / "a", ["localhost"], ["127.0.0.1"])
    server = WebhookServer(app(), "127.0.0.1", 0, TlsFiles(str(files.cert), str(files.key)))
    await server.start()
    try:
        for host in ("localhost", "127.0.0.1"):
            new = await post_review(f"https://{host}:{server.port}", trusting(files.ca_cert))
            assert new["spec"]["schedulerName"] == "tessera-scheduler"
        with pytest.raises(httpx.ConnectError):  # the system trust store does not know our CA
            await post_review(f"https://localhost:{server.port}", True)
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port gets nowhere
            await post_review(f"http://localhost:{server.port}", False)
    finally:
        await server.stop()


async def test_rotated_certificate_is_served_without_a_restart(cert_dir):
    first = write_certificates(cert_dir / "first", ["localhost"], ["127.0.0.1"])
    second = write_certificates(cert_dir / "second", ["localhost"], ["127.0.0.1"])
    served = CertificateFiles.in_directory(cert_dir / "served")
    (cert_dir / "served").mkdir()
    shutil.copy(first.cert, served.cert)
    shutil.copy(first.key, served.key)
    server = WebhookServer(app(), "127.0.0.1", 0, TlsFiles(str(served.cert), str(served.key)),
                           reload_interval_s=0.05)
    await server.start()
    url = f"https://localhost:{server.port}"
    try:
        await post_review(url, trusting(first.ca_cert))
        # A half-done rotation (new certificate, old key) keeps the old pair in service.
        shutil.copy(second.cert, served.cert)
        assert server.reload_if_changed() is False
        await post_review(url, trusting(first.ca_cert))
        shutil.copy(second.key, served.key)
        for _ in range(100):  # the watcher notices within a few intervals
            if server.reloads:
                break
            await asyncio.sleep(0.05)
        assert server.reloads == 1
        await post_review(url, trusting(second.ca_cert))
        # Clients that send no SNI (addressed by IP) get the new certificate too.
        await post_review(f"https://127.0.0.1:{server.port}", trusting(second.ca_cert))
        with pytest.raises(httpx.ConnectError):
            await post_review(url, trusting(first.ca_cert))
    finally:
        await server.stop()


async def test_service_main_serves_until_stopped(admission_nats):
    """`python -m tessera.admission`'s main, with plain HTTP (no certificates configured)."""
    from tessera.bus import connect, ensure_bus

    port = free_port()
    settings = TesseraSettings(listen=f"127.0.0.1:{port}")
    nats_settings = NatsSettings(NATS_URL=admission_nats.url)
    nc = await connect(nats_settings, name="admission-main-test")
    try:
        buckets: Buckets = await ensure_bus(nc.jetstream(), settings)
        ctx = ServiceContext("admission", settings, nats_settings, nc, nc.jetstream(), buckets)
        main = asyncio.create_task(run_admission(ctx))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for _ in range(200):
                try:
                    ready = await http.get("/readyz")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.02)
            assert ready.status_code == 200
            reply = await http.post("/mutate", json=review(pod(container())))
            assert reply.json()["response"]["allowed"] is True
        ctx.stop.set()
        await asyncio.wait_for(main, 5.0)
    finally:
        await nc.close()


def test_tls_settings_come_in_pairs():
    assert tls_files(TesseraSettings()) is None
    assert tls_files(TesseraSettings(tls_cert="c", tls_key="k")) == TlsFiles("c", "k")
    with pytest.raises(ValueError, match="both"):
        tls_files(TesseraSettings(tls_cert="c"))


@pytest.mark.parametrize(
    ("listen", "expected"),
    [("0.0.0.0:9443", ("0.0.0.0", 9443)), (":8443", ("0.0.0.0", 8443)),
     ("[::1]:9443", ("::1", 9443))],
)
def test_listen_addresses(listen, expected):
    assert parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["9443", "host:port", "h:70000"])
def test_bad_listen_addresses_say_what_is_expected(listen):
    with pytest.raises(ValueError, match="host:port"):
        parse_listen(listen)


def test_certs_command_writes_a_ca_and_a_serving_certificate(cert_dir):
    out = cert_dir / "out"
    result = CliRunner().invoke(
        build_app(), ["certs", "tessera-admission.tessera.svc", "--ip", "127.0.0.1", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "caBundle: " in result.output
    files = CertificateFiles.in_directory(out)
    for key in (files.key, files.ca_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [
        "tessera-admission.tessera.svc",
        "tessera-admission.tessera",
        "tessera-admission.tessera.svc.cluster.local",
    ]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def test_certs_command_refuses_a_bad_ip(cert_dir):
    result = CliRunner().invoke(build_app(), ["certs", "svc", "--ip", "not-an-ip",
                                              "-o", str(cert_dir)])
    assert result.exit_code != 0
    assert not (cert_dir / "tls.crt").exists()


async def test_the_shipped_process_serves_tls_from_env_and_stops_on_sigterm(
    admission_nats, cert_dir
):
    """`python -m tessera.admission` exactly as deployed: TLS files from the environment."""
    import os
    import signal
    import subprocess
    import sys
    import time

    files = write_certificates(cert_dir / "env", ["localhost"])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "NATS_"))}
    env.update(NATS_URL=admission_nats.url, TESSERA_LISTEN=f"127.0.0.1:{port}",
               TESSERA_TLS_CERT=str(files.cert), TESSERA_TLS_KEY=str(files.key),
               TESSERA_QUOTA_ENABLED="false")
    proc = subprocess.Popen([sys.executable, "-m", "tessera.admission"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"https://localhost:{port}"
        async with httpx.AsyncClient(verify=trusting(files.ca_cert)) as http:
            for _ in range(300):
                try:
                    ready = await http.get(f"{url}/readyz")
                    break
                except httpx.ConnectError:
                    assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
                    await asyncio.sleep(0.05)
            assert ready.status_code == 200
        new = await post_review(url, trusting(files.ca_cert))
        assert new["spec"]["schedulerName"] == "tessera-scheduler"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 5.0
        logs = proc.stdout.read().decode()  # type: ignore[union-attr]
        assert '"msg": "webhook listening"' in logs and '"tls": true' in logs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_running_certs_again_rotates_the_serving_certificate_under_the_same_ca(cert_dir):
    out = cert_dir / "rotate"
    app_cli, runner = build_app(), CliRunner()
    assert runner.invoke(app_cli, ["certs", "localhost", "-o", str(out)]).exit_code == 0
    files = CertificateFiles.in_directory(out)
    ca_before, cert_before = files.ca_cert.read_bytes(), files.cert.read_bytes()
    again = runner.invoke(app_cli, ["certs", "localhost", "-o", str(out)])
    assert again.exit_code == 0 and "kept the CA" in again.output
    assert files.ca_cert.read_bytes() == ca_before
    assert files.cert.read_bytes() != cert_before
    ca = x509.load_pem_x509_certificate(ca_before)
    x509.load_pem_x509_certificate(files.cert.read_bytes()).verify_directly_issued_by(ca)
    fresh = runner.invoke(app_cli, ["certs", "localhost", "-o", str(out), "--new-ca"])
    assert fresh.exit_code == 0 and files.ca_cert.read_bytes() != ca_before
