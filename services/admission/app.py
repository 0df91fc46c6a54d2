"""The webhook's HTTP face: a small ASGI app (no framework on the hot path).

POST /mutate answers AdmissionReviews of pods, POST /validate those of DRA objects (DRA mode);
/healthz, /readyz and /metrics are for the kubelet and Prometheus. The decisions themselves are
the pure functions of rules.py, review.py and dra_validation.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from tessera.settings import TesseraSettings

from . import dra_validation
from .dra_templates import DraTemplates
from .event_queue import EventQueue, PendingEvent
from .metrics import AdmissionMetrics
from .quota_check import QuotaChecker
from .review import Review, ReviewError, parse_review, response_body, review_decision
from .rules import Admitted, Decision, Denial, apply_quota_verdict

log = logging.getLogger("tessera.admission")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
VALIDATE_PATH = dra_validation.PATH


class AdmissionApp:
    """Everything the webhook needs is passed in; `quota` None = no quota check."""

    def __init__(
        self,
        settings: TesseraSettings,
        *,
        metrics: AdmissionMetrics,
        quota: QuotaChecker | None = None,
        events: EventQueue | None = None,
        is_ready: Callable[[], bool] = lambda: True,
        dra: DraTemplates | None = None,
    ) -> None:
        self.dra = dra
        self.settings = settings
        self.metrics = metrics
        self.quota = quota if settings.quota_enabled else None
        self.events = events
        self.is_ready = is_ready
        self.max_body = settings.admission_max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/mutate":
            if method != "POST":
                await _send(send, 405, _error("use POST /mutate with an AdmissionReview"))
                return
            await self._mutate(scope, receive, send)
        elif path == VALIDATE_PATH:
            if method != "POST":
                await _send(send, 405, _error(f"use POST {VALIDATE_PATH} with an AdmissionReview"))
                return
            await self._validate(scope, receive, send)
        elif path in ("/healthz", "/readyz", "/metrics") and method in ("GET", "HEAD"):
            if path == "/healthz":
                await _send(send, 200, b'{"ok":true}')
            elif path == "/readyz":
                ready = self.is_ready()
                await _send(send, 200 if ready else 503, b'{"ready":%s}' % (
                    b"true" if ready else b"false"))
            else:
                await _send(send, 200, self.metrics.exposition(),
                            [(b"content-type", CONTENT_TYPE_LATEST.encode())])
        elif path in ("/healthz", "/readyz", "/metrics"):
            await _send(send, 405, _error(f"use GET {path}"), [
                *JSON_HEADERS, (b"allow", b"GET, HEAD"),
            ])  # fmt: skip
        else:
            await _send(send, 404, _error(f"no route {method} {path}"))

    async def _mutate(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        try:
            body = await self._read_body(scope, receive)
            review = parse_review(body)
        except ReviewError as exc:
            self.metrics.result["rejected"].inc()
            headers = [*JSON_HEADERS, (b"connection", b"close")] if exc.status == 413 else None
            await _send(send, exc.status, _error(str(exc)), headers)
            return
        decision = review_decision(review, self.settings)
        if isinstance(decision, Admitted) and decision.dra is not None:
            decision = await self._convert_to_claims(review, decision)
        if isinstance(decision, Admitted) and decision.quota is not None and self.quota:
            verdict = await self.quota.check(decision.quota, _pod_uid(review.object))
            decision = apply_quota_verdict(decision, verdict, self.settings)
        await _send(send, 200, response_body(review, decision))
        try:
            self._account(review, decision, started)
        except Exception:  # the answer is out; bookkeeping must never break the connection
            log.exception("admission bookkeeping failed")

    async def _validate(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """The validating webhook (DRA mode): a DRA object's configuration for Tessera's driver
        (dra_validation.py). Never patches; pods are /mutate's."""
        try:
            review = parse_review(await self._read_body(scope, receive))
        except ReviewError as exc:
            self.metrics.result["rejected"].inc()
            headers = [*JSON_HEADERS, (b"connection", b"close")] if exc.status == 413 else None
            await _send(send, exc.status, _error(str(exc)), headers)
            return
        decision = dra_validation.validate_decision(review)
        await _send(send, 200, response_body(review, decision))
        if isinstance(decision, Denial):
            log.info("DRA object denied", extra={
                "kind": review.kind, "namespace": review.namespace, "name": review.name,
                "reason": decision.message[:300]})  # fmt: skip

    async def _convert_to_claims(self, review: Review, decision: Admitted) -> Decision:
        """DRA mode: the pod's claims and their templates (dra_templates.py)."""
        if self.dra is None:
            self.dra = DraTemplates(None, self.settings)
        return await self.dra.finish(review.namespace, review.object, decision, review.dry_run)

    async def _read_body(self, scope: dict[str, Any], receive: Receive) -> bytes:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                raise ReviewError(self._too_large(), 413)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ReviewError("client went away", 400)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise ReviewError(self._too_large(), 413)
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    def _too_large(self) -> str:
        return (f"AdmissionReview larger than {self.max_body} bytes "
                "(TESSERA_ADMISSION_MAX_BODY_BYTES)")

    def _account(self, review: Review, decision: Decision, started: float) -> None:
        """Metrics, one log line for denials, and the event: all without waiting on anything."""
        if isinstance(decision, Denial):
            action, reason = "denied", decision.message
            self.metrics.denials.labels(decision.reason).inc()
            log.info("denied", extra={"namespace": review.namespace, "pod": review.name,
                                      "reason": decision.reason, "detail": decision.message})
        elif decision.patch:
            action, reason = "mutated", decision.summary
        else:
            action, reason = "allowed", decision.summary
        self.metrics.result[action].inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        if self.events is not None and not review.dry_run:
            self.events.offer(PendingEvent(
                action=action,
                namespace=review.namespace,
                name=review.name or _pod_name(review.object),
                pod_uid=_pod_uid(review.object),
                reason=reason,
                review_uid=review.uid,
                never_placed=getattr(decision, "unplaceable", ""),
            ))


async def _send(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    # An explicit length: the API server's client then reads one body, not chunks.
    headers = [*(headers or JSON_HEADERS), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _metadata(pod: Any) -> dict[str, Any]:
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _pod_uid(pod: Any) -> str:
    uid = _metadata(pod).get("uid")
    return uid if isinstance(uid, str) else ""


def _pod_name(pod: Any) -> str:
    metadata = _metadata(pod)
    name = metadata.get("name") or metadata.get("generateName") or ""
    return name if isinstance(name, str) else ""
