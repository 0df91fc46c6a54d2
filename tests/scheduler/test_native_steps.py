"""The native refusal steps (`native/refusals`, `native_steps.NativeSteps`) compute a refused
pod's container steps exactly as the numpy path (`refusal_steps.step_arrays`) does: for every
candidate the step it fails at, its signature, its cards' codes then, whether it is refused and
whether a pick chose by index between unlike cards, on adversarial clusters (mixed card sizes,
types, split counts and widths, unhealthy and cordoned cards, cards out of slots, busy cards)
and pods (2-3 containers, percentages, whole cards, no cores, mutex, binpack and spread, odd
and huge scoring weights); the library steps aside (None) where it does not apply, and without
it a refusal is computed in numpy, with the same reasons."""

from __future__ import annotations

import fcntl
import random
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.native_steps import LIBRARY_ENV, NativeSteps
from tessera.scheduler.refusal_steps import PodSteps, grouped, step_arrays
from tessera.scheduler.rules import parse_pod_options

from tessera import hami
from tessera.models import DeviceGrant, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB
from .test_decision_reference import place, place_if_it_fits, pod, reference

SETTINGS = TesseraSettings()
REFUSALS_DIR = Path(__file__).resolve().parents[2] / "native" / "refusals"


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The library as `make native` builds it (built here when missing: one cc call)."""
    build = REFUSALS_DIR / "build"
    build.mkdir(exist_ok=True)
    with (build / ".lock").open("a") as lock:  # (the suite's workers share the build)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            made = subprocess.run(["make", "-s", "-C", str(REFUSALS_DIR)], capture_output=True,
                                  text=True)  # fmt: skip
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert made.returncode == 0, made.stdout + made.stderr
    assert NativeSteps.load() is not None


def registration(rng: random.Random, name: str, wide: bool) -> NodeRegistration:
    """A node of 1-8 (or up to 12) cards of one of a few sizes, some unhealthy."""
    memory = rng.choice([1, 16, 40, 80]) * GIB + rng.choice([0, 0, 1, 511])
    split = rng.choice([1, 2, 4, 10])
    devices = [
        DeviceInfo(uuid=f"GPU-{name}-{i}", index=i,
                   type=rng.choice(["NVIDIA-H100", "NVIDIA-A10"]), memory_mib=memory,
                   cores=rng.choice([100, 100, 50]), split_count=split, numa=i // 2,
                   healthy=rng.random() > 0.05)
        for i in range(rng.choice([1, 2, 4, 8, 12] if wide else [1, 2, 4, 8]))
    ]  # fmt: skip
    return NodeRegistration(node=name, devices=devices)


# 18 digits, the most admission takes; not exact in doubles (scores lose precision).
HUGE_WEIGHTS = "slot=999999999999999989,core=576460752303423487,memory=288230376151711743"


def several(rng: random.Random, i: int) -> dict[str, Any]:
    """A pod of 2-3 GPU containers, with the options that change how each picks its cards."""
    containers = []
    for c in range(rng.choice([2, 2, 3])):
        limits: dict[str, Any] = {"nvidia.com/gpu": rng.choice([1, 1, 2, 3, 4, 8, 13])}
        if rng.random() < 0.3:
            limits["nvidia.com/gpumem-percentage"] = rng.choice([1, 10, 25, 50, 60, 100])
        else:
            limits["nvidia.com/gpumem"] = rng.choice([1, 4, 8, 16, 30, 38]) * GIB
        limits["nvidia.com/gpucores"] = rng.choice([0, 0, 10, 30, 60, 100])
        containers.append({"name": f"c{c}", "resources": {"limits": limits}})
    annotations: dict[str, str] = {
        "hami.io/node-scheduler-policy": rng.choice(["binpack", "spread"])}
    if rng.random() < 0.8:
        annotations["hami.io/gpu-scheduler-policy"] = rng.choice(
            ["binpack", "spread", "mutex", "mutex,binpack", "spread,binpack"])
    if rng.random() < 0.5:
        annotations["hami.io/device-scoring-weights"] = rng.choice(
            ["slot=1,core=2,memory=3", "slot=3,core=0,memory=1", "slot=0,core=0,memory=1",
             "slot=0,core=7,memory=0", HUGE_WEIGHTS,
             "slot=999999937,core=3,memory=999999929"])  # fmt: skip
    if rng.random() < 0.2:
        annotations["nvidia.com/use-gputype"] = rng.choice(["A10", "H100"])
    uid = f"native-{i}"
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": containers}}  # fmt: skip


def cluster(seed: int, nodes: int, wide: bool) -> tuple[ClusterIndex, list[str], random.Random]:
    """A busy cluster: cards partly used, some full, some cordoned."""
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"n{seed}-{i:03d}" for i in range(nodes)]
    for name in names:
        index.set_registration(name, registration(rng, name, wide), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    for i in range(3 * nodes):
        place_if_it_fits(index, pod(rng, 50_000 + i), rng.choice(names), rng)
    for name in rng.sample(names, nodes // 10):
        cards = index.entries[name].cards
        index.set_cordon(name, frozenset(c.uuid for c in cards[: rng.randint(1, len(cards))]),
                         0.0)  # fmt: skip
    return index, names, rng


def steps_of(spec: dict[str, Any]) -> PodSteps:
    """The pod's containers as steps (whether `first_step` groups its refusals by them or,
    for weights over `_EXACT_WEIGHT`, not: both paths compute them alike either way)."""
    request = hami.parse_pod_request(spec, SETTINGS)
    return PodSteps([r for r in request.all if r is not None], parse_pod_options(spec, SETTINGS))


def assert_same(index: ClusterIndex, slots: np.ndarray, steps: PodSteps, label: str) -> bool:
    """Both paths' arrays and ties are equal; whether a tie was marked."""
    native = NativeSteps.load()
    assert native is not None
    native_ties = np.zeros(len(slots), dtype=bool)
    numpy_ties = np.zeros(len(slots), dtype=bool)
    found = native.steps(index, slots, steps, native_ties)
    assert found is not None, label
    want = step_arrays(index, slots, steps, numpy_ties)
    for got_array, want_array, what in zip(found, want, ("failed at", "signature", "codes",
                                                          "refused"), strict=True):  # fmt: skip
        assert got_array.dtype == want_array.dtype, (label, what)
        assert np.array_equal(got_array, want_array), (label, what)
    assert np.array_equal(native_ties, numpy_ties), (label, "ties")
    assert_same_groups(np.stack(want[:2], axis=1), want[2], want[3], label)
    return bool(numpy_ties.any())


def assert_same_groups(head: np.ndarray, codes: np.ndarray, where: np.ndarray,
                       label: str) -> None:
    """The library's grouping is `grouped`'s: the same key for every row grouped, the same
    rows not grouped, each group's first row the same (the numbering may differ)."""
    native = NativeSteps.load()
    assert native is not None
    found = native.group(head, codes, where)
    assert found is not None, label
    same_grouping(found, grouped(head, codes, where), label)


def same_grouping(found: tuple, want: tuple, label: str) -> None:
    """Two (group by row, keys, firsts): the same key for every row grouped, the same rows
    not grouped, each group's first row the same, the same key for the rows not grouped."""
    groups, keys, first = found
    want_groups, want_keys, want_first = want
    assert np.array_equal(groups < 0, want_groups < 0), (label, "grouped")
    assert len(keys) == len(want_keys), (label, "groups")  # (the rows not grouped: one)
    at = np.flatnonzero(groups >= 0)
    got = [keys[g] for g in groups[at].tolist()]
    assert got == [want_keys[g] for g in want_groups[at].tolist()], (label, "keys")
    assert np.array_equal(first[groups[at]], want_first[want_groups[at]]), (label, "first")
    real = set(groups[at].tolist())
    assert len(real) == len(set(want_groups[at].tolist())), (label, "groups")
    rest = [g for g in range(len(keys)) if g not in real]  # (the rows not grouped: `grouped`
    want_rest = [g for g in range(len(want_keys))  # keys them as a group no row is given)
                 if g not in set(want_groups[at].tolist())]  # fmt: skip
    assert [(keys[g], int(first[g])) for g in rest] == [
        (want_keys[g], int(want_first[g])) for g in want_rest], (label, "not grouped")


def test_the_native_grouping_is_numpys_on_collisions_and_wide_codes() -> None:
    """Rows alike but for their codes' order, codes spanning past what `grouped` packs
    exactly (its hashed path), many rows of few groups, and rows not grouped."""
    rng = np.random.default_rng(5)
    for width, span, rows in ((8, 4, 3000), (16, 40_000, 500), (3, 2, 50), (1, 3, 10),
                              (12, 70_000, 200)):  # fmt: skip
        base = rng.integers(-1, span, size=(rows // 10 + 1, width))
        codes = base[rng.integers(0, len(base), size=rows)]
        codes = np.ascontiguousarray(rng.permuted(codes, axis=1), dtype=np.int64)
        head = np.ascontiguousarray(rng.integers(-1, 3, size=(rows, 2)), dtype=np.int64)
        where = rng.random(rows) < 0.8
        assert_same_groups(head, codes, where, f"width {width} span {span}")


@pytest.mark.parametrize(("seed", "wide"), [(11, False), (12, False), (13, True)])
def test_the_native_steps_equal_numpy_on_adversarial_clusters_and_pods(seed: int,
                                                                       wide: bool) -> None:
    index, names, rng = cluster(seed, 90, wide)
    every = np.asarray([index.slot_of[name] for name in names], dtype=np.int64)
    compared = refused = tied = 0
    for i in range(160):
        steps = steps_of(several(rng, i))
        # candidates in any order, some twice; every node, a window, a handful
        slots = rng.choice([every, every[::-1], np.asarray(rng.sample(list(every), 20)),
                            np.concatenate([every[:30], every[:30]]), every[:1]])  # fmt: skip
        tied += assert_same(index, slots, steps, f"pod {i}")
        refused += bool(step_arrays(index, slots, steps)[3].any())
        compared += 1
        if i % 20 == 19:  # the cluster moves on: more placements
            for j in range(30):
                place_if_it_fits(index, pod(rng, 90_000 + 100 * i + j), rng.choice(names), rng)
    assert compared > 100 and refused > 50 and tied > 0, (compared, refused, tied)


def test_cards_alike_but_for_their_pods_tie_alike() -> None:
    """Cards holding the same memory and cores in one pod or in two (equal keys where the slot
    term does not weigh, unlike used slots where the pod's later containers could run a card
    out of them): the ties are marked alike."""
    rng = random.Random(41)
    index = ClusterIndex()
    names = [f"alike-{i:02d}" for i in range(60)]
    for name in names:
        split = rng.choice([2, 3, 4])
        devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type="NVIDIA-H100",
                              memory_mib=40 * GIB, cores=100, split_count=split, numa=0)
                   for i in range(4)]  # fmt: skip
        index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
        grants = []
        for device in devices:  # 8 GiB and 20 % in one pod, in two, or nothing
            pods = rng.choice([0, 1, 2])
            grants += [[DeviceGrant(uuid=device.uuid, type=device.type,
                                    memory_mib=8 * GIB // pods, cores=20 // pods)]
                       for _ in range(pods)]  # fmt: skip
        for n, grant in enumerate(grants):
            place(index, name, f"{name}-pod{n}", [grant], rng)
    slots = np.asarray([index.slot_of[name] for name in names], dtype=np.int64)
    tied = 0
    for policy in ("spread", "binpack", "mutex"):
        for weights in ("slot=0,core=0,memory=1", "slot=1,core=1,memory=1"):
            for count, memory in ((1, 30), (2, 30), (3, 20), (4, 33)):
                limits = {"nvidia.com/gpu": count, "nvidia.com/gpumem": memory * GIB}
                spec = {"metadata": {"name": "p", "namespace": "ns", "uid": "p", "annotations": {
                            "hami.io/gpu-scheduler-policy": policy,
                            "hami.io/device-scoring-weights": weights}},
                        "spec": {"containers": [
                            {"name": "a", "resources": {"limits": limits}},
                            {"name": "b", "resources": {"limits": limits}}]}}  # fmt: skip
                steps = steps_of(spec)
                tied += assert_same(index, slots, steps, f"{policy} {weights} {count}")
    assert tied > 3, tied


def test_the_library_steps_aside_where_it_does_not_apply() -> None:
    """A cluster with a card of another sharing mode (codes are then raw inputs, not
    verdicts), and a pod binding to one NUMA node: None (the numpy path decides)."""
    index, names, rng = cluster(21, 20, False)
    slots = np.asarray([index.slot_of[name] for name in names], dtype=np.int64)
    spec = several(rng, 0)
    steps = steps_of(spec)
    native = NativeSteps.load()
    assert native is not None
    numa = PodSteps(steps.containers, replace(steps.options, numa_bind=True))
    assert native.steps(index, slots, numa, None) is None
    devices = [DeviceInfo(uuid="GPU-mps-0", index=0, type="NVIDIA-H100", memory_mib=80 * GIB,
                          cores=100, split_count=4, mode="mps")]  # fmt: skip
    index.set_registration("mps-node", NodeRegistration(node="mps-node", devices=devices), 0.0)
    index.set_ledger("mps-node", NodeLedger(node="mps-node"), 1, 0.0)
    assert native.steps(index, slots, steps, None) is None


@pytest.mark.parametrize("seed", [31, 32])
def test_without_the_library_a_refusal_says_the_same(seed: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The library missing (another path named): pods of several containers are refused and
    placed exactly as fitting every node says, as with it."""
    monkeypatch.setenv(LIBRARY_ENV, str(REFUSALS_DIR / "build" / "missing.so"))
    assert NativeSteps.load() is None
    index, names, rng = cluster(seed, 70, False)
    refused = 0
    for i in range(40):
        spec = several(rng, i)
        want_fitting, want_failed = reference(index, spec, names)
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), names)
        got = [(entry.name, fit.containers) for entry, fit in decision.fits()]
        assert got == want_fitting, f"pod {i}"
        decision.explain_rest()
        assert dict(decision.failed) == want_failed, f"pod {i}"
        refused += not got
    assert refused > 5, refused


@pytest.mark.parametrize("seed", [71, 72])
def test_one_containers_codes_and_groups_in_c_are_numpys(seed: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod of one container is grouped by every candidate's codes against it
    (`refusal_shapes._group`): in C (the codes of every row, grouped rows or not, keyed as
    numpy keys them) as in numpy."""
    from tessera.scheduler import refusal_shapes

    index, names, rng = cluster(seed, 120, seed % 2 == 0)
    every = np.asarray([index.slot_of[name] for name in names], dtype=np.int64)
    for i in range(60):
        spec = several(rng, i)
        spec["spec"]["containers"] = spec["spec"]["containers"][:1]
        steps = steps_of(spec)
        slots = rng.choice([every, every[::-1], np.concatenate([every[:30]] * 2)])
        found = refusal_shapes._group(index, slots, steps)
        with monkeypatch.context() as patched:
            patched.setattr(NativeSteps, "load", classmethod(lambda cls: None))
            want = refusal_shapes._group(index, slots, steps)
        same_grouping(found, want, f"pod {i}")
