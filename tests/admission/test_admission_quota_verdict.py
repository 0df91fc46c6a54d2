"""Rule 6 as a pure function: the quota verdict folded into the decision."""

from __future__ import annotations

from tessera.admission.rules import (
    QUOTA_EXCEEDED,
    QUOTA_UNAVAILABLE,
    Admitted,
    Denial,
    QuotaAsk,
    QuotaVerdict,
    apply_quota_verdict,
)

from tessera.settings import TesseraSettings

ADMITTED = Admitted(patch=[{"op": "add", "path": "/spec/schedulerName", "value": "x"}],
                    quota=QuotaAsk("team-a", "p", 1000, 0, 1))


def test_fits_keeps_the_decision():
    assert apply_quota_verdict(ADMITTED, QuotaVerdict(True), TesseraSettings()) == ADMITTED


def test_refusal_names_the_namespace_once():
    from_quota = "exceeding resource quota in namespace team-a: GPUs 4 used + 1 requested > 4"
    denial = apply_quota_verdict(ADMITTED, QuotaVerdict(False, from_quota), TesseraSettings())
    assert denial == Denial(QUOTA_EXCEEDED, from_quota)
    terse = apply_quota_verdict(ADMITTED, QuotaVerdict(False, "GPUs 5 > 4"), TesseraSettings())
    assert isinstance(terse, Denial)
    assert terse.message == "exceeding resource quota of namespace team-a: GPUs 5 > 4"


def test_unanswered_quota_follows_the_failure_policy():
    silent = QuotaVerdict(None, "the quota service did not answer within 2.0 s")
    denial = apply_quota_verdict(ADMITTED, silent, TesseraSettings())
    assert isinstance(denial, Denial) and denial.reason == QUOTA_UNAVAILABLE
    assert denial.code == 503 and "did not answer within 2.0 s" in denial.message
    allowed = apply_quota_verdict(ADMITTED, silent, TesseraSettings(quota_failure_policy="allow"))
    assert isinstance(allowed, Admitted) and allowed.patch == ADMITTED.patch
    assert "TESSERA_QUOTA_FAILURE_POLICY=allow" in allowed.warnings[-1]
