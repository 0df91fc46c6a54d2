"""Numbers a tenant writes in annotations are plain ASCII digits, as Kubernetes and HAMi (Go's
strconv) read them. Python's `str.isdigit` also says yes to superscripts (`²`) and to other
scripts' digits (`١٦`), and `int()` refuses the first and reads the second: the webhook used to
crash on `²` (a 500 the tenant could trigger at will: HTTP 500 under `failurePolicy: Fail`
refuses the pod with no sentence) and admit `١٦` as 16. Every such value is now a denial that
names the annotation, and the readers on the node and in the scheduler never raise on it."""

from __future__ import annotations

import pytest
from admission_helpers import CORES, GPU, MEM, container, pod, review

from tessera import elastic, hami

SPILL = elastic.ANN_GPUMEM_SPILL
LIMIT = elastic.ANN_GPUMEM_LIMIT
CORES_LIMIT = elastic.ANN_GPUCORES_LIMIT
WAIT = elastic.ANN_GPUMEM_WAIT
WEIGHTS = hami.ANN_SCORING_WEIGHTS

HOSTILE = ("²", "١٦", "٣%", "𝟠", "9" * 5000)  # superscript, Arabic-Indic, maths digits, huge


async def mutate(client, obj: dict) -> dict:
    answer = await client.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("key", [SPILL, LIMIT, CORES_LIMIT, WAIT])
async def test_a_number_that_is_not_ascii_digits_is_denied_with_the_annotation_named(
        client, key, value) -> None:  # fmt: skip
    obj = pod(container("main", limits={GPU: "1", MEM: "1024"}), annotations={key: value})
    response = await mutate(client, obj)
    assert not response["allowed"], (key, value)
    assert key in response["status"]["message"]


@pytest.mark.parametrize("value", HOSTILE)
async def test_hamis_scoring_weights_take_ascii_digits_only(client, value) -> None:
    obj = pod(container("main", limits={GPU: "1", MEM: "1024"}),
              annotations={WEIGHTS: f"slot={value},core=1,memory=1"})  # fmt: skip
    response = await mutate(client, obj)
    assert not response["allowed"] and WEIGHTS in response["status"]["message"]


async def test_plain_values_still_pass(client) -> None:
    obj = pod(container("main", limits={GPU: "1", MEM: "1024", CORES: "20"}),
              annotations={SPILL: " 2048 ", LIMIT: "4096", CORES_LIMIT: "50", WAIT: "2.5",
                           WEIGHTS: "slot=0,core=1,memory=3"})  # fmt: skip
    assert (await mutate(client, obj))["allowed"]


@pytest.mark.parametrize("value", HOSTILE)
def test_the_node_reads_an_edited_spill_as_none_and_never_raises(value) -> None:
    # pod annotations can be edited after admission; the node agent seals what it reads
    assert elastic.spill_bytes_of({SPILL: value}, ["main"], "main") == 0
    assert elastic.spill_bytes_of({SPILL: f"main={value}"}, ["main"], "main") == 0


@pytest.mark.parametrize("value", HOSTILE)
def test_the_scheduler_reads_bad_weights_as_a_request_error(value) -> None:
    with pytest.raises(hami.RequestError, match="device-scoring-weights"):
        hami.parse_scoring_weights(f"slot=1,core={value},memory=1")
