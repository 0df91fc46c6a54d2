"""Issue 34: kube-sim bounds request bodies as kube-apiserver does: 413 past 3 MiB (server-side
apply too), 400 for nesting past its depth limit and for YAML alias bombs, never a 500; a large
apply is parsed off the event loop (other requests are answered meanwhile). kube-sim's API over
HTTP, in process."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.store import ObjectStore

APPLY = {"Content-Type": "application/apply-patch+yaml"}
CM = "/api/v1/namespaces/default/configmaps"


@pytest.fixture
async def http() -> httpx.AsyncClient:
    api = ApiServer(ObjectStore())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(api.app()),
                                 base_url="http://kube-sim", timeout=60) as client:
        yield client


def nested(depth: int) -> str:
    return '{"metadata": {"name": "deep"}, "data": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


@pytest.mark.parametrize("depth", [300, 5000])
async def test_deep_nesting_is_400_not_500(http, depth):
    created = await http.post(CM, content=nested(depth),
                              headers={"Content-Type": "application/json"})  # fmt: skip
    assert created.status_code == 400, created.text
    assert "max depth" in created.json()["message"]
    applied = await http.patch(f"{CM}/deep", content=nested(depth), headers=APPLY)
    assert applied.status_code == 400, applied.text


async def test_an_oversized_apply_is_413(http):
    body = json.dumps({"metadata": {"name": "big"}, "data": {"x": "y" * (3 * 1024 * 1024)}})
    answer = await http.patch(f"{CM}/big", content=body, headers=APPLY)
    assert answer.status_code == 413 and answer.json()["reason"] == "RequestEntityTooLarge"


async def test_a_yaml_alias_bomb_is_refused(http):
    """99 aliases, 9**12 values expanded."""
    lines = ["metadata: {name: bomb}", 'a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    lines.append("data: {k: *a11}")
    answer = await http.patch(f"{CM}/bomb", content="\n".join(lines), headers=APPLY)
    assert answer.status_code == 400 and "aliases expanded" in answer.json()["message"]
    assert (await http.get(f"{CM}/bomb")).status_code == 404


async def test_a_large_apply_does_not_stall_other_requests(http):
    """A large YAML body takes a while to parse: reads keep being answered meanwhile."""
    items = "\n".join(f"  k{i}: v{i}" for i in range(20_000))
    body = f"metadata: {{name: large}}\ndata:\n{items}\n"
    assert len(body) < 3 * 1024 * 1024
    apply = asyncio.create_task(http.patch(f"{CM}/large", content=body, headers=APPLY))
    await asyncio.sleep(0.05)
    answered = []
    while not apply.done():
        started = time.perf_counter()
        assert (await http.get("/api")).status_code == 200
        answered.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)
    assert (await apply).status_code in (200, 201)
    assert answered, "the apply finished before any read was tried"


async def test_too_many_aliases_are_refused(http):
    lines = ["metadata: {name: many}", "x: &x 1"] + [f"k{i}: *x" for i in range(150)]
    answer = await http.patch(f"{CM}/many", content="\n".join(lines), headers=APPLY)
    assert answer.status_code == 400 and "excessive aliasing" in answer.json()["message"]
