"""Every HAMi fit rule, reason and policy, table-driven, on the pure placement code."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.scheduler.cards import build_cards, node_score
from tessera.scheduler.placement import PodFit, fit_pod
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options

from tessera.hami import RequestError, parse_pod_request
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB, container, device, pod

Used = dict[str, tuple[int, int, int]]  # uuid -> (memory MiB, cores, slots)


def run_fit(
    devices: list[DeviceInfo],
    spec: dict[str, Any],
    used: Used | None = None,
    cordoned: frozenset[str] = frozenset(),
    quota: QuotaBudget | None = None,
    settings: TesseraSettings | None = None,
) -> PodFit:
    settings = settings or TesseraSettings()
    cards = build_cards(NodeRegistration(node="n", devices=devices), [], 0.0, cordoned)
    for card in cards:
        mem, cores, slots = (used or {}).get(card.uuid, (0, 0, 0))
        card.used_mem, card.used_cores, card.used_slots = mem, cores, slots
    ctx = FitContext(parse_pod_options(spec, settings), quota or QuotaBudget())
    return fit_pod(cards, parse_pod_request(spec, settings), ctx)


def picked(fit: PodFit) -> list[list[str]]:
    return [[g.uuid for g in c] for c in fit.containers]


TWO = [device("GPU-0", 0), device("GPU-1", 1)]

# (case, devices, pod, used, cordoned, quota, expected reason text or None for a fit)
REASON_CASES: list[
    tuple[
        str, list[DeviceInfo], dict[str, Any], Used, frozenset[str], QuotaBudget | None, str | None
    ]
] = [
    (
        "1 unhealthy",
        [device(healthy=False)],
        pod(container(mem=1000)),
        {},
        frozenset(),
        None,
        "1/1 CardNotHealth",
    ),
    (
        "1 before 2",
        [device(healthy=False)],
        pod(container(mem=1000)),
        {},
        frozenset({"GPU-0"}),
        None,
        "1/1 CardNotHealth",
    ),
    (
        "2 cordoned",
        [device()],
        pod(container(mem=1000)),
        {},
        frozenset({"GPU-0"}),
        None,
        "1/1 CardCordoned",
    ),
    (
        "3 use-gputype",
        [device()],
        pod(container(mem=1000), annotations={"nvidia.com/use-gputype": "A100,V100"}),
        {},
        frozenset(),
        None,
        "1/1 CardTypeMismatch",
    ),
    (
        "3 use-gputype case-insensitive substring",
        [device()],
        pod(container(mem=1000), annotations={"nvidia.com/use-gputype": "h100"}),
        {},
        frozenset(),
        None,
        None,
    ),
    (
        "3 nouse-gputype",
        [device()],
        pod(container(mem=1000), annotations={"nvidia.com/nouse-gputype": "H100"}),
        {},
        frozenset(),
        None,
        "1/1 CardTypeMismatch",
    ),
    (
        "3 vgpu-mode mismatch",
        [device()],
        pod(container(mem=1000), annotations={"nvidia.com/vgpu-mode": "mps"}),
        {},
        frozenset(),
        None,
        "1/1 CardTypeMismatch",
    ),
    (
        "3 vgpu-mode match",
        [device()],
        pod(container(mem=1000), annotations={"nvidia.com/vgpu-mode": "hami-core"}),
        {},
        frozenset(),
        None,
        None,
    ),
    (
        "4 numa-bind",
        [device("GPU-0", 0, numa=0), device("GPU-1", 1, numa=1)],
        pod(container(gpus=2, mem=1000), annotations={"nvidia.com/numa-bind": "true"}),
        {},
        frozenset(),
        None,
        "2/2 NumaNotFit",
    ),
    (
        "5 use-gpuuuid",
        TWO,
        pod(container(mem=1000), annotations={"nvidia.com/use-gpuuuid": "GPU-9"}),
        {},
        frozenset(),
        None,
        "2/2 CardUuidMismatch",
    ),
    (
        "5 nouse-gpuuuid",
        TWO,
        pod(container(mem=1000), annotations={"nvidia.com/nouse-gpuuuid": "GPU-0,GPU-1"}),
        {},
        frozenset(),
        None,
        "2/2 CardUuidMismatch",
    ),
    (
        "6 slots",
        [device(split=2)],
        pod(container(mem=1000)),
        {"GPU-0": (2000, 0, 2)},
        frozenset(),
        None,
        "1/1 CardTimeSlicingExhausted",
    ),
    (
        "7 mutex",
        [device()],
        pod(container(mem=1000), annotations={"hami.io/gpu-scheduler-policy": "mutex"}),
        {"GPU-0": (1000, 0, 1)},
        frozenset(),
        None,
        "1/1 ExclusiveDeviceAllocateConflict",
    ),
    (
        "10 quota memory",
        [device()],
        pod(container(mem=2000)),
        {},
        frozenset(),
        QuotaBudget(memory_mib=1000),
        "1/1 ResourceQuotaNotFit",
    ),
    (
        "10 quota cores",
        [device()],
        pod(container(mem=100, cores=50)),
        {},
        frozenset(),
        QuotaBudget(cores=40),
        "1/1 ResourceQuotaNotFit",
    ),
    (
        "11 memory",
        [device()],
        pod(container(mem=90 * GIB)),
        {},
        frozenset(),
        None,
        "1/1 CardInsufficientMemory",
    ),
    (
        "11 memory from percentage",
        [device()],
        pod(container(pct=60)),
        {"GPU-0": (40 * GIB, 0, 1)},
        frozenset(),
        None,
        "1/1 CardInsufficientMemory",
    ),
    (
        "12 cores",
        [device()],
        pod(container(mem=1000, cores=30)),
        {"GPU-0": (1000, 80, 1)},
        frozenset(),
        None,
        "1/1 CardInsufficientCore",
    ),
    (
        "13 exclusive on used card",
        [device()],
        pod(container(mem=1000, cores=100)),
        {"GPU-0": (1000, 0, 1)},
        frozenset(),
        None,
        "1/1 ExclusiveDeviceAllocateConflict",
    ),
    (
        "8 cores above 100 clamp to exclusive",
        [device()],
        pod(container(mem=1000, cores=150)),
        {"GPU-0": (1000, 0, 1)},
        frozenset(),
        None,
        "1/1 ExclusiveDeviceAllocateConflict",
    ),
    (
        "14 compute exhausted",
        [device()],
        pod(container(mem=1000, cores=0)),
        {"GPU-0": (1000, 100, 1)},
        frozenset(),
        None,
        "1/1 CardComputeUnitsExhausted",
    ),
    (
        "15 mig",
        [device(mode="mig")],
        pod(container(mem=1000), annotations={"nvidia.com/vgpu-mode": "mig"}),
        {},
        frozenset(),
        None,
        "1/1 CardMigTopologyInfeasible",
    ),
    (
        "too few cards",
        TWO,
        pod(container(gpus=3, mem=1000)),
        {},
        frozenset(),
        None,
        "2/2 AllocatedCardsInsufficientRequest",
    ),
    (
        "mixed reasons",
        [device("GPU-0", 0, healthy=False), device("GPU-1", 1), device("GPU-2", 2)],
        pod(container(gpus=1, mem=50 * GIB)),
        {"GPU-1": (40 * GIB, 0, 1), "GPU-2": (40 * GIB, 0, 1)},
        frozenset(),
        None,
        "2/3 CardInsufficientMemory, 1/3 CardNotHealth",
    ),
]


@pytest.mark.parametrize(
    ("case", "devices", "spec", "used", "cordoned", "quota", "expected"),
    REASON_CASES,
    ids=[c[0] for c in REASON_CASES],
)
def test_fit_rule_and_reason(
    case: str,
    devices: list[DeviceInfo],
    spec: dict[str, Any],
    used: Used,
    cordoned: frozenset[str],
    quota: QuotaBudget | None,
    expected: str | None,
) -> None:
    fit = run_fit(devices, spec, used, cordoned, quota)
    if expected is None:
        assert fit.ok, fit.reason_text()
    else:
        assert not fit.ok
        assert fit.reason_text() == expected


FOUR_LINKED = [
    device("GPU-0", 0, numa=0, links={"GPU-1": 100, "GPU-2": 10, "GPU-3": 10}),
    device("GPU-1", 1, numa=0, links={"GPU-0": 100, "GPU-2": 10, "GPU-3": 10}),
    device("GPU-2", 2, numa=1, links={"GPU-3": 200, "GPU-0": 10, "GPU-1": 10}),
    device("GPU-3", 3, numa=1, links={"GPU-2": 200, "GPU-0": 10, "GPU-1": 10}),
]
HALF_USED = {"GPU-1": (40 * GIB, 50, 1)}

# (case, devices, pod, used, the cards picked per container)
POLICY_CASES: list[tuple[str, list[DeviceInfo], dict[str, Any], Used, list[list[str]]]] = [
    ("spread (default) takes the emptiest", TWO, pod(container(mem=1000)), HALF_USED, [["GPU-0"]]),
    (
        "binpack takes the fullest",
        TWO,
        pod(container(mem=1000), annotations={"hami.io/gpu-scheduler-policy": "binpack"}),
        HALF_USED,
        [["GPU-1"]],
    ),
    (
        "mutex takes only idle cards",
        TWO,
        pod(container(mem=1000), annotations={"hami.io/gpu-scheduler-policy": "binpack,mutex"}),
        HALF_USED,
        [["GPU-0"]],
    ),
    (
        "numa keeps the group together",
        FOUR_LINKED,
        pod(
            container(gpus=2, mem=1000), annotations={"hami.io/gpu-scheduler-policy": "spread,numa"}
        ),
        {"GPU-1": (1000, 0, 1)},
        [["GPU-2", "GPU-3"]],
    ),
    (
        "numa-bind resets on a NUMA change",
        FOUR_LINKED,
        pod(
            container(gpus=2, mem=1000),
            annotations={"nvidia.com/numa-bind": "true", "hami.io/gpu-scheduler-policy": "binpack"},
        ),
        {"GPU-0": (1000, 0, 1), "GPU-2": (2000, 0, 1), "GPU-3": (2000, 0, 1)},
        [["GPU-2", "GPU-3"]],
    ),
    (
        "topology-aware: best linked pair",
        FOUR_LINKED,
        pod(
            container(gpus=2, mem=1000),
            annotations={"hami.io/gpu-scheduler-policy": "topology-aware"},
        ),
        {},
        [["GPU-2", "GPU-3"]],
    ),
    (
        "topology-aware: one card whose links matter least",
        FOUR_LINKED,
        pod(container(mem=1000), annotations={"hami.io/gpu-scheduler-policy": "topology-aware"}),
        {},
        [["GPU-0"]],
    ),
    (
        "weights: slots only -> binpack by slots",
        [device("GPU-0", 0), device("GPU-1", 1)],
        pod(
            container(mem=1000),
            annotations={
                "hami.io/gpu-scheduler-policy": "binpack",
                "hami.io/device-scoring-weights": "slot=1,core=0,memory=0",
            },
        ),
        {"GPU-0": (60 * GIB, 0, 1), "GPU-1": (1000, 0, 5)},
        [["GPU-1"]],
    ),
    (
        "weights: memory only -> binpack by memory",
        [device("GPU-0", 0), device("GPU-1", 1)],
        pod(
            container(mem=1000),
            annotations={
                "hami.io/gpu-scheduler-policy": "binpack",
                "hami.io/device-scoring-weights": "slot=0,core=0,memory=1",
            },
        ),
        {"GPU-0": (60 * GIB, 0, 1), "GPU-1": (1000, 0, 5)},
        [["GPU-0"]],
    ),
    (
        "uuid list steers",
        TWO,
        pod(container(mem=1000), annotations={"nvidia.com/use-gpuuuid": "GPU-1"}),
        {},
        [["GPU-1"]],
    ),
    (
        "app containers share the cards they took",
        [device(memory_mib=10 * GIB)],
        pod(container("a", mem=6 * GIB), container("b", gpus=None, mem=4 * GIB)),
        {},
        [["GPU-0"], ["GPU-0"]],
    ),
    (
        "init peak, not sum: init 7 GiB then app 6 GiB on a 10 GiB card",
        [device(memory_mib=10 * GIB)],
        pod(container("app", mem=6 * GIB), init=[container("init", mem=7 * GIB)]),
        {},
        [["GPU-0"], ["GPU-0"]],
    ),
    (
        "no-GPU containers keep their (empty) place",
        [device()],
        pod(container("side", gpus=None), container("gpu", mem=1000)),
        {},
        [[], ["GPU-0"]],
    ),
]


@pytest.mark.parametrize(
    ("case", "devices", "spec", "used", "expected"), POLICY_CASES, ids=[c[0] for c in POLICY_CASES]
)
def test_gpu_policy(
    case: str, devices: list[DeviceInfo], spec: dict[str, Any], used: Used,
    expected: list[list[str]],
) -> None:  # fmt: skip
    fit = run_fit(devices, spec, used)
    assert fit.ok, fit.reason_text()
    assert picked(fit) == expected


def test_app_containers_do_not_overfill_a_card_together() -> None:
    fit = run_fit([device(memory_mib=10 * GIB)],
                  pod(container("a", mem=6 * GIB), container("b", mem=6 * GIB)))  # fmt: skip
    assert not fit.ok
    assert fit.reason_text() == "1/1 CardInsufficientMemory"


def test_defaults_bare_gpu_takes_the_whole_card_memory() -> None:
    fit = run_fit([device()], pod(container(gpus=1)))
    assert fit.ok and fit.containers[0][0].memory_mib == 80 * GIB
    second = run_fit([device()], pod(container(gpus=1)), {"GPU-0": (80 * GIB, 0, 1)})
    assert second.reason_text() == "1/1 CardInsufficientMemory"


def test_default_mem_and_cores_settings_apply() -> None:
    settings = TesseraSettings(default_mem=3000, default_cores=20)
    fit = run_fit([device()], pod(container(gpus=1)), settings=settings)
    assert fit.containers[0][0].memory_mib == 3000 and fit.containers[0][0].cores == 20


def test_percentage_becomes_memory_of_that_card() -> None:
    fit = run_fit([device(memory_mib=40 * GIB)], pod(container(pct=25)))
    assert fit.containers[0][0].memory_mib == 10 * GIB


def test_memory_scaling_is_what_the_agent_advertises() -> None:
    # An 80 GiB card with deviceMemoryScaling 2 is advertised as 160 GiB: 100 GiB fits.
    fit = run_fit([device(memory_mib=160 * GIB)], pod(container(mem=100 * GIB)))
    assert fit.ok


def test_core_scaling_is_what_the_agent_advertises() -> None:
    fit = run_fit([device(cores=200)], pod(container(mem=100, cores=80)), {"GPU-0": (0, 100, 1)})
    assert fit.ok


@pytest.mark.parametrize(
    "annotations",
    [
        {"hami.io/gpu-scheduler-policy": "best"},
        {"hami.io/node-scheduler-policy": "mutex"},
        {"hami.io/device-scoring-weights": "slot=1,core=1"},
        {"hami.io/device-scoring-weights": "slot=0,core=0,memory=0"},
        {"nvidia.com/use-gputype": 5},
    ],
)
def test_bad_annotations_are_request_errors(annotations: dict[str, Any]) -> None:
    with pytest.raises(RequestError):
        parse_pod_options(pod(container(), annotations=annotations), TesseraSettings())


def test_pod_annotation_overrides_cluster_default_policy() -> None:
    settings = TesseraSettings(gpu_scheduler_policy="binpack")
    fit = run_fit(TWO, pod(container(mem=1000)), HALF_USED, settings=settings)
    assert picked(fit) == [["GPU-1"]]
    spread = pod(container(mem=1000), annotations={"hami.io/gpu-scheduler-policy": "spread"})
    assert picked(run_fit(TWO, spread, HALF_USED, settings=settings)) == [["GPU-0"]]


def _allocation(uid: str, containers: list[list[tuple[int, int]]], init_count: int = 0,
                init_done: bool = False) -> Allocation:  # fmt: skip
    return Allocation(
        pod_uid=uid, namespace="d", name=uid, node="n", init_count=init_count,
        init_done=init_done, state=AllocationState.BOUND,
        containers=[[DeviceGrant(uuid="GPU-0", type="T", memory_mib=m, cores=c) for m, c in cs]
                    for cs in containers],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("allocations", "expected"),
    [
        (
            [_allocation("a", [[(30 * GIB, 50)]]), _allocation("b", [[(20 * GIB, 30)]])],
            (50 * GIB, 80, 2),
        ),
        ([_allocation("i", [[(60 * GIB, 10)], [(30 * GIB, 20)]], init_count=1)], (60 * GIB, 20, 1)),
        (
            [_allocation("i", [[(60 * GIB, 10)], [(30 * GIB, 20)]], init_count=1, init_done=True)],
            (30 * GIB, 20, 1),
        ),
        ([_allocation("two", [[(10, 5)], [(20, 5)]])], (30, 10, 2)),
    ],
    ids=["worked example", "init peak", "init done shrinks", "app sum"],
)
def test_usage_from_allocations(
    allocations: list[Allocation], expected: tuple[int, int, int]
) -> None:
    cards = build_cards(NodeRegistration(node="n", devices=[device()]), allocations, 0.0)
    assert (cards[0].used_mem, cards[0].used_cores, cards[0].used_slots) == expected


def test_node_score_is_hamis_formula() -> None:
    reg = NodeRegistration(node="n", devices=[device("GPU-0", 0), device("GPU-1", 1)])
    cards = build_cards(reg, [_allocation("a", [[(40 * GIB, 50)]])], 0.0)
    # slots 1/20, cores 50/200, memory 40/160 GiB
    assert node_score(cards) == pytest.approx(10 * (1 / 20 + 50 / 200 + 40 / 160))


def test_expired_reservation_stops_counting() -> None:
    a = _allocation("r", [[(10 * GIB, 10)]])
    a.state, a.expires_at = AllocationState.RESERVED, 100.0
    reg = NodeRegistration(node="n", devices=[device()])
    assert build_cards(reg, [a], 99.0)[0].used_mem == 10 * GIB
    assert build_cards(reg, [a], 100.0)[0].used_mem == 0
