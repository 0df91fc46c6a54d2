"""A pod's containers are read without the device kinds' registry when they name no other
family's resource (`_FamilyNames.read`), plain values in one loop (`_plain_request`): the same
request, and the same refusal, as each
container read through `registry.read_request` (the families it names, then that family's
reader), for every kind of container."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tessera import hami
from tessera.device_kinds import registry
from tessera.hami import PodRequest, RequestError, parse_pod_request
from tessera.settings import TesseraSettings

GPU, MEM, PCT, CORES, PRIO = ("nvidia.com/gpu", "nvidia.com/gpumem",
                              "nvidia.com/gpumem-percentage", "nvidia.com/gpucores",
                              "nvidia.com/priority")  # fmt: skip
VALUES: dict[str, list[Any]] = {
    GPU: [1, 2, "1", "4", "0", 0, -1, "x", "1k", "2k", "0k", "1e0", 9, "99999", " 1", True, 1.0],
    MEM: [1024, "1024", "12288", "1Gi", "3k", "8k", "03k", "16777k", "16778k", "1" * 63 + "k",
          "1" * 64 + "k", "k", "3K", "3 k", "3k ", "٣k", "3000000m", "1.5", "", -5, 0, "0",
          10**12],
    PCT: [10, "10", "40", "0040", 150, "150", 0, "0", -3, "-3", "50.5", "4e1", "1k", "abc",
          "1" * 64, "1" * 65, "١٦", "²", " 40", "1k", "0k", 10**70, 5.0],
    CORES: [0, 10, "30", 100, "250", "-1", "1e2", "1k", "1000000k", 10**10],
    PRIO: [0, 1, "1", "0", 2, "2", "x", "0k", "1k"],
    "nvidia.com/cores": [10, "20"],
    "huawei.com/Ascend910B3": [1, "2"],
    "huawei.com/Ascend910B3-memory": ["4096"],
    "hygon.com/dcunum": [1],
    "cambricon.com/vmlu": ["1"],
    "cpu": ["8", "500m"],
    "memory": ["32Gi", 1024],
}


def container(rng: random.Random) -> dict[str, Any]:
    sections: dict[str, Any] = {}
    for section in ("limits", "requests"):
        if rng.random() < (0.9 if section == "limits" else 0.5):
            keys = rng.sample(list(VALUES), rng.randint(0, 5))
            sections[section] = {k: rng.choice(VALUES[k]) for k in keys}
    c: dict[str, Any] = {"name": f"c{rng.randint(0, 3)}", "resources": sections}
    roll = rng.random()
    if roll < 0.03:
        c["resources"] = rng.choice([None, {}, {"limits": None}, {"requests": {}}])
    elif roll < 0.05:
        del c["resources"]
    if rng.random() < 0.2:
        c["restartPolicy"] = "Always"
    return c


def pod(rng: random.Random) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container(rng) for _ in range(rng.randint(1, 3))]}
    if rng.random() < 0.3:
        spec["initContainers"] = [container(rng) for _ in range(rng.randint(1, 2))]
    return {"metadata": {"name": "p"}, "spec": spec}


def outcome(p: dict[str, Any], settings: TesseraSettings) -> PodRequest | str:
    try:
        return parse_pod_request(p, settings)
    except RequestError as exc:
        return f"refused: {exc}"


def through_registry(p: dict[str, Any], settings: TesseraSettings) -> PodRequest | str:
    """The pod read afresh, every container through `registry.read_request`."""
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(hami, "_remembered_requests", [None, {}])
        patched.setattr(hami._FamilyNames, "read",
                        lambda _self, c, settings: registry.read_request(c, settings))
        return outcome(p, settings)


@pytest.fixture(autouse=True)
def own_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hami, "_remembered_requests", [None, {}])


def test_several_families_are_registered() -> None:
    # (otherwise `registry.request_reader` is NVIDIA's own reader and this path is never taken)
    assert registry.request_reader(TesseraSettings()) is registry.read_request


def test_nvidia_reads_with_parse_container_request() -> None:
    # (what `_FamilyNames.reader` calls in `read_request`'s place for NVIDIA's containers)
    assert registry.family("nvidia").reader is hami.parse_container_request


def test_every_pod_reads_as_through_the_registry() -> None:
    rng = random.Random(21)
    settings = TesseraSettings()
    fast = 0
    for _ in range(3000):
        p = pod(rng)
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(hami, "_remembered_requests", [None, {}])
            got = outcome(p, settings)
        assert got == through_registry(p, settings)
        fast += isinstance(got, PodRequest)
    assert fast > 300  # (many were read, not refused)


def test_settings_changed_in_place_read_as_through_the_registry() -> None:
    # registry.resource_map keeps its names per settings object: a name changed in place is
    # not NVIDIA's there, and the registry reads such a container as naming no family.
    settings = TesseraSettings()
    p = {"spec": {"containers": [{"name": "a", "resources": {"limits": {"example.com/vgpu": 1}}},
                                 {"name": "b", "resources": {"limits": {GPU: 2}}}]}}  # fmt: skip
    assert outcome(p, settings) == through_registry(p, settings)
    settings.resource_name = "example.com/vgpu"
    hami._remembered_requests[:] = [None, {}]
    assert outcome(p, settings) == through_registry(p, settings)


@pytest.mark.parametrize("changed", [{}, {"memory_factor": 4}, {"default_mem": 2048},
                                     {"default_cores": 30, "default_gpu_num": 2}])
def test_plain_values_read_as_parse_container_request(changed: dict[str, Any]) -> None:
    settings = TesseraSettings(**changed)
    rng = random.Random(5)
    plain = 0
    for _ in range(4000):
        c = container(rng)
        resources = c.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        try:
            expected: object = hami.parse_container_request(c, settings)
        except RequestError as exc:
            expected = ("refused", str(exc))
        got = hami._plain_request(limits, requests, settings)
        if got is not hami._NOT_PLAIN:
            assert got == expected
            plain += 1
    assert plain > 1000
