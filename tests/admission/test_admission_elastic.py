"""Elastic sharing at admission (issue 33, docs/elastic.md), through POST /mutate: the burst
annotations are validated against the guarantees; a bad one is denied with the sentence to act
on; the scheduler-owned record of the burst granted cannot be set by a user."""

from __future__ import annotations

import pytest
from admission_helpers import CORES, GPU, MEM, PCT, container, patched, pod, review

LIMIT = "tessera.io/gpumem-limit"
CORES_LIMIT = "tessera.io/gpucores-limit"


async def mutate(client, obj: dict) -> dict:
    answer = await client.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


async def test_a_guarantee_with_a_burst_limit_is_admitted_as_written(client) -> None:
    original = pod(container(limits={GPU: "1", MEM: "4096", CORES: "20"}),
                   annotations={LIMIT: "12288", CORES_LIMIT: "80",
                                "tessera.io/gpumem-reclaim": "evict",
                                "tessera.io/gpumem-wait-seconds": "30"})  # fmt: skip
    response = await mutate(client, original)
    assert response["allowed"], response
    new = patched(original, response)
    assert new["metadata"]["annotations"][LIMIT] == "12288"  # untouched: the scheduler reads it
    assert new["spec"]["schedulerName"] == "tessera-scheduler"


async def test_per_container_limits_and_percentages(client) -> None:
    original = pod(container("train", limits={GPU: "1", PCT: "25"}),
                   container("side", limits={GPU: "1", MEM: "1000"}),
                   annotations={LIMIT: "train=75%,side=2000"})  # fmt: skip
    assert (await mutate(client, original))["allowed"]


@pytest.mark.parametrize(("annotations", "limits", "words"), [
    ({LIMIT: "2048"}, {GPU: "1", MEM: "4096"}, "below its guaranteed memory"),
    ({LIMIT: "10%"}, {GPU: "1", PCT: "25"}, "below its guaranteed memory"),
    ({LIMIT: "12Gi"}, {GPU: "1", MEM: "4096"}, "MiB per GPU as a positive integer"),
    ({LIMIT: "-1"}, {GPU: "1", MEM: "4096"}, "MiB per GPU"),
    ({LIMIT: "150%"}, {GPU: "1", MEM: "4096"}, "1%..100%"),
    ({LIMIT: "other=8000"}, {GPU: "1", MEM: "4096"}, "has no container 'other'"),
    ({CORES_LIMIT: "50"}, {GPU: "1", MEM: "4096", CORES: "60"}, "below its guaranteed compute"),
    ({CORES_LIMIT: "50"}, {GPU: "1"}, "compute guarantee of 1..99 %"),
    ({CORES_LIMIT: "101"}, {GPU: "1", CORES: "10"}, "1..100"),
    ({"tessera.io/gpumem-reclaim": "kill"}, {GPU: "1", MEM: "10"}, "one of fail, evict"),
    ({"tessera.io/gpumem-wait-seconds": "1e9"}, {GPU: "1", MEM: "10"}, "0..300"),
    ({"tessera.io/gpumem-wait-seconds": "nan"}, {GPU: "1", MEM: "10"}, "0..300"),
])  # fmt: skip
async def test_bad_elastic_values_are_denied_with_a_reason(client, annotations, limits, words):
    response = await mutate(client, pod(container(limits=limits), annotations=annotations))
    assert not response["allowed"]
    assert words in response["status"]["message"], response["status"]["message"]
    assert "docs/elastic.md" in response["status"]["message"]


async def test_a_burst_for_a_container_without_gpu_is_denied(client) -> None:
    original = pod(container("train", limits={GPU: "1", MEM: "1000"}), container("web"),
                   annotations={LIMIT: "web=4000"})  # fmt: skip
    response = await mutate(client, original)
    assert not response["allowed"] and "asks for no GPU" in response["status"]["message"]
    # a pod-wide value applies to the GPU containers only
    ok = pod(container("train", limits={GPU: "1", MEM: "1000"}), container("web"),
             annotations={LIMIT: "4000"})  # fmt: skip
    assert (await mutate(client, ok))["allowed"]


async def test_users_cannot_set_the_burst_granted(client) -> None:
    original = pod(container(limits={GPU: "1", MEM: "1000"}),
                   annotations={"tessera.io/vgpu-burst-allocated": "GPU-x,64000,0:;"})
    response = await mutate(client, original)
    assert not response["allowed"]
    assert "tessera.io/vgpu-burst-allocated" in response["status"]["message"]
