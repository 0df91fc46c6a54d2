"""tessera.signing's checks, one by one (pure: keys in memory, a clock passed in)."""

from __future__ import annotations

import pytest

from tessera import signing
from tessera.signing import CommandRefused, Signer, TrustStore, Verifier

SUBJECT = "tessera.quota.set"
BODY = b'{"namespace":"team"}'


def pair(now: float = 1000.0) -> tuple[Signer, Verifier, list[float]]:
    key = signing.new_key()
    clock = [now]
    trust = TrustStore.parse(signing.trust_text({"tessera-admin": key}))
    return (Signer("tessera-admin", key, lambda: clock[0]),
            Verifier(trust, lambda: clock[0]), clock)  # fmt: skip


def refused(verifier: Verifier, headers: dict[str, str], *, subject: str = SUBJECT,
            body: bytes = BODY, reply: str | None = "_INBOX.x.1") -> str:  # fmt: skip
    with pytest.raises(CommandRefused) as info:
        verifier.verify(subject, reply, headers, body)
    return info.value.code


def test_a_signed_command_passes_once() -> None:
    signer, verifier, _ = pair()
    headers = signer.headers(SUBJECT, BODY)
    assert verifier.verify(SUBJECT, "_INBOX.x.1", headers, BODY) == "tessera-admin"
    assert refused(verifier, headers) == "replayed"


def test_whatever_is_changed_does_not_verify() -> None:
    signer, verifier, _ = pair()
    headers = signer.headers(SUBJECT, BODY)
    assert refused(verifier, headers, body=b'{"namespace":"other"}') == "bad_signature"
    assert refused(verifier, headers, subject="tessera.quota.reserve") == "bad_signature"
    assert refused(verifier, {**headers, signing.EXPIRES: "99999"}) == "bad_signature"
    assert refused(verifier, {**headers, signing.SIGNATURE: "!!"}) == "bad_signature"


def test_another_identitys_key_or_name_is_refused() -> None:
    _, verifier, clock = pair()
    stranger = Signer("tessera-admin", signing.new_key(), lambda: clock[0])
    assert refused(verifier, stranger.headers(SUBJECT, BODY)) == "bad_signature"
    unknown = Signer("tessera-root", signing.new_key(), lambda: clock[0])
    assert refused(verifier, unknown.headers(SUBJECT, BODY)) == "unknown_sender"
    assert refused(verifier, {signing.SENDER: "tessera-admin"}) == "unsigned"
    assert refused(verifier, {}) == "unsigned"


def test_expiry_is_judged_on_the_receivers_clock() -> None:
    signer, verifier, clock = pair()
    headers = signer.headers(SUBJECT, BODY)
    clock[0] += signing.LIFETIME_S + 0.1
    assert refused(verifier, headers) == "expired"
    ahead = Signer(signer.user, signer.key, lambda: clock[0] + 120)
    assert refused(verifier, ahead.headers(SUBJECT, BODY)) == "expiry_too_far"


def test_a_jetstream_delivery_is_never_a_command_even_unverified() -> None:
    signer, verifier, _ = pair()
    headers = signer.headers(SUBJECT, BODY)
    ack = "$JS.ACK.KV_tessera-quota.c.1.5.1.1700000000000000000.0"
    assert refused(verifier, headers, reply=ack) == "jetstream_delivery"
    assert refused(verifier, {**headers, "Nats-Stream": "X"}) == "jetstream_delivery"
    open_ = Verifier(None)
    with pytest.raises(CommandRefused):
        open_.verify(SUBJECT, ack, {}, BODY)
    assert open_.verify(SUBJECT, "_INBOX.x.1", {signing.SENDER: "a"}, BODY) == "a"


def test_nonces_are_forgotten_only_once_expired() -> None:
    signer, verifier, clock = pair()
    for _ in range(3000):
        verifier.verify(SUBJECT, None, signer.headers(SUBJECT, BODY), BODY)
    assert len(verifier._seen) == 3000
    clock[0] += signing.LIFETIME_S + 1
    fresh = [signer.headers(SUBJECT, BODY) for _ in range(2000)]
    for headers in fresh:
        verifier.verify(SUBJECT, None, headers, BODY)
    assert len(verifier._seen) < 5000  # the expired ones went
    assert refused(verifier, fresh[-1]) == "replayed"


def test_a_key_added_to_the_trust_file_is_trusted_without_a_restart(tmp_path) -> None:
    admin = signing.new_key()
    trust_file = tmp_path / "trust.json"
    trust_file.write_text(signing.trust_text({"tessera-admin": admin}))
    verifier = signing.verifier_from_file(str(trust_file))
    newcomer = Signer("tessera-node-gpu-9", signing.new_key())
    assert refused(verifier, newcomer.headers(SUBJECT, BODY)) == "unknown_sender"
    trust_file.write_text(signing.trust_text({"tessera-admin": admin,
                                              newcomer.user: newcomer.key}))  # fmt: skip
    verifier._reloaded = 0.0  # the reload interval has passed
    headers = newcomer.headers(SUBJECT, BODY)
    assert verifier.verify(SUBJECT, None, headers, BODY) == newcomer.user
