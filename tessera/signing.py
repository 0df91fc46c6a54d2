"""Commands that prove who sent them: Ed25519 signatures on every state-changing request.

Bus permissions bound who may *publish* a request subject, but nats-server delivers a push
consumer's stored messages to any `deliver_subject` its creator names, past the creator's publish
permissions (nats-server issue 8274): a read right on a stream plus a write right on anything the
stream stores could relay a forged command. So each receiver of a command checks, before it acts:

1. the message is not a JetStream delivery (a reply subject under `$JS.`, or a `Nats-*` stream
   header): a request never comes out of a stream;
2. it carries `Tessera-Sender`, `Tessera-Nonce`, `Tessera-Expires` and `Tessera-Signature`, the
   last an Ed25519 signature by the sender's own key over (subject, sender, nonce, expiry, the
   SHA-256 of the body): a relayed or edited message does not verify;
3. the sender's public key is in the receiver's trust file (provisioned with the NATS
   credentials, never learned from the bus): a bus credential alone cannot sign;
4. the expiry, judged on the NATS server's clock (docs/durability.md), is in the future and at
   most `lifetime_s` ahead, and the nonce was not seen before it: a captured request resent is
   refused.

What the sender may do with the command (a node agent only for pods on its own node, ...) is the
receiver's decision after this (`tessera.command_policy`). Pure apart from reading key files.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tessera.command_policy import authorize_node

log = logging.getLogger("tessera.signing")

SENDER = "Tessera-Sender"
NONCE = "Tessera-Nonce"
EXPIRES = "Tessera-Expires"
SIGNATURE = "Tessera-Signature"
# A command is valid this long after it is signed (a request times out in seconds).
LIFETIME_S = 30.0
_DOMAIN = b"tessera-command-v1"
# Bound on remembered nonces: at 1,000 commands/s for LIFETIME_S that is 30,000.
MAX_NONCES = 200_000

Clock = Callable[[], float]


class CommandRefused(Exception):
    """A request that is not taken as a command: `code` for metrics, `sender` as claimed."""

    def __init__(self, code: str, detail: str, sender: str = "") -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.sender = sender

    @property
    def answerable(self) -> bool:
        """A stream's delivery asked nothing: its reply subject is the stream's ack."""
        return self.code != "jetstream_delivery"

    @property
    def reason(self) -> str:
        """The answer's text."""
        return f"command refused ({self.code}): {self.detail}"[:500]


def signed_bytes(subject: str, sender: str, nonce: str, expires: str, body: bytes) -> bytes:
    """What the signature covers (every field length-prefixed: no two tuples share bytes)."""
    parts = [_DOMAIN, subject.encode(), sender.encode(), nonce.encode(), expires.encode(),
             hashlib.sha256(body).digest()]  # fmt: skip
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


# --- keys -------------------------------------------------------------------------------------


def new_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def public_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A public key as the trust file holds it: base64 of the 32 raw bytes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_private(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def trust_text(keys: Mapping[str, Ed25519PrivateKey | Ed25519PublicKey]) -> str:
    """The trust file: {"keys": {user: public key}}."""
    return json.dumps({"keys": {u: public_text(k) for u, k in sorted(keys.items())}}, indent=1)


@dataclass(frozen=True)
class TrustStore:
    """Who may sign commands: NATS user -> public key, from a file an operator provisions."""

    keys: Mapping[str, Ed25519PublicKey]

    @classmethod
    def parse(cls, text: str) -> TrustStore:
        raw = json.loads(text)
        entries = raw.get("keys") if isinstance(raw, dict) else None
        if not isinstance(entries, dict):
            raise ValueError('a trust file is {"keys": {"<user>": "<base64 Ed25519 key>"}}')
        keys: dict[str, Ed25519PublicKey] = {}
        for user, text_key in entries.items():
            raw_key = base64.b64decode(str(text_key), validate=True)
            keys[str(user)] = Ed25519PublicKey.from_public_bytes(raw_key)
        return cls(keys)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TrustStore:
        return cls.parse(Path(path).read_text())


# --- signing ----------------------------------------------------------------------------------


@dataclass
class Signer:
    """Signs the commands one identity sends. Without a key it sends the sender's name only
    (a receiver with a trust file refuses that)."""

    user: str
    key: Ed25519PrivateKey | None = None
    clock: Clock = time.time
    lifetime_s: float = LIFETIME_S

    def headers(self, subject: str, body: bytes) -> dict[str, str]:
        if self.key is None:
            return {SENDER: self.user} if self.user else {}
        nonce = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        expires = f"{self.clock() + self.lifetime_s:.3f}"
        signature = self.key.sign(signed_bytes(subject, self.user, nonce, expires, body))
        return {SENDER: self.user, NONCE: nonce, EXPIRES: expires,
                SIGNATURE: base64.b64encode(signature).decode()}  # fmt: skip


def signer_from_files(user: str | None, key_file: str | None, clock: Clock = time.time) -> Signer:
    """A signer for NATS user `user` with the key in `key_file` (None: unsigned)."""
    key = load_private(key_file) if key_file else None
    return Signer(user or "", key, clock)


def process_signer(key_file: str | None, clock: Clock = time.time) -> Signer:
    """This process's signer: its NATS user (NATS_USER) and TESSERA_COMMAND_KEY_FILE."""
    from tessera.settings import NatsSettings

    return signer_from_files(NatsSettings().user, key_file, clock)


# --- verifying --------------------------------------------------------------------------------


def from_jetstream(reply: str | None, headers: Mapping[str, str] | None) -> bool:
    """A message JetStream delivered (a consumer's push), never a request: its reply subject
    is an ack subject, or it carries the stream's own headers."""
    if reply and reply.startswith("$JS."):
        return True
    return any(name.lower().startswith("nats-") for name in (headers or {}))


@dataclass
class Verifier:
    """Checks commands (see the module doc). `trust` None: signatures are not checked (a bus
    without provisioned keys), only that the message did not come out of a stream."""

    trust: TrustStore | None
    clock: Clock = time.time
    lifetime_s: float = LIFETIME_S
    # Where `trust` came from: read again (at most every RELOAD_S) when an unknown sender signs,
    # so a node added to the Secret is trusted without restarting the receiver.
    trust_file: str | None = None
    _seen: dict[str, float] = field(default_factory=dict)
    _reloaded: float = 0.0

    RELOAD_S = 5.0

    def _key_of(self, sender: str) -> Ed25519PublicKey | None:
        assert self.trust is not None
        key = self.trust.keys.get(sender)
        now = time.monotonic()
        if key is None and self.trust_file and now - self._reloaded > self.RELOAD_S:
            self._reloaded = now
            try:
                self.trust = TrustStore.load(self.trust_file)
            except (OSError, ValueError) as exc:
                log.warning("trust file not reloaded", extra={"err": str(exc)})
            key = self.trust.keys.get(sender)
        return key

    @property
    def enforcing(self) -> bool:
        return self.trust is not None

    def verify(self, subject: str, reply: str | None, headers: Mapping[str, str] | None,
               body: bytes) -> str:  # fmt: skip
        """The sender (its NATS user) of a command that passes; raises CommandRefused."""
        headers = headers or {}
        sender = str(headers.get(SENDER, ""))[:200]
        if from_jetstream(reply, headers):
            raise CommandRefused(
                "jetstream_delivery",
                f"a message delivered by JetStream (reply {str(reply)[:80]!r}) is never a "
                "command", sender,
            )
        if self.trust is None:
            return sender
        nonce, expires, signature = (headers.get(NONCE), headers.get(EXPIRES),
                                     headers.get(SIGNATURE))  # fmt: skip
        if not (sender and nonce and expires and signature):
            raise CommandRefused("unsigned", "the command is not signed", sender)
        key = self._key_of(sender)
        if key is None:
            raise CommandRefused("unknown_sender", f"no key is trusted for {sender!r}", sender)
        try:
            key.verify(base64.b64decode(signature, validate=True),
                       signed_bytes(subject, sender, nonce, expires, body))  # fmt: skip
            deadline = float(expires)
        except (InvalidSignature, ValueError) as exc:
            raise CommandRefused(
                "bad_signature", f"the signature of {sender!r} does not verify for {subject}",
                sender,
            ) from exc
        now = self.clock()
        if not deadline > now:
            raise CommandRefused("expired", f"the command expired {now - deadline:.1f} s ago",
                                 sender)  # fmt: skip
        if deadline > now + self.lifetime_s + 1.0:
            raise CommandRefused(
                "expiry_too_far", f"the command claims to be valid for {deadline - now:.0f} s "
                f"(at most {self.lifetime_s:.0f} s)", sender,
            )  # fmt: skip
        if nonce in self._seen:
            raise CommandRefused("replayed", f"nonce {nonce[:24]} was already used", sender)
        self._remember(nonce, deadline, now)
        return sender

    def _remember(self, nonce: str, deadline: float, now: float) -> None:
        seen = self._seen
        if len(seen) >= 1024 and len(seen) % 1024 == 0:
            for old in [n for n, d in seen.items() if d <= now]:
                del seen[old]
        if len(seen) >= MAX_NONCES:
            # Full of live nonces (a flood): refusing is safe, forgetting is not.
            raise CommandRefused("busy", "too many commands in flight; retry")
        seen[nonce] = deadline


def verifier_from_file(trust_file: str | None, clock: Clock = time.time) -> Verifier:
    if not trust_file:
        log.warning("no TESSERA_COMMAND_TRUST_FILE: commands are taken without signatures "
                    "(only JetStream deliveries are refused)")
        return Verifier(None, clock)
    return Verifier(TrustStore.load(trust_file), clock, trust_file=trust_file)


# --- the receiving side's plumbing ------------------------------------------------------------


class CommandGate:
    """A receiver's check of one command, with the refusal reported: counted, logged with the
    claimed sender, and announced as a `rejected.command` event (tessera.validation)."""

    def __init__(self, verifier: Verifier, rejections: object | None, service: str) -> None:
        self.verifier = verifier
        self.rejections = rejections  # tessera.validation.Rejections (None: log only)
        self.service = service
        # The latest refusals: (subject, code, claimed sender).
        self.recent: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=4096)

    def verify(self, msg: object) -> str:
        """The sender of a nats Msg (or micro Request's `_msg`); raises CommandRefused."""
        subject = getattr(msg, "subject", "")
        return self.verifier.verify(subject, getattr(msg, "reply", None),
                                    getattr(msg, "headers", None), getattr(msg, "data", b""))

    def node_command_refused(self, msg: object, node: str) -> CommandRefused | None:
        """A node's admin command (limits.set, config.set): None when it may be carried out,
        else the refusal, already reported. The caller answers it unless it came from a stream
        (`refused.answerable`)."""
        subject = getattr(msg, "subject", "")
        try:
            sender = self.verify(msg)
            if self.verifier.enforcing:
                refusal = authorize_node(subject, sender, node)
                if refusal:
                    raise CommandRefused("not_allowed", refusal, sender)
        except CommandRefused as refused:
            self.report(subject, refused)
            return refused
        return None

    def report(self, subject: str, refused: CommandRefused) -> None:
        self.recent.append((subject, refused.code, refused.sender))
        detail = f"{refused.detail} (claimed sender {refused.sender or '-'!r})"
        log.warning("command refused", extra={
            "service": self.service, "subject": subject, "code": refused.code,
            "claimed_sender": refused.sender, "detail": refused.detail,
        })  # fmt: skip
        if self.rejections is not None:
            from tessera.validation import Problem

            revision = int.from_bytes(os.urandom(6), "big")  # one event per refusal
            self.rejections.reject("command", subject, Problem(refused.code, detail[:480]),  # type: ignore[attr-defined]
                                   revision)


# --- records a node agent signs on a pod ------------------------------------------------------

# Beside `hami.io/vgpu-devices-allocated` when limits.set raised a grant above the pod's request:
# "<node agent user>:<base64 signature over (pod uid, the annotation's value)>". Whoever may write
# a pod's annotations or status cannot produce it; the node agent (its own key) and the scheduler
# (the trust file) check it before a grant above the request is believed.
RECORD_ANNOTATION = "tessera.io/grants-signature"
_RECORD_SUBJECT = "tessera.io/vgpu-devices-allocated"


def record_signature(signer: Signer, pod_uid: str, value: str) -> str | None:
    """The annotation value signing `value` for pod `pod_uid` (None: the signer has no key)."""
    if signer.key is None:
        return None
    signature = signer.key.sign(signed_bytes(_RECORD_SUBJECT, signer.user, pod_uid, "", value
                                             .encode()))  # fmt: skip
    return f"{signer.user}:{base64.b64encode(signature).decode()}"


def record_verifies(
    annotation: str | None, pod_uid: str, value: str, user: str,
    keys: Mapping[str, Ed25519PublicKey],
) -> bool:  # fmt: skip
    """`annotation` is `user`'s signature of `value` for this pod, by a key in `keys`."""
    if not annotation or ":" not in annotation:
        return False
    signer, _, text = annotation.partition(":")
    key = keys.get(signer)
    if signer != user or key is None:
        return False
    try:
        key.verify(base64.b64decode(text, validate=True),
                   signed_bytes(_RECORD_SUBJECT, signer, pod_uid, "", value.encode()))
    except (InvalidSignature, ValueError):
        return False
    return True
