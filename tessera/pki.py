"""Certificates Tessera makes for itself: a CA and the serving certificate it signs.

Pure functions (the time is passed in) over `cryptography`: ECDSA P-256 keys, SHA-256
signatures, PEM in and out. The admission webhook uses them to provision its own certificate on
a cluster without cert-manager (services/admission/certificates.py).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Certificates start a little in the past: a node whose clock lags still accepts them.
BACKDATE = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    def private_key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("not an EC private key")
        return key


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tessera"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
    ])


def pair_of(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KeyPair:
    """The PEM pair of a certificate and its key (loaded from files, for instance)."""
    return _pem(cert, key)


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KeyPair:
    return KeyPair(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()),
    )


def make_ca(common_name: str, now: dt.datetime, validity: dt.timedelta) -> KeyPair:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def _leaf(
    ca: KeyPair, common_name: str, usage: x509.ObjectIdentifier, now: dt.datetime,
    validity: dt.timedelta, alt_names: list[x509.GeneralName] | None = None,
) -> KeyPair:
    """A leaf certificate signed by `ca` for one extended key usage, never outliving the CA."""
    ca_cert, ca_key = ca.cert, ca.private_key()
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + validity, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    cert = (
        builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert, key)


def issue_serving(
    ca: KeyPair, dns_names: list[str], now: dt.datetime, validity: dt.timedelta,
    ip_addresses: list[str] | None = None,
) -> KeyPair:
    """A TLS server certificate for `dns_names` (and IP addresses), signed by `ca`, never
    outliving it."""
    if not dns_names:
        raise ValueError("a serving certificate needs at least one DNS name")
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses or []]
    return _leaf(ca, dns_names[0], ExtendedKeyUsageOID.SERVER_AUTH, now, validity, alt_names)


def issue_client(
    ca: KeyPair, common_name: str, now: dt.datetime, validity: dt.timedelta
) -> KeyPair:
    """A client certificate (clientAuth): what kube-scheduler presents to an extender that
    verifies its callers (mutual TLS)."""
    return _leaf(ca, common_name, ExtendedKeyUsageOID.CLIENT_AUTH, now, validity)


def signed_by(leaf: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether `ca`'s key signed `leaf` (the signature checks out, the issuer name matches)."""
    if leaf.issuer != ca.subject:
        return False
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def dns_names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(san.value.get_values_for_type(x509.DNSName))


def key_matches(pair: KeyPair) -> bool:
    """The private key belongs to the certificate."""
    try:
        public = pair.cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        mine = pair.private_key().public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except ValueError:
        return False
    return public == mine
