"""`tessera certs`: a CA and a serving certificate for the admission webhook (or the scheduler
extender), and client certificates for mutual TLS (`--client kube-scheduler`).

For the local stack and for clusters without cert-manager. Writes ca.crt, ca.key, tls.crt and
tls.key (keys 0600) and prints the base64 caBundle to paste into the MutatingWebhookConfiguration.
Run again on the same directory to rotate the serving certificate: the CA found there is kept
(so the caBundle stays valid) and the webhook picks the new files up by itself.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import typer
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tessera import pki

from .nats_config import parse_owner

# Webhook certificates are rotated by re-running the command; a year keeps clusters working
# without making a leaked key good forever.
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class CertificateFiles:
    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path

    @classmethod
    def in_directory(cls, directory: Path) -> CertificateFiles:
        return cls(directory / "ca.crt", directory / "ca.key", directory / "tls.crt",
                   directory / "tls.key")


def service_names(dns_name: str) -> list[str]:
    """The name given plus the forms a Service is also reached by (svc, namespace-qualified)."""
    names = [dns_name]
    parts = dns_name.split(".")
    if len(parts) == 3 and parts[2] == "svc":  # name.namespace.svc
        names += [f"{parts[0]}.{parts[1]}", f"{dns_name}.cluster.local"]
    return list(dict.fromkeys(names))


def _days(days: int) -> dt.timedelta:
    return dt.timedelta(days=days)


def generate_ca(
    common_name: str = "tessera-admission-ca", days: int = DEFAULT_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca = pki.make_ca(common_name, dt.datetime.now(dt.UTC), _days(days))
    return ca.cert, ca.private_key()


def issue_serving_certificate(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    dns_names: list[str],
    ip_addresses: list[str] | None = None,
    days: int = DEFAULT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    leaf = pki.issue_serving(pki.pair_of(ca_cert, ca_key), dns_names, dt.datetime.now(dt.UTC),
                             _days(days), ip_addresses)  # fmt: skip
    return leaf.cert, leaf.private_key()


def issue_client_certificate(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    days: int = DEFAULT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A client certificate (extended key usage clientAuth): what kube-scheduler presents to
    an extender that verifies its callers (mutual TLS)."""
    leaf = pki.issue_client(pki.pair_of(ca_cert, ca_key), common_name, dt.datetime.now(dt.UTC),
                            _days(days))  # fmt: skip
    return leaf.cert, leaf.private_key()


def write_client_certificate(
    directory: Path, common_name: str, days: int = DEFAULT_DAYS
) -> tuple[Path, Path]:
    """`<name>.crt` and `<name>.key` signed by the CA in `directory` (which must be there)."""
    files = CertificateFiles.in_directory(directory)
    ca = load_ca(files)
    if ca is None:
        raise ValueError(f"no valid CA in {directory}: write the serving certificate first")
    cert, key = issue_client_certificate(ca[0], ca[1], common_name, days)
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in common_name)
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.crt"
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def write_certificates(
    directory: Path,
    dns_names: list[str],
    ip_addresses: list[str] | None = None,
    days: int = DEFAULT_DAYS,
    *,
    new_ca: bool = True,
) -> CertificateFiles:
    """A serving certificate signed by a CA, written into `directory`: a fresh CA, or with
    `new_ca=False` the one already there (made when missing or no longer valid)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = CertificateFiles.in_directory(directory)
    existing = None if new_ca else load_ca(files)
    ca_cert, ca_key = existing or generate_ca(days=days)
    cert, key = issue_serving_certificate(ca_cert, ca_key, dns_names, ip_addresses, days)
    if existing is None:
        _write(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(files.ca_key, _key_pem(ca_key), 0o600)
    # Key before certificate: a webhook reloading on change then sees a matching pair sooner.
    _write(files.key, _key_pem(key), 0o600)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def load_ca(files: CertificateFiles) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The CA in the directory, if both files are there, match and stay valid a day more."""
    try:
        cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        return None
    if cert.not_valid_after_utc < dt.datetime.now(dt.UTC) + dt.timedelta(days=1):
        return None
    return cert, key


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write beside, then rename: a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(temporary, mode)
    os.replace(temporary, path)


def register(app: typer.Typer) -> None:
    @app.command("certs")
    def certs_command(
        dns_name: list[str] = typer.Argument(
            ..., help="DNS name(s) of the webhook Service, e.g. tessera-admission.tessera.svc"
        ),
        out: Path = typer.Option(Path("certs"), "--out", "-o", help="directory to write into"),
        ip: list[str] = typer.Option([], "--ip", help="IP address to include (repeatable)"),
        days: int = typer.Option(DEFAULT_DAYS, min=1, max=3650, help="validity in days"),
        new_ca: bool = typer.Option(
            False, "--new-ca", help="make a new CA even if the directory has a valid one"
        ),
        client: list[str] = typer.Option(
            [], "--client",
            help="also issue a client certificate with this common name, signed by the same CA "
            "(repeatable), e.g. kube-scheduler for an mTLS scheduler extender",
        ),
        owner: str | None = typer.Option(
            None, "--owner",
            help="UID[:GID] that owns the serving certificate and its key (the container user "
            "of the services serving it, e.g. 65532:65532 in docker-compose.yml)",
        ),
    ) -> None:
        """Generate a CA and a serving certificate (admission webhook, scheduler extender), and
        optionally client certificates for mutual TLS."""
        names = list(dict.fromkeys(n for name in dns_name for n in service_names(name)))
        try:
            for address in ip:
                ipaddress.ip_address(address)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--ip") from exc
        had_ca = not new_ca and load_ca(CertificateFiles.in_directory(out)) is not None
        files = write_certificates(out, names, ip, days, new_ca=new_ca)
        bundle = base64.b64encode(files.ca_cert.read_bytes()).decode()
        if had_ca:
            typer.echo(f"kept the CA in {files.ca_cert}; wrote {files.cert}, {files.key}")
        else:
            typer.echo(f"wrote {files.ca_cert}, {files.ca_key}, {files.cert}, {files.key}")
        typer.echo(f"names: {', '.join(names + ip)}")
        typer.echo(f"webhook: TESSERA_TLS_CERT={files.cert} TESSERA_TLS_KEY={files.key}")
        typer.echo(f"caBundle: {bundle}")
        for name in client:
            cert_path, key_path = write_client_certificate(out, name, days)
            typer.echo(f"client {name}: certFile={cert_path} keyFile={key_path}")
        if owner is not None:
            # The serving pair only: the CA's key and the client keys stay the writer's.
            uid, gid = parse_owner(owner)
            for path in (files.ca_cert, files.cert, files.key):
                os.chown(path, uid, gid)
