"""Issue 34: the dashboard and /metrics can require a token (TESSERA_METRICS_AUTH_TOKEN_FILE),
for Prometheus (Bearer) and a browser (Basic, the token as password); the probes stay open.
The metrics service's real app over HTTP (in-process ASGI transport)."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_app

from tessera.settings import TesseraSettings


@pytest.fixture
async def client(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    app = build_app(ClusterView(), TesseraSettings(metrics_auth_token_file=str(token)), time.time)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://metrics") as http:  # fmt: skip
        yield http


@pytest.mark.parametrize("path", ["/metrics", "/api/state", "/", "/static/index.html"])
async def test_everything_but_the_probes_needs_the_token(client, path):
    refused = await client.get(path)
    assert refused.status_code == 401 and "Basic" in refused.headers["www-authenticate"]
    wrong = await client.get(path, headers={"Authorization": "Bearer guess"})
    assert wrong.status_code == 401
    bearer = await client.get(path, headers={"Authorization": "Bearer s3cret-token"})
    assert bearer.status_code in (200, 404), bearer.status_code  # 404: a static file absent
    basic = base64.b64encode(b"anyone:s3cret-token").decode()
    assert (await client.get(path, headers={"Authorization": f"Basic {basic}"})
            ).status_code == bearer.status_code  # fmt: skip


async def test_probes_stay_open(client):
    assert (await client.get("/healthz")).status_code == 200
    assert (await client.get("/readyz")).status_code in (200, 503)


def test_an_empty_token_file_is_refused_at_start(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        build_app(ClusterView(), TesseraSettings(metrics_auth_token_file=str(empty)), time.time)
