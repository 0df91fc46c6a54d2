"""Warnings for the client, as kube-apiserver returns them: any step of a request (field
validation, an admission webhook's AdmissionReview `warnings`) adds one to the request's
recorder, and the response carries each as an RFC 7234 header `Warning: 299 - "<text>"`
(k8s.io/apiserver `warning.AddWarning` and its filter; kubectl prints `Warning: <text>`).

The recorder lives in a context variable set per request by `WarningHeaders` (an ASGI
middleware), so no handler signature carries it; work outside a request (controllers creating
pods) records nothing, as upstream's controllers get their warnings in their own responses.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

_recorded: ContextVar[list[str] | None] = ContextVar("kube_sim_warnings", default=None)
MAX_TEXT = 4096  # upstream truncates very long warnings; so does kube-sim


def add_warning(text: str) -> None:
    """Record a warning for the current request's response (once per text)."""
    warnings = _recorded.get()
    if warnings is not None and text and text not in warnings:
        warnings.append(text)


def header_value(text: str) -> bytes:
    """`299 - "<text>"`: quotes and backslashes escaped, non-printable characters dropped."""
    text = "".join(ch if ch.isprintable() else " " for ch in text[:MAX_TEXT])
    quoted = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'299 - "{quoted}"'.encode()


def parse_header(value: str) -> str | None:
    """The text of one `Warning: 299 - "<text>"` header (what clients print), else None."""
    head, sep, rest = value.partition('"')
    if not sep or not head.strip().startswith("299") or not rest.endswith('"'):
        return None
    return rest[:-1].replace('\\"', '"').replace("\\\\", "\\")


class WarningHeaders:
    """ASGI middleware: a fresh recorder per HTTP request, its warnings added to the response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        warnings: list[str] = []
        token = _recorded.set(warnings)

        async def send_with_warnings(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and warnings:
                headers = list(message.get("headers") or [])
                present = {v for k, v in headers if k.lower() == b"warning"}
                headers += [(b"warning", value) for value in map(header_value, warnings)
                            if value not in present]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_warnings)
        finally:
            _recorded.reset(token)
