"""A pod's options are remembered by the option annotations it carries (key, value), looked up
by walking its annotations, not every key it might carry: the same options, and the same
refusal, as reading every option annotation afresh, whatever was read before."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tessera.scheduler import rules
from tessera.scheduler.rules import PodOptions, parse_pod_options

from tessera.hami import RequestError
from tessera.settings import TesseraSettings

VALUES: dict[str, list[Any]] = {
    "hami.io/gpu-scheduler-policy": ["binpack", "spread", "binpack,numa", "Spread ", "fastest",
                                     "", None, 3, ["binpack"]],
    "hami.io/node-scheduler-policy": ["binpack", "spread", "binpack,spread", "x", None],
    "hami.io/device-scoring-weights": ["slot=1,core=1,memory=3", "slot=0,core=0,memory=0",
                                       "x", None],
    "nvidia.com/vgpu-mode": ["hami-core", " MIG ", "", None],
    "nvidia.com/use-gputype": ["A100,H100", "a100", " , ", None, 5],
    "nvidia.com/nouse-gputype": ["T4", None],
    "nvidia.com/use-gpuuuid": ["GPU-1,GPU-2", None],
    "nvidia.com/nouse-gpuuuid": ["GPU-3", None],
    "nvidia.com/numa-bind": ["true", "TRUE", "false", "yes", None],
    "tessera.io/scrub-on-free": ["true", "false", "maybe", None],
    "tessera.io/gpumem-reclaim": ["fail", "wait", "x", None],
    "tessera.io/gpumem-wait-seconds": ["30", "-1", "x", None],
    "hami.io/use-Ascend910B3-uuid": ["npu-1", None, 7],
    "huawei.com/vnpu-mode": ["vnpu", None],
    "cambricon.com/use-mlutype": ["MLU370", None],
    "hygon.com/nouse-dcutype": ["Z100", None],
    "kubectl.kubernetes.io/last-applied-configuration": ['{"a":1}'],
    "hami.io/vgpu-node": ["n1"],
    "other": [1, None, "x"],
}


def pod(rng: random.Random) -> dict[str, Any]:
    keys = rng.sample(list(VALUES), rng.randint(0, 5))
    annotations = {k: rng.choice(VALUES[k]) for k in keys}
    spec: dict[str, Any] = {"containers": [{"name": "a"}]}
    if rng.random() < 0.2:
        spec["initContainers"] = [{"name": "i", "restartPolicy": rng.choice(["Always", None])}]
    roll = rng.random()
    meta: Any = {"name": "p", "annotations": annotations}
    if roll < 0.03:
        meta["annotations"] = rng.choice([None, [], "x"])
    elif roll < 0.05:
        meta = rng.choice([None, "x"])
    return {"metadata": meta, "spec": spec}


def read(p: dict[str, Any], settings: TesseraSettings) -> PodOptions | str:
    try:
        return parse_pod_options(p, settings)
    except RequestError as exc:
        return f"refused: {exc}"


def afresh(p: dict[str, Any], settings: TesseraSettings) -> PodOptions | str:
    """Every option annotation read, nothing remembered (the reading before the memory)."""
    meta = p.get("metadata") or {}
    annotations = meta.get("annotations") or {} if isinstance(meta, dict) else {}
    try:
        if not isinstance(annotations, dict):
            raise RequestError("metadata.annotations must be a map")
        values = tuple(map(annotations.get, rules._OPTION_ANNOTATIONS))
        return rules._options(values, settings.gpu_scheduler_policy,
                              settings.node_scheduler_policy, rules._sidecars(p))  # fmt: skip
    except RequestError as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize("settings", [TesseraSettings(),
                                      TesseraSettings(gpu_scheduler_policy="binpack",
                                                      node_scheduler_policy="spread")])
def test_remembered_options_are_those_read_afresh(settings: TesseraSettings) -> None:
    rng = random.Random(21)
    pods = [pod(rng) for _ in range(400)]
    read_ones = 0
    for p in [rng.choice(pods) for _ in range(4000)]:
        got = read(p, settings)
        assert got == afresh(p, settings)
        read_ones += isinstance(got, PodOptions)
    assert read_ones > 1000


def test_a_dict_subclass_reads_as_a_dict() -> None:
    class Annotations(dict):  # type: ignore[type-arg]
        pass

    settings = TesseraSettings()
    annotations = Annotations({"hami.io/gpu-scheduler-policy": "binpack"})
    p = {"metadata": {"annotations": annotations}, "spec": {"containers": []}}
    assert read(p, settings) == afresh(p, settings)
    assert read(p, settings).gpu_policies == ("binpack",)  # type: ignore[union-attr]
