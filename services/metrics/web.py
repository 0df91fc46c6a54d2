"""HTTP out: /metrics (Prometheus text), /api/state (the dashboard's JSON), / (the page)."""

from __future__ import annotations

import asyncio
import base64
import gc
import hmac
import json
import threading
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tessera.settings import TesseraSettings

from .dashboard_state import dashboard_state
from .exposition import ViewCollector
from .view import ClusterView

STATIC_DIR = Path(__file__).parent / "static"


def build_registry(
    view: ClusterView, settings: TesseraSettings, clock: Callable[[], float]
) -> CollectorRegistry:
    """A private registry (no global state) holding only the view's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ViewCollector(view, settings, clock))
    return registry


class _CyclicGcPause:
    """Pause the cyclic garbage collector while rendering.

    A render allocates hundreds of thousands of small acyclic objects (samples, label dicts);
    each allocation burst triggers full collections over the whole heap, which hold the GIL
    and so stall the event loop. Reference counting still frees everything; collection resumes
    when the last concurrent render ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._was_enabled = True

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._active += 1

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._was_enabled:
                gc.enable()


def render_exposition(
    view: ClusterView, settings: TesseraSettings, now: float, pause: _CyclicGcPause
) -> bytes:
    with pause:
        return generate_latest(build_registry(view, settings, lambda: now))


def render_state(view: ClusterView, now: float, pause: _CyclicGcPause) -> bytes:
    with pause:
        return json.dumps(dashboard_state(view, now), separators=(",", ":")).encode()


def build_app(
    view: ClusterView,
    settings: TesseraSettings,
    clock: Callable[[], float],
    bus_ready: Callable[[], bool] | None = None,
) -> Starlette:
    """`bus_ready` (ServiceContext.bus_ready): /readyz says 503 while NATS is unreachable or
    its buckets/streams are lost and not yet re-created, as the other services do."""
    # Rendering a large cluster takes a while: render a snapshot in a worker thread so the
    # feeds keep folding bus messages meanwhile.
    pause = _CyclicGcPause()

    async def metrics(_: Request) -> Response:
        body = await asyncio.to_thread(
            render_exposition, view.snapshot(), settings, clock(), pause
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def state(_: Request) -> Response:
        body = await asyncio.to_thread(render_state, view.snapshot(), clock(), pause)
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def index(_: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(_: Request) -> Response:
        if bus_ready is not None and not bus_ready():
            return PlainTextResponse("bus not usable (NATS unreachable or its store lost)",
                                     status_code=503)
        if view.synced:
            return PlainTextResponse("ready")
        return PlainTextResponse("replaying the bus", status_code=503)

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/metrics", metrics),
            Route("/api/state", state),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]
    )
    if settings.metrics_auth_token_file:
        token = Path(settings.metrics_auth_token_file).read_text().strip()
        if not token:
            raise ValueError(f"{settings.metrics_auth_token_file}: the metrics token is empty")
        return TokenGate(app, token)  # type: ignore[return-value]
    return app


class TokenGate:
    """Every request but the probes presents the token: `Authorization: Bearer <token>`
    (Prometheus' `authorization`), or Basic with the token as password (a browser asks for
    it on the dashboard). Anything else is 401 with a challenge, before the app sees it."""

    OPEN = ("/healthz", "/readyz")

    def __init__(self, app: Starlette, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def presented(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer":
            return hmac.compare_digest(value.strip().encode(), self.token)
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(value.strip(), validate=True)
            except ValueError:
                return False
            return hmac.compare_digest(decoded.partition(b":")[2], self.token)
        return False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.OPEN:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        if self.presented(header):
            await self.app(scope, receive, send)
            return
        response = PlainTextResponse("authentication required", status_code=401, headers={
            "WWW-Authenticate": 'Basic realm="tessera", charset="UTF-8"'})
        await response(scope, receive, send)
