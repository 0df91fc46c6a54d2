"""Each distinct node row is read once by a refusal (`refusal_states.py`): nodes whose cards
stand alike (the same multiset of card states, in any order) share a number, a write of a row
renumbers it, and a refusal's groups (`refusal_shapes.group`) read from one node per number
word every node as fitting it does, including pods of several containers whose pick chose by
card index between cards that tie on HAMi's device score but stand differently, where the
order of a node's cards decides whether, and why, it refuses."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.refusal_shapes import first_step, group
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options

from tessera import hami
from tessera.models import DeviceGrant, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB
from .test_decision_reference import place, place_if_it_fits
from .test_native_steps import built, cluster  # noqa: F401  (`built`: the library, made)
from .test_refusal_fast import reference_counts

SETTINGS = TesseraSettings()


def node(index: ClusterIndex, name: str, usage: list[tuple[int, int]], rng: random.Random,
         numa: tuple[int, ...] = (0, 0, 1, 1)) -> None:
    """A node of len(usage) H100s on NUMA nodes `numa`, each card used as (GiB, cores) by one
    pod."""
    devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type="NVIDIA-H100",
                          memory_mib=80 * GIB, cores=100, split_count=4, numa=numa[i])
               for i in range(len(usage))]  # fmt: skip
    index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
    index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    grants = [[DeviceGrant(uuid=f"GPU-{name}-{i}", type="NVIDIA-H100", memory_mib=gib * GIB,
                           cores=cores)] for i, (gib, cores) in enumerate(usage)]  # fmt: skip
    place(index, name, f"base-{name}", grants, rng)


def spec(containers: list[dict[str, Any]], annotations: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "p", "annotations": annotations},
            "spec": {"containers": [{"name": f"c{i}", "resources": {"limits": limits}}
                                    for i, limits in enumerate(containers)]}}  # fmt: skip


def test_rows_alike_in_any_order_share_a_number_until_one_is_written() -> None:
    rng = random.Random(1)
    index = ClusterIndex()
    node(index, "a", [(20, 60), (20, 0), (10, 10)], rng, (0, 0, 0))
    node(index, "b", [(10, 10), (20, 0), (20, 60)], rng, (0, 0, 0))  # a's cards in another order
    node(index, "c", [(20, 60), (20, 1), (10, 10)], rng, (0, 0, 0))  # one core apart
    slots = np.asarray([index.slot_of[n] for n in "abc"], dtype=np.int64)
    a, b, c = index.row_states.of(index, slots).tolist()
    assert a == b != c
    place(index, "b", "more", [[DeviceGrant(uuid="GPU-b-0", type="NVIDIA-H100",
                                            memory_mib=GIB, cores=0)]], rng)  # fmt: skip
    a2, b2, c2 = index.row_states.of(index, slots).tolist()
    assert (a2, c2) == (a, c) and b2 not in (a, c)


def reasons_by_group(index: ClusterIndex, pod: dict[str, Any], names: list[str]) -> None:
    """Every grouped node is refused with its group's first node's text, or fits as it does
    (a pod of several containers: a node it fits is not grouped)."""
    request = hami.parse_pod_request(pod, SETTINGS)
    options = parse_pod_options(pod, SETTINGS)
    container, _alone = first_step(request, options, QuotaBudget())  # type: ignore[misc]
    slots = np.asarray([index.slot_of[n] for n in names], dtype=np.int64)
    groups, keys, first = group(index, slots, container)
    assert len(keys) == len(first)
    ctx = FitContext(options)
    for position, name in enumerate(names):
        fit = fit_pod(index.entries[name].cards, request, ctx)
        g = int(groups[position])
        if fit.ok and len(request.containers) > 1:
            assert g < 0, name
        if g >= 0:
            head = names[int(first[g])]
            assert int(first[g]) <= position
            want = fit_pod(index.entries[head].cards, request, ctx)
            assert (fit.ok, fit.reason_text()) == (want.ok, want.reason_text()), (name, head)


def test_a_pick_by_index_between_unlike_cards_reads_the_node_as_it_is() -> None:
    """Cards A (20 GiB, 60 cores used) and B (20 GiB, 0 cores) tie on a memory-only device
    score: the first container takes whichever comes first. Taking B leaves no card with 95
    cores for the second: nodes listing B first refuse it for cores, those listing A first
    fit it (or refuse a third container later, for memory), though their rows are the same
    multiset."""
    rng = random.Random(2)
    index = ClusterIndex()
    names = []
    for i in range(120):
        name = f"n{i:03d}"
        usage = [(20, 60), (20, 0)] if i % 3 else [(20, 0), (20, 60)]  # (B first leads)
        node(index, name, [*usage, (70, 10), (70, 10)], rng)
        names.append(name)
    weights = {"hami.io/device-scoring-weights": "slot=0,core=0,memory=1",
               "hami.io/gpu-scheduler-policy": "spread"}  # fmt: skip
    first_then_most = [{"nvidia.com/gpu": 1, "nvidia.com/gpumem": GIB, "nvidia.com/gpucores": 10},
                       {"nvidia.com/gpu": 1, "nvidia.com/gpumem": GIB, "nvidia.com/gpucores": 95}]
    reasons_by_group(index, spec(first_then_most, weights), names)
    roomy = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 75 * GIB}
    refused = spec([*first_then_most, roomy], weights)  # (no card has 75 GiB: refused)
    reasons_by_group(index, refused, names)
    request = hami.parse_pod_request(refused, SETTINGS)
    ctx = FitContext(parse_pod_options(refused, SETTINGS))
    texts = {fit_pod(index.entries[n].cards, request, ctx).reason_text() for n in names}
    assert len(texts) == 2  # (the two orders refuse differently)
    decision = decide(index, request, parse_pod_options(refused, SETTINGS), names)
    assert next(decision.fits(), None) is None
    decision.explain_rest()
    assert dict(decision.failed) == {
        n: fit_pod(index.entries[n].cards, request, ctx).reason_text() for n in names}
    assert decision.reason_counts == reference_counts(index, refused, names)


def test_refusals_of_many_alike_nodes_are_worded_as_fitting_each() -> None:
    """Nodes of a few usages, cards shuffled, placements in between: every refused pod's
    reasons (one container, several, percentages, weights) are the ones fitting gives."""
    rng = random.Random(3)
    index = ClusterIndex()
    usages = [(20, 60), (20, 0), (40, 50), (10, 10), (79, 0)]
    names = []
    for i in range(150):
        name = f"m{i:03d}"
        node(index, name, rng.sample(rng.choice([usages[:4], usages[1:]]), 4), rng,
             rng.choice([(0, 0, 1, 1), (0, 1, 0, 1)]))
        names.append(name)
    refused = 0
    for call in range(40):
        containers = []
        for _ in range(rng.choice([1, 2, 2, 3])):
            limits: dict[str, Any] = {"nvidia.com/gpu": rng.choice([1, 2, 3, 4])}
            if rng.random() < 0.3:
                limits["nvidia.com/gpumem-percentage"] = rng.choice([10, 50, 75])
            else:
                limits["nvidia.com/gpumem"] = rng.choice([1, 20, 40, 60]) * GIB
            limits["nvidia.com/gpucores"] = rng.choice([0, 10, 40, 60, 100])
            containers.append(limits)
        annotations = {"hami.io/gpu-scheduler-policy": rng.choice(["binpack", "spread"])}
        if rng.random() < 0.5:
            annotations["hami.io/device-scoring-weights"] = rng.choice(
                ["slot=0,core=0,memory=1", "slot=1,core=0,memory=0", "slot=0,core=1,memory=0"])
        pod = spec(containers, annotations)
        reasons_by_group(index, pod, names)
        request = hami.parse_pod_request(pod, SETTINGS)
        options = parse_pod_options(pod, SETTINGS)
        decision = decide(index, request, options, names)
        chosen = next(decision.fits(), None)
        if chosen is None:
            refused += 1
            decision.explain_rest()
            ctx = FitContext(options)
            assert dict(decision.failed) == {
                n: fit_pod(index.entries[n].cards, request, ctx).reason_text() for n in names
            }, f"call {call}"  # fmt: skip
        else:
            entry, fit = chosen
            place(index, entry.name, f"placed-{call}", fit.containers, rng)
    assert refused > 10, refused


def test_a_full_table_starts_over_and_numbers_rows_alike(monkeypatch) -> None:
    """Past its size the table of row states starts over: every row is numbered again as it
    is read, alike rows still share a number and unlike ones do not."""
    from tessera.scheduler import refusal_states

    monkeypatch.setattr(refusal_states, "_TABLE_MIN", 4)
    monkeypatch.setattr(refusal_states, "_TABLE_PER_ROW", 0)
    rng = random.Random(4)
    index = ClusterIndex()
    usages = [[(20, 60), (10, 10)], [(10, 10), (20, 60)], [(30, 0), (10, 10)]]
    for i in range(30):
        node(index, f"t{i:02d}", usages[i % 3], rng, (0, 0))
    slots = np.asarray([index.slot_of[f"t{i:02d}"] for i in range(30)], dtype=np.int64)
    for round_ in range(6):  # (each write a new state: the table fills and starts over)
        name = f"t{round_ * 3 + 2:02d}"
        place(index, name, f"extra-{round_}", [[DeviceGrant(
            uuid=f"GPU-{name}-1", type="NVIDIA-H100", memory_mib=GIB, cores=1)]], rng)
        numbers = index.row_states.of(index, slots).tolist()
        for i in range(30):
            for j in range(30):
                same = sorted(zip(index.card_mem[slots[i]].tolist(),
                                  index.card_cores[slots[i]].tolist(),
                                  index.card_slots[slots[i]].tolist(), strict=True)) == sorted(
                    zip(index.card_mem[slots[j]].tolist(), index.card_cores[slots[j]].tolist(),
                        index.card_slots[slots[j]].tolist(), strict=True))  # fmt: skip
                assert (numbers[i] == numbers[j]) == same, (round_, i, j)


def test_distinct_rows_are_each_numbers_first_candidate_in_order(monkeypatch) -> None:
    """`RowStates.distinct` (a scatter of first places, no sort) finds what sorting the numbers
    finds: each distinct number's first candidate in the candidates' order and each
    candidate's place among them, or None when most rows are distinct."""
    from tessera.scheduler.refusal_states import RowStates

    rng = np.random.default_rng(5)
    states = RowStates()
    monkeypatch.setattr(states, "_native", lambda _index, _slots: None)  # (numpy's; C: below)
    for _ in range(200):
        count = int(rng.integers(1, 3000))
        numbers = rng.integers(0, int(rng.integers(1, count + 5)), count).astype(np.int64)
        monkeypatch.setattr(states, "of", lambda _index, _slots, numbers=numbers: numbers)
        found = states.distinct(None, np.arange(count))
        _unique, firsts = np.unique(numbers, return_index=True)
        if 4 * len(firsts) > 3 * count:
            assert found is None
            continue
        assert found is not None
        reps, place = found
        assert reps.tolist() == sorted(firsts.tolist())
        assert (numbers[reps[place]] == numbers).all()  # (each candidate's own number)
        assert (reps[place] <= np.arange(count)).all()  # (and its first candidate)


def test_the_native_distinct_rows_are_numpys(monkeypatch) -> None:
    """The library's reading of the candidates' distinct rows (`RowStates._native`) is the
    numpy path's, on candidates in any order, repeated, and after rows were written (their
    numbers stale: renumbered first)."""
    from tessera.scheduler.native_steps import NativeSteps

    from .test_decision_reference import pod

    assert NativeSteps.load() is not None  # (built: `built`)
    index, names, rng = cluster(61, 150, False)
    every = np.asarray([index.slot_of[name] for name in names], dtype=np.int64)
    numpy_states = index.row_states
    compared = 0
    for i in range(60):
        slots = rng.choice([every, np.concatenate([every[:40]] * 3), np.repeat(every[:50], 3),
                            np.asarray(rng.choices(list(every[:60]), k=200))])  # fmt: skip
        native = numpy_states.distinct(index, slots)
        with monkeypatch.context() as patched:
            patched.setattr(numpy_states, "_native", lambda _index, _slots: None)
            want = numpy_states.distinct(index, slots)
        assert (native is None) == (want is None), i
        if want is not None:
            assert np.array_equal(native[0], want[0]) and np.array_equal(native[1], want[1]), i
            compared += 1
        for j in range(rng.randint(0, 6)):  # rows written: their numbers stale
            place_if_it_fits(index, pod(rng, 70_000 + 10 * i + j), rng.choice(names),
                             random.Random(j))
    assert compared > 25, compared
