"""Malformed JSON, missing fields, unknown nodes, absurd quantities: 4xx or a refusal with a
message, never a 500 (fuzzed with hypothesis)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster

from .conftest import MakeService, http_client, register, unique, wait_until
from .factories import container, node, pod


@pytest.fixture
async def service_and_node(make_service: MakeService, buckets: Buckets) -> tuple[Any, str]:
    service = await make_service()
    registration = node(unique("bad"), gpus=1)
    await register(buckets, registration)
    await wait_until(lambda: service.index.node(registration.node) is not None)
    return service, registration.node


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/filter", b"{not json", 400),
        ("/filter", b"[]", 400),
        ("/filter", b'{"nodenames": ["a"]}', 400),
        ("/filter", b'{"pod": 5, "nodenames": ["a"]}', 400),
        ("/filter", b'{"pod": {"metadata": {"name": "x", "uid": "u"}}}', 400),
        ("/filter", b'{"pod": {"metadata": {}}, "nodenames": ["a"]}', 400),
        ("/filter", b'{"pod": {"metadata": {"name": "x"}}, "nodenames": [1, 2]}', 400),
        ("/filter", b'{"pod": {"metadata": {"name": "x"}}, "nodes": {"items": [{}]}}', 400),
        ("/prioritize", b"nope", 400),
        ("/bind", b"{}", 400),
        ("/bind", b'{"PodName": 3, "Node": "n"}', 400),
        ("/bind", b"\xff\xfe", 400),
    ],
)
async def test_malformed_calls_get_4xx(
    service_and_node: tuple[Any, str], path: str, body: bytes, status: int
) -> None:
    service, _ = service_and_node
    async with http_client(service) as client:
        response = await client.post(path, content=body)
    assert response.status_code == status
    assert response.json()


@pytest.mark.parametrize(
    "resources",
    [
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "99999999999999"},
        {"nvidia.com/gpu": -1},
        {"nvidia.com/gpu": "1.5"},
        {"nvidia.com/gpu": 100000},
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "lots"},
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": None},
        {"nvidia.com/gpu": 1, "nvidia.com/gpucores": "1e400"},
    ],
)
async def test_absurd_quantities_are_refused_with_a_message(
    service_and_node: tuple[Any, str], resources: dict[str, Any]
) -> None:
    service, name = service_and_node
    spec = pod({"name": "c", "resources": {"limits": resources}})
    async with http_client(service) as client:
        response = await client.post("/filter", json={"pod": spec, "nodenames": [name]})
    assert response.status_code == 200
    result = response.json()
    assert result["nodenames"] == []
    assert result["failedAndUnresolvableNodes"][name].startswith("RequestInvalid: container c")


async def test_unknown_nodes_are_refused_by_name(
    service_and_node: tuple[Any, str], cluster: InMemoryCluster
) -> None:
    service, _ = service_and_node
    async with http_client(service) as client:
        response = await client.post(
            "/filter", json={"pod": cluster.add_pod(pod(container(mem=100))),
                             "nodenames": ["nowhere"]},
        )  # fmt: skip
        bind = await client.post("/bind", json={"PodName": "ghost", "PodNamespace": "default",
                                                "PodUID": "u-1", "Node": "nowhere"})  # fmt: skip
    assert "NodeUnregistered" in response.json()["failedNodes"]["nowhere"]
    assert bind.status_code == 200 and bind.json()["Error"]


def as_json(value: Any) -> bytes:
    """Python's JSON (NaN and Infinity included, as careless clients send them)."""
    return json.dumps(value).encode()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
quantity = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.text(max_size=12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
resource_keys = st.sampled_from([
    "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores",
    "nvidia.com/priority",
])  # fmt: skip
annotation_keys = st.sampled_from([
    "hami.io/gpu-scheduler-policy", "hami.io/node-scheduler-policy",
    "hami.io/device-scoring-weights", "nvidia.com/use-gputype", "nvidia.com/numa-bind",
    "nvidia.com/use-gpuuuid", "nvidia.com/vgpu-mode",
])  # fmt: skip


@st.composite
def fuzzed_pods(draw: st.DrawFn) -> dict[str, Any]:
    limits = draw(st.dictionaries(resource_keys, quantity, max_size=4))
    annotations = draw(st.dictionaries(annotation_keys, st.text(max_size=20) | json_values,
                                       max_size=3))  # fmt: skip
    spec = pod({"name": "f", "resources": {"limits": limits}}, annotations=annotations)
    if draw(st.booleans()):
        spec["spec"]["initContainers"] = draw(st.lists(json_values, max_size=2))
    if draw(st.booleans()):
        spec["spec"]["containers"].append(draw(json_values))
    return spec


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(spec=fuzzed_pods(), extra=json_values)
async def test_fuzzed_filter_never_500(
    service_and_node: tuple[Any, str], spec: dict[str, Any], extra: Any
) -> None:
    service, name = service_and_node
    async with http_client(service) as client:
        filtered = await client.post("/filter", content=as_json(
            {"pod": spec, "nodenames": [name, "x"], "extra": extra}))  # fmt: skip
        prioritized = await client.post(
            "/prioritize", content=as_json({"pod": spec, "nodenames": [name]})
        )
        raw = await client.post("/filter", content=as_json(extra))
    assert filtered.status_code == 200, filtered.text
    body = filtered.json()
    assert body["error"] == "", body["error"]
    assert body["nodenames"] or body["failedNodes"] or body["failedAndUnresolvableNodes"]
    assert prioritized.status_code in (200, 400)
    assert raw.status_code in (200, 400, 413)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=st.dictionaries(st.sampled_from(["PodName", "PodNamespace", "PodUID", "Node", "x"]),
                            json_values, max_size=5))  # fmt: skip
async def test_fuzzed_bind_never_500(service_and_node: tuple[Any, str], body: Any) -> None:
    service, _ = service_and_node
    async with http_client(service) as client:
        response = await client.post("/bind", content=as_json(body))
    assert response.status_code in (200, 400)
    assert "Error" in response.json()


async def test_http_edges_oversized_body_wrong_method_unknown_path(
    make_service: MakeService,
) -> None:
    """The extender's own HTTP handling: a body over the limit is refused with a message before
    it is parsed, a wrong method is 405 naming the allowed one, an unknown path 404, and a
    probe answers HEAD as GET does."""
    service = await make_service(config={"max_body_bytes": 1000})
    big = json.dumps({"pod": {"metadata": {"name": "x"}}, "nodenames": ["n" * 2000]}).encode()
    async with http_client(service) as client:
        too_big = await client.post("/filter", content=big)
        bind_too_big = await client.post("/bind", content=b" " * 1001)
        wrong = await client.get("/filter")
        unknown = await client.post("/nowhere", content=b"{}")
        head = await client.head("/readyz")
    assert too_big.status_code == 413
    assert "larger than 1000 bytes" in too_big.json()["error"]
    assert bind_too_big.status_code == 413
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert unknown.status_code == 404
    assert head.status_code == 200
