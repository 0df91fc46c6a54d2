"""Reading what HAMi itself wrote (a cluster migrating from HAMi): its device plugin's node
registration and its scheduler's pod grants, checked, with a sentence for anything malformed."""

from __future__ import annotations

import json

import pytest

from tessera.hami import read_node_register, read_pod_grants

HAMI_JSON = json.dumps([
    {"id": "GPU-aaa", "index": 0, "count": 10, "devmem": 24576, "devcore": 100,
     "type": "NVIDIA-NVIDIA A10", "numa": 0, "mode": "hami-core", "health": True},
    {"id": "GPU-bbb", "index": 1, "count": 10, "devmem": 24576, "devcore": 100,
     "type": "NVIDIA-NVIDIA A10", "numa": 1, "mode": "hami-core", "health": False},
])  # fmt: skip


def test_both_documented_register_forms_are_read() -> None:
    devices = read_node_register(HAMI_JSON)
    assert [(d.uuid, d.memory_mib, d.split_count, d.numa, d.healthy) for d in devices] == [
        ("GPU-aaa", 24576, 10, 0, True), ("GPU-bbb", 24576, 10, 1, False)]
    legacy = "GPU-aaa,10,24576,100,NVIDIA-NVIDIA A10,0,true:GPU-bbb,4,16384,100,NVIDIA-T4,1,false"
    a, b = read_node_register(legacy)
    assert (a.uuid, a.split_count, a.healthy, b.memory_mib, b.index) == (
        "GPU-aaa", 10, True, 16384, 1)


@pytest.mark.parametrize(("text", "why"), [
    ('[{"index": 0}]', 'no string "id"'),
    ('[{"id": 7}]', 'no string "id"'),
    ("[not json", "invalid JSON"),
    ('["GPU-aaa"]', "not an object"),
    ('[{"id": "GPU-a", "devmem": -5}]', ""),
    ('[{"id": "GPU-a", "devmem": 0}]', "devmem 0 MiB"),
    ('[{"id": "GPU-a", "devmem": 100, "count": 100000}]', "count 100000"),
    ('[{"id": "GPU-a", "devmem": 100}, {"id": "GPU-a", "devmem": 100}]', "duplicated"),
    ('[{"id": "GPU-a;x", "devmem": 100}]', "containing"),
    ("GPU-aaa,ten,24576,100,NVIDIA,0,true", "bad number"),
    ("GPU-aaa,10", "needs 7 fields"),
    ("[" + ",".join(f'{{"id": "G{i}", "devmem": 1}}' for i in range(200)) + "]", "200 GPUs"),
    ("x" * 300_000, "characters"),
    (None, "not a string"),
])  # fmt: skip
def test_malformed_registers_are_refused_with_a_reason(text: object, why: str) -> None:
    with pytest.raises(ValueError, match=r"hami\.io/node-nvidia-register") as raised:
        read_node_register(text)
    assert why in str(raised.value)


def test_pod_grants_prefer_the_allocated_record() -> None:
    annotations = {
        "hami.io/vgpu-devices-allocated": "GPU-aaa,NVIDIA,3000,30:;;GPU-bbb,NVIDIA,5000,0:;",
        "hami.io/vgpu-devices-to-allocate": ";;;",  # emptied by HAMi's device plugin
    }
    grants = read_pod_grants(annotations, 3)
    assert [[(g.uuid, g.memory_mib, g.cores) for g in c] for c in grants] == [
        [("GPU-aaa", 3000, 30)], [], [("GPU-bbb", 5000, 0)]]
    only_to = {"hami.io/vgpu-devices-to-allocate": "GPU-ccc,NVIDIA,100,0:;"}
    assert read_pod_grants(only_to, 1)[0][0].uuid == "GPU-ccc"
    assert read_pod_grants({}, 1) == []


@pytest.mark.parametrize(("value", "containers", "why"), [
    ("GPU-a,NVIDIA,lots,1:;", 1, "bad memory/cores"),
    ("GPU-a,NVIDIA,-1,1:;", 1, "bad memory/cores"),
    ("GPU-a,NVIDIA,1:;", 1, "UUID,TYPE,MEM,CORES"),
    ("GPU-a,NVIDIA,1,1:", 1, "must end with ';'"),
    ("GPU-a,NVIDIA,1,1:;GPU-b,NVIDIA,1,1:;", 1, "2 device lists for 1 containers"),
    (",NVIDIA,1,1:;", 1, "no UUID"),
    ("GPU-a,NVIDIA,99999999999,1:;", 1, "absurd"),
    (["not", "text"], 1, "not a string"),
])  # fmt: skip
def test_malformed_pod_grants_are_refused_with_a_reason(
    value: object, containers: int, why: str
) -> None:
    with pytest.raises(ValueError, match=r"hami\.io/vgpu-devices-allocated") as raised:
        read_pod_grants({"hami.io/vgpu-devices-allocated": value}, containers)
    assert why in str(raised.value)
