"""kubectl's protobuf request bodies (`application/vnd.kubernetes.protobuf`), decoded as
kube-apiserver decodes them; hostile bytes get a 400, never a 500. The real kubectl's
requests are in test_kubectl.py."""

from __future__ import annotations

import random

import httpx
from tessera.kube_sim.protobuf import decode_body

PROTOBUF = {"Content-Type": "application/vnd.kubernetes.protobuf"}


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    type_meta = field(1, api_version.encode()) + field(2, kind.encode())
    return b"k8s\x00" + field(1, type_meta) + field(2, raw)


def quota_body() -> bytes:
    meta = field(1, b"gpu") + field(11, field(1, b"team") + field(2, b"a"))  # labels map
    hard = field(1, field(1, b"limits.nvidia.com/gpumem") + field(2, field(1, b"8000")))
    spec = hard + field(2, b"NotTerminating")
    return envelope("v1", "ResourceQuota", field(1, meta) + field(2, spec))


def test_a_resource_quota_decodes_to_its_json_form() -> None:
    assert decode_body(quota_body()) == {
        "apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "gpu", "labels": {"team": "a"}},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "8000"}, "scopes": ["NotTerminating"]},
    }


def test_a_deployment_keeps_a_zero_replicas_and_drops_other_zeros() -> None:
    container = field(1, b"c") + field(2, b"nginx") + field(16, 0)  # stdin: false
    template = field(2, field(2, container))
    spec = field(1, 0) + field(3, template)  # replicas: 0 (a pointer: kept)
    body = decode_body(envelope("apps/v1", "Deployment", field(1, field(1, b"d")) +
                                field(2, spec)))
    assert body["spec"] == {"replicas": 0, "template": {
        "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}



async def test_created_through_http_in_canonical_form(http: httpx.AsyncClient) -> None:
    reply = await http.post("/api/v1/namespaces/team/resourcequotas", content=quota_body(),
                            headers=PROTOBUF)
    assert reply.status_code == 201, reply.text
    assert reply.json()["spec"]["hard"] == {"limits.nvidia.com/gpumem": "8k"}
    kind = await http.post("/api/v1/namespaces/team/services", content=envelope(
        "v1", "Service", field(1, field(1, b"s"))), headers=PROTOBUF)
    assert kind.status_code == 404  # kube-sim serves no services at all
    unread = await http.post("/api/v1/namespaces/team/pods", content=envelope(
        "v1", "Binding", b""), headers=PROTOBUF)
    assert unread.status_code == 415 and "send it as JSON" in unread.json()["message"]


async def test_hostile_bytes_are_a_bad_request_never_a_500(http: httpx.AsyncClient) -> None:
    rng = random.Random(7)
    valid = quota_body()
    for _ in range(300):
        body = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            roll, size = rng.random(), len(body) + 1
            if roll < 0.4 and body:
                body[rng.randrange(len(body))] = rng.randrange(256)
            elif roll < 0.7:
                del body[rng.randrange(size):]
            else:
                at = rng.randrange(size)
                body[at:at] = rng.randbytes(5)
        reply = await http.post("/api/v1/namespaces/team/resourcequotas", content=bytes(body),
                                headers=PROTOBUF)
        assert reply.status_code < 500, (bytes(body), reply.text)
        assert reply.json()["kind"] == "Status" or reply.status_code == 201
