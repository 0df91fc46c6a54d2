"""Fixtures the kube-sim tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.store import ObjectStore


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """A client of a fresh kube-sim API server in process (over ASGI, an empty store)."""
    api = ApiServer(ObjectStore())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(api.app()),
                                 base_url="http://kube-sim") as client:
        yield client
