"""A pod's request is remembered by its shape (each container's limits and requests, which init
containers are sidecars, the settings read): a pod read from memory gets exactly the request, and
a malformed one exactly the refusal (its container's name in it), that reading it afresh gives,
whatever was read before it, under whichever settings."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tessera import hami
from tessera.hami import PodRequest, RequestError, parse_pod_request
from tessera.settings import TesseraSettings

GPU, MEM, PCT, CORES, PRIO = ("nvidia.com/gpu", "nvidia.com/gpumem",
                              "nvidia.com/gpumem-percentage", "nvidia.com/gpucores",
                              "nvidia.com/priority")  # fmt: skip
# Values of every kind a pod may carry: the usual ones, and ones equal to them as dict keys but
# read differently (True == 1, 1.0 == 1), malformed ones, and another family's resource.
VALUES: dict[str, list[Any]] = {
    GPU: [1, 2, "1", "2", True, 1.0, 0, -1, "x", None, 9, "99999"],
    MEM: [1024, "1024", "1Gi", "3k", 2.5, True, -5, "", None, 0],
    PCT: [10, "10", 150, 0, "50", 5.0, "abc"],
    CORES: [0, 10, "30", 100, 250, False, 30.0, "-1"],
    PRIO: [0, 1, "1", 2, True],
    "huawei.com/Ascend910B": [1, "1"],
    "example.com/other": [1, "y"],
}


def container(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.03:
        return "not a container"
    if roll < 0.06:
        return {"name": "r", "resources": rng.choice(["", [], 3, None, {"limits": "x"}])}
    sections: dict[str, Any] = {}
    for section in ("limits", "requests"):
        if rng.random() < (0.9 if section == "limits" else 0.3):
            keys = rng.sample(list(VALUES), rng.randint(0, 3))
            sections[section] = {k: rng.choice(VALUES[k]) for k in keys}
    c: dict[str, Any] = {"name": f"c{rng.randint(0, 3)}", "resources": sections}
    if rng.random() < 0.3:
        c["restartPolicy"] = rng.choice(["Always", "OnFailure", None])
    return c


def pod(rng: random.Random) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container(rng) for _ in range(rng.randint(1, 3))]}
    if rng.random() < 0.3:
        spec["initContainers"] = [container(rng) for _ in range(rng.randint(1, 2))]
    annotations = {}
    if rng.random() < 0.1:  # a burst limit: a new request beside the remembered one
        annotations["tessera.io/gpumem-limit"] = rng.choice(["4096", "c0=8192", "x"])
    return {"metadata": {"name": "p", "annotations": annotations}, "spec": spec}


def read(pod: dict[str, Any], settings: TesseraSettings) -> PodRequest | str:
    try:
        return parse_pod_request(pod, settings)
    except RequestError as exc:
        return f"refused: {exc}"


def afresh(pod: dict[str, Any], settings: TesseraSettings) -> PodRequest | str:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hami, "_remembered_requests", [None, {}])
        return read(pod, settings)


@pytest.fixture(autouse=True)
def own_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hami, "_remembered_requests", [None, {}])


def test_a_remembered_request_is_the_one_read_afresh() -> None:
    rng = random.Random(35)
    settings = TesseraSettings()
    pods = [pod(rng) for _ in range(300)]
    remembered = 0
    for p in [rng.choice(pods) for _ in range(3000)]:
        before = len(hami._remembered_requests[1])
        got = read(p, settings)
        assert got == afresh(p, settings)
        remembered += len(hami._remembered_requests[1]) > before
    assert remembered > 30  # (the memory was used, and most pods were served from it)


def test_a_container_refused_by_name_whatever_was_read_before() -> None:
    settings = TesseraSettings()
    fine = {"spec": {"containers": [{"name": "a", "resources": {"limits": {GPU: 1}}}]}}
    assert read(fine, settings) == afresh(fine, settings)
    for value in (True, 1.0, None, "1x"):
        bad = {"spec": {"containers": [{"name": "b", "resources": {"limits": {GPU: value}}}]}}
        assert read(bad, settings) == afresh(bad, settings)
        assert read(fine, settings) == afresh(fine, settings)


def test_settings_are_part_of_the_shape() -> None:
    plain = TesseraSettings()
    ten_gib = TesseraSettings(default_mem=10240, default_cores=20)
    renamed = TesseraSettings(resource_name="example.com/vgpu")
    p = {"spec": {"containers": [{"name": "a", "resources": {"limits": {GPU: 1}}}]}}
    answers = []
    for settings in (plain, ten_gib, renamed, plain, ten_gib, renamed):
        got = read(p, settings)
        assert got == afresh(p, settings)
        answers.append(got)
    assert len({repr(a) for a in answers}) == 3
    assert read(p, plain) == afresh(p, plain)  # (remembered under `plain`, then:)
    plain.default_mem = 2048  # (a settings object changed in place: read as it is now)
    assert read(p, plain) == afresh(p, plain)
    assert read(p, plain).containers[0].memory_mib == 2048  # type: ignore[union-attr]


def test_sidecars_and_burst_limits_are_not_mixed_up() -> None:
    settings = TesseraSettings()
    gpu = {"resources": {"limits": {GPU: 1, MEM: 1024}}}
    sidecar = {"spec": {"initContainers": [{"name": "i", "restartPolicy": "Always", **gpu}],
                        "containers": [{"name": "a", **gpu}]}}  # fmt: skip
    plain = {"spec": {"initContainers": [{"name": "i", **gpu}],
                      "containers": [{"name": "a", **gpu}]}}  # fmt: skip
    one = read(sidecar, settings)
    two = read(plain, settings)
    assert isinstance(one, PodRequest) and isinstance(two, PodRequest)
    assert one.sidecars == frozenset({0}) and two.sidecars == frozenset()
    burst = {"metadata": {"annotations": {"tessera.io/gpumem-limit": "4096"}}, **plain}
    limited = read(burst, settings)
    assert isinstance(limited, PodRequest) and limited.containers[0].burst is not None  # type: ignore[union-attr]
    again = read(plain, settings)
    assert again == two and again.containers[0].burst is None  # type: ignore[union-attr]
