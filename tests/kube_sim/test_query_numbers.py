"""Numeric query parameters (`limit` on a list, `tailLines` on a log) are int64 as kube-apiserver
reads them: anything else is a 400 Status saying which parameter, never a 500. kube-sim took
`str.isdigit` for a number, so `?limit=²` (a digit to Python, not to int()) and a 5000-digit
limit raised inside the handler (an ApiServer in process, over HTTP)."""

from __future__ import annotations

import httpx
import pytest
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.store import ObjectStore

PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
async def http() -> httpx.AsyncClient:
    api = ApiServer(ObjectStore())
    transport = httpx.ASGITransport(api.app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kube-sim") as client:
        yield client


@pytest.mark.parametrize("value", ["²", "١", "9" * 5000, "1e3", "x"])
async def test_a_limit_that_is_not_an_int64_is_a_400(http: httpx.AsyncClient, value: str) -> None:
    response = await http.get(PODS, params={"limit": value})
    assert response.status_code == 400, response.text[:200]
    assert response.json()["kind"] == "Status" and "limit" in response.json()["message"]


async def test_plain_limits_still_page(http: httpx.AsyncClient) -> None:
    for name in ("a", "b", "c"):
        created = await http.post(PODS, json={"metadata": {"name": name}, "spec": {
            "containers": [{"name": "c", "image": "i"}]}})  # fmt: skip
        assert created.status_code == 201, created.text
    page = (await http.get(PODS, params={"limit": "2"})).json()
    assert [p["metadata"]["name"] for p in page["items"]] == ["a", "b"]
    assert page["metadata"]["continue"]
    assert len((await http.get(PODS, params={"limit": "0"})).json()["items"]) == 3
