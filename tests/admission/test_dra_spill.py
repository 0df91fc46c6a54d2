"""A pod that asks for its GPU through a DRA claim may opt in to spilling to host memory
(`tessera.io/gpumem-spill`, docs/dra.md): the container holding the claim counts as a GPU
container, as one asking nvidia.com/gpu does; a spill named for a container holding neither is
still denied."""

from __future__ import annotations

from admission_helpers import container, patched, pod, review

SPILL = "tessera.io/gpumem-spill"


def claiming(name: str) -> dict:
    return container(name, resources={"claims": [{"name": "gpu"}]})


def with_claim(*containers: dict, annotations: dict[str, str]) -> dict:
    return pod(*containers, annotations=annotations,
               resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "slice"}])  # fmt: skip


async def mutate(client, obj: dict) -> dict:
    answer = await client.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


async def test_a_claim_holding_container_may_spill(client) -> None:
    for value in ("2048", "train=2048"):
        original = with_claim(claiming("train"), container("web"), annotations={SPILL: value})
        response = await mutate(client, original)
        assert response["allowed"], response
        assert patched(original, response)["metadata"]["annotations"][SPILL] == value


async def test_a_spill_for_a_container_holding_no_claim_is_denied(client) -> None:
    response = await mutate(client, with_claim(claiming("train"), container("web"),
                                               annotations={SPILL: "web=1024"}))  # fmt: skip
    assert not response["allowed"]
    assert "container web asks for no GPU" in response["status"]["message"]
