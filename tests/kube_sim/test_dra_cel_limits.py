"""CEL device selectors a tenant writes to be expensive to read: kube-apiserver's CEL parser
bounds how deep an expression nests (cel-go refuses it: "max recursion depth exceeded") and the
claim gets a 422 naming the selector. kube-sim's parser (cel-python on lark) recursed until
Python's stack gave out, and the RecursionError came back as a 500 (an ApiServer in process,
over HTTP, as test_dra_api.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from tessera.kube_sim.dra import cel

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
DEEP = [
    "(" * 3000 + "true" + ")" * 3000,
    "!" * 5000 + "true",
    "[" * 3000 + "]" * 3000 + " == []",
    "-" * 5000 + "1 == -1",
    "device.driver" + ".size()" * 1000 + " > 0",
]



def claim(expression: str) -> dict[str, Any]:
    return {"metadata": {"name": "deep"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com",
                                    "selectors": [{"cel": {"expression": expression}}]}}]}}}


@pytest.mark.parametrize("expression", DEEP, ids=["parens", "not", "lists", "minus", "calls"])
async def test_a_selector_nested_too_deep_is_a_422_naming_it(http: httpx.AsyncClient,
                                                           expression: str) -> None:
    response = await http.post(CLAIMS, json=claim(expression))
    assert response.status_code == 422, response.text[:300]
    message = response.json()["message"]
    assert "selectors[0].cel.expression" in message and "compilation failed" in message


@pytest.mark.parametrize("expression", DEEP, ids=["parens", "not", "lists", "minus", "calls"])
def test_the_allocator_reads_a_stored_deep_selector_as_a_cel_error(expression: str) -> None:
    activation = cel.device_activation("gpu.example.com", {}, {}, False)
    with pytest.raises(cel.CelError):
        cel.evaluate(expression, activation)


async def test_nesting_a_person_writes_still_compiles(http: httpx.AsyncClient) -> None:
    nested = "(" * 40 + 'device.driver == "gpu.example.com"' + ")" * 40
    response = await http.post(CLAIMS, json=claim(nested))
    assert response.status_code == 201, response.text[:300]


def test_a_selector_built_to_be_slow_is_cut_off_as_a_cost_error() -> None:
    """Three nested comprehensions over 40-item lists (380 bytes) are 64,000 inner steps:
    cel-go does that in a millisecond, under its runtime cost limit; cel-python took ~7 s of
    CPU per device, and 4 levels ~5 min, with kube-sim's scheduler stalled. kube-sim cuts an
    evaluation off after a bounded number of steps, as cel-go does past its cost limit (the
    allocation aborts with the error)."""
    import time

    items = "[" + ",".join(str(i) for i in range(40)) + "]"
    slow = f'{items}.all(x, {items}.all(y, {items}.all(z, device.driver != "q")))'
    activation = cel.device_activation("gpu.example.com", {}, {}, False)
    started = time.process_time()
    with pytest.raises(cel.CelError, match="cost limit"):
        cel.evaluate(slow, activation)
    assert time.process_time() - started < 3.0  # CPU: the bound, not the expression, decides
    small = f'{items}.all(x, {items}.exists(y, y == x)) && device.driver == "gpu.example.com"'
    assert cel.evaluate(small, activation) is True  # 1,600 pairs: well inside the bound
