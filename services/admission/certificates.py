"""The webhook's own certificate, for clusters without cert-manager.

With TESSERA_WEBHOOK_CERT_SECRET set, the admission service keeps a CA and a serving certificate
in that Secret (keys ca.crt, ca.key, tls.crt, tls.key), writes the pair to TESSERA_TLS_CERT /
TESSERA_TLS_KEY (the server reloads them by itself), and puts the CA into the `caBundle` of its
webhook configurations, so `helm install` works on a bare cluster. Every check interval it reads
the Secret again and renews what expires within `renew_before_days`: the serving certificate
under the same CA (the caBundle does not change), or the CA itself, in which case the caBundle
carries the old CA alongside the new one until the old expires, so a replica still serving a
certificate of the old CA stays trusted.

Replicas share the Secret: writes carry the resourceVersion they read, the first one wins and
the others take what it stored. A failed check keeps the current certificate and is retried.
Decisions (`plan`, `renew`) are pure; `CertificateProvisioner` does the I/O.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime as dt
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tessera import pki
from tessera.cluster.port import (
    ClusterError,
    ConflictError,
    KubeObject,
    NotFoundError,
    WebhookCertificatePort,
    WebhookKind,
)

log = logging.getLogger("tessera.admission.certificates")

CA_CERT, CA_KEY, TLS_CERT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
# The previous CA, trusted until it expires (after a CA rotation).
PREVIOUS_CA = "ca-previous.crt"
# While something is still to do (the webhook configuration not created yet), check this often.
PENDING_INTERVAL_S = 5.0

Action = Literal["keep", "new-serving", "new-ca"]
Now = Callable[[], dt.datetime]


class CertProvisionSettings(BaseSettings):
    """TESSERA_WEBHOOK_CERT_*: the webhook's self-provisioned certificate."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_WEBHOOK_CERT_", extra="ignore")

    secret: str = Field("", description="namespace/name of the Secret; empty: provisioning off")
    dns_names: list[str] = Field(default_factory=list, description="the Service's DNS names")
    configurations: list[str] = Field(
        default_factory=list, description="webhook configurations to patch: mutating/NAME or "
        "validating/NAME")
    ca_validity_days: int = Field(3650, ge=2)
    validity_days: int = Field(365, ge=2)
    renew_before_days: int = Field(30, ge=1)
    check_interval_s: float = Field(60.0, gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def secret_ref(self) -> tuple[str, str]:
        namespace, sep, name = self.secret.partition("/")
        if not sep or not namespace or not name:
            raise ValueError(f"TESSERA_WEBHOOK_CERT_SECRET must be namespace/name, got "
                             f"{self.secret!r}")
        return namespace, name

    def targets(self) -> list[tuple[WebhookKind, str]]:
        found: list[tuple[WebhookKind, str]] = []
        for entry in self.configurations:
            kind, sep, name = entry.partition("/")
            if not sep or not name or kind not in ("mutating", "validating"):
                raise ValueError(f"TESSERA_WEBHOOK_CERT_CONFIGURATIONS: {entry!r} is not "
                                 "mutating/NAME or validating/NAME")
            found.append(("mutating" if kind == "mutating" else "validating", name))
        return found


@dataclass(frozen=True)
class Bundle:
    """What the Secret holds."""

    ca: pki.KeyPair
    serving: pki.KeyPair
    previous_ca_pem: bytes = b""

    def ca_bundle(self, now: dt.datetime) -> bytes:
        """The CAs clients must trust: the current one, and the previous while it is valid."""
        bundle = self.ca.cert_pem
        if self.previous_ca_pem:
            with contextlib.suppress(ValueError):
                previous = x509.load_pem_x509_certificate(self.previous_ca_pem)
                if previous.not_valid_after_utc > now:
                    bundle += self.previous_ca_pem
        return bundle


# --- decisions (pure) -------------------------------------------------------------------------


def bundle_from_secret(secret: KubeObject | None) -> Bundle | None:
    """The bundle a Secret holds, or None when it holds none that is usable."""
    data = (secret or {}).get("data") or {}
    if not isinstance(data, dict):
        return None
    try:
        raw = {k: base64.b64decode(v, validate=True) for k, v in data.items() if isinstance(v, str)}
        bundle = Bundle(pki.KeyPair(raw[CA_CERT], raw[CA_KEY]),
                        pki.KeyPair(raw[TLS_CERT], raw[TLS_KEY]), raw.get(PREVIOUS_CA, b""))
        if not (pki.key_matches(bundle.ca) and pki.key_matches(bundle.serving)
                and pki.signed_by(bundle.serving.cert, bundle.ca.cert)):
            return None
    except (KeyError, ValueError, binascii.Error):
        return None
    return bundle


def secret_data(bundle: Bundle) -> dict[str, str]:
    data = {CA_CERT: bundle.ca.cert_pem, CA_KEY: bundle.ca.key_pem,
            TLS_CERT: bundle.serving.cert_pem, TLS_KEY: bundle.serving.key_pem}
    if bundle.previous_ca_pem:
        data[PREVIOUS_CA] = bundle.previous_ca_pem
    return {k: base64.b64encode(v).decode() for k, v in data.items()}


def plan(stored: Bundle | None, dns_names: list[str], now: dt.datetime,
         renew_before: dt.timedelta) -> Action:
    """What to do with what the Secret holds."""
    if stored is None or stored.ca.cert.not_valid_after_utc - renew_before <= now:
        return "new-ca"
    serving = stored.serving.cert
    if (serving.not_valid_after_utc - renew_before <= now
            or serving.not_valid_before_utc > now + pki.BACKDATE
            or not set(dns_names) <= set(pki.dns_names(serving))):
        return "new-serving"
    return "keep"


def renew(stored: Bundle | None, action: Action, dns_names: list[str], now: dt.datetime,
          settings: CertProvisionSettings) -> Bundle:
    validity = dt.timedelta(days=settings.validity_days)
    if action == "new-ca" or stored is None:
        ca = pki.make_ca("tessera-admission-ca", now, dt.timedelta(days=settings.ca_validity_days))
        previous = b""
        if stored is not None and stored.ca.cert.not_valid_after_utc > now:
            previous = stored.ca.cert_pem  # still trusted until it expires
        return Bundle(ca, pki.issue_serving(ca, dns_names, now, validity), previous)
    if action == "new-serving":
        return Bundle(stored.ca, pki.issue_serving(stored.ca, dns_names, now, validity),
                      stored.previous_ca_pem)
    return stored


def with_ca_bundle(config: KubeObject, ca_bundle: str) -> KubeObject | None:
    """The configuration with every webhook's caBundle set, or None if nothing changes."""
    changed = False
    for webhook in config.get("webhooks") or []:
        if not isinstance(webhook, dict):
            continue
        client = webhook.setdefault("clientConfig", {})
        if client.get("caBundle") != ca_bundle:
            client["caBundle"] = ca_bundle
            changed = True
    return config if changed else None


# --- I/O ----------------------------------------------------------------------------------------


def _write_atomically(path: Path, content: bytes, mode: int) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)
    os.replace(temporary, path)


class CertificateProvisioner:
    """Keeps the Secret, the files the server reads and the webhooks' caBundle in step."""

    def __init__(self, cluster: WebhookCertificatePort, settings: CertProvisionSettings,
                 cert_path: str, key_path: str,
                 now: Now = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.cluster = cluster
        self.settings = settings
        self.namespace, self.name = settings.secret_ref()
        self.targets = settings.targets()
        if not settings.dns_names:
            raise ValueError("TESSERA_WEBHOOK_CERT_DNS_NAMES: the Service's DNS names are needed")
        self.cert_path, self.key_path = Path(cert_path), Path(key_path)
        self.now = now
        self.current: Bundle | None = None
        self.pending: set[tuple[WebhookKind, str]] = set(self.targets)
        self._missing: set[tuple[WebhookKind, str]] = set()

    async def ensure(self) -> Bundle:
        """One pass: the Secret holds a valid bundle, the files are it, the caBundle is set."""
        bundle = await self._settle_secret()
        if bundle != self.current:
            # Key first: the server only loads a pair that matches, so a half-written pair is
            # never served (it retries at its next check).
            _write_atomically(self.key_path, bundle.serving.key_pem, 0o600)
            _write_atomically(self.cert_path, bundle.serving.cert_pem, 0o644)
            if self.current is not None:
                log.info("webhook certificate renewed", extra={
                    "not_after": bundle.serving.cert.not_valid_after_utc.isoformat()})
            self.current = bundle
        ca_bundle = base64.b64encode(bundle.ca_bundle(self.now())).decode()
        for kind, name in self.targets:
            await self._patch_ca_bundle(kind, name, ca_bundle)
        return bundle

    async def run(self, stop: asyncio.Event) -> None:
        """Check again every interval (sooner while a webhook configuration is missing)."""
        while not stop.is_set():
            interval = PENDING_INTERVAL_S if self.pending else self.settings.check_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(interval, self.settings.check_interval_s))
            if stop.is_set():
                return
            try:
                await self.ensure()
            except (ClusterError, OSError) as exc:
                log.warning("webhook certificate check failed; serving the current one",
                            extra={"err": str(exc)})

    async def _settle_secret(self) -> Bundle:
        for _attempt in range(5):
            try:
                secret: KubeObject | None = await self.cluster.get_secret(self.namespace, self.name)
            except NotFoundError:
                secret = None
            stored = bundle_from_secret(secret)
            now = self.now()
            action = plan(stored, self.settings.dns_names, now,
                          dt.timedelta(days=self.settings.renew_before_days))
            if action == "keep" and stored is not None:
                return stored
            bundle = renew(stored, action, self.settings.dns_names, now, self.settings)
            try:
                await self._store(secret, bundle)
            except ConflictError:
                continue  # another replica stored one first: use that
            log.info("webhook certificate issued", extra={
                "action": action, "secret": f"{self.namespace}/{self.name}",
                "not_after": bundle.serving.cert.not_valid_after_utc.isoformat()})
            return bundle
        raise ClusterError(f"secret {self.namespace}/{self.name} keeps changing under us")

    async def _store(self, secret: KubeObject | None, bundle: Bundle) -> None:
        if secret is None:
            await self.cluster.create_secret(self.namespace, {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "data": secret_data(bundle)})
            return
        # Keys of others (labels, annotations, unrelated data) are kept; ours are replaced.
        updated = dict(secret)
        updated["data"] = {**(secret.get("data") or {}), **secret_data(bundle)}
        if not bundle.previous_ca_pem:
            updated["data"].pop(PREVIOUS_CA, None)
        await self.cluster.replace_secret(self.namespace, updated)

    async def _patch_ca_bundle(self, kind: WebhookKind, name: str, ca_bundle: str) -> None:
        for _attempt in range(5):
            try:
                config = await self.cluster.get_webhook_configuration(kind, name)
            except NotFoundError:
                if (kind, name) not in self._missing:  # said once, retried every few seconds
                    log.warning("webhook configuration not found yet",
                                extra={"kind": kind, "configuration": name})
                    self._missing.add((kind, name))
                self.pending.add((kind, name))
                return
            changed = with_ca_bundle(config, ca_bundle)
            if changed is not None:
                try:
                    await self.cluster.replace_webhook_configuration(kind, changed)
                except ConflictError:
                    continue
                log.info("caBundle set", extra={"kind": kind, "configuration": name})
            self.pending.discard((kind, name))
            self._missing.discard((kind, name))
            return
        raise ClusterError(f"{kind} webhook configuration {name} keeps changing under us")
