"""tessera-admission: mutating admission webhook (HAMi rules).

rules.decide / rules.apply_quota_verdict are the pure decisions; review.py speaks AdmissionReview;
app.AdmissionApp is the HTTP face; server.WebhookServer serves it over (reloading) TLS.
"""

from .app import AdmissionApp
from .metrics import AdmissionMetrics
from .rules import Admitted, Denial, QuotaVerdict, apply_quota_verdict, decide

__all__ = [
    "AdmissionApp",
    "AdmissionMetrics",
    "Admitted",
    "Denial",
    "QuotaVerdict",
    "apply_quota_verdict",
    "decide",
]
