"""Opt-in spill to host memory at admission (docs/elastic.md, "Spilling to host memory"):
`tessera.io/gpumem-spill` is MiB of host memory per container (all its GPUs together), for the
whole pod or per container; a malformed value, or one for a container without a GPU, is denied
with the sentence to act on. The node agent reads the same annotation when it seals."""

from __future__ import annotations

import pytest
from admission_helpers import GPU, MEM, container, patched, pod, review

from tessera import elastic

SPILL = "tessera.io/gpumem-spill"


async def mutate(client, obj: dict) -> dict:
    answer = await client.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


async def test_a_spill_is_admitted_as_written(client) -> None:
    original = pod(container("train", limits={GPU: "1", MEM: "4096"}), container("web"),
                   annotations={SPILL: "16384"})  # fmt: skip
    response = await mutate(client, original)
    assert response["allowed"], response
    assert patched(original, response)["metadata"]["annotations"][SPILL] == "16384"
    named = pod(container("train", limits={GPU: "1", MEM: "4096"}),
                container("eval", limits={GPU: "1", MEM: "2048"}),
                annotations={SPILL: "train=8192"})  # fmt: skip
    assert (await mutate(client, named))["allowed"]


@pytest.mark.parametrize(("value", "words"), [
    ("16Gi", "MiB of host memory as a positive integer"),
    ("0", "positive integer"),
    ("-5", "positive integer"),
    ("50%", "positive integer"),
    (str(elastic.MAX_SPILL_MIB + 1), f"up to {elastic.MAX_SPILL_MIB}"),
    ("other=100", "has no container 'other'"),
    ("main=1,main=2", "named twice"),
    ("", "a value, or name=value pairs"),
])  # fmt: skip
async def test_bad_spill_values_are_denied_with_a_reason(client, value, words) -> None:
    response = await mutate(client, pod(container(limits={GPU: "1", MEM: "4096"}),
                                        annotations={SPILL: value}))  # fmt: skip
    assert not response["allowed"]
    message = response["status"]["message"]
    assert words in message and SPILL in message and "docs/elastic.md" in message, message


async def test_a_spill_for_a_container_without_gpu_is_denied(client) -> None:
    named = pod(container("train", limits={GPU: "1", MEM: "1000"}), container("web"),
                annotations={SPILL: "web=4000"})  # fmt: skip
    response = await mutate(client, named)
    assert not response["allowed"] and "container web asks for no GPU" in (
        response["status"]["message"])
    no_gpu = pod(container("web"), annotations={SPILL: "4000"})
    response = await mutate(client, no_gpu)
    assert not response["allowed"]
    assert "no container asks for a GPU" in response["status"]["message"]


def test_what_the_node_agent_seals_for_each_container() -> None:
    names = ["init", "train", "eval"]
    assert elastic.spill_bytes_of({SPILL: "100"}, names, "train") == 100 << 20
    assert elastic.spill_bytes_of({SPILL: "train=100"}, names, "eval") == 0
    assert elastic.spill_bytes_of({SPILL: "train=100"}, names, "train") == 100 << 20
    assert elastic.spill_bytes_of({}, names, "train") == 0
    assert elastic.spill_bytes_of({SPILL: "lots"}, names, "train") == 0  # edited since: none
