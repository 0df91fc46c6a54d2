"""A refused pod's reasons read per node shape (`refusal_shapes.py`): in a cluster of alike nodes
with varied usage, the first refusal of a request fits one node per shape, not every node, and
every node's HAMi `N/M Reason` and the reason counts are those of fitting each node, for
requests of every kind one container can make (memory in MiB or %, cores, a whole card, too
many cards, a GPU type, NUMA binding, mutex), while placements, cordons and unhealthy cards
move nodes between the calls."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.node_names import NodeNames
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, parse_pod_options

from tessera import hami
from tessera.models import DeviceGrant, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB
from .test_decision_reference import count_fits, place, place_if_it_fits

SETTINGS = TesseraSettings()


def alike(name: str, healthy: int = 4) -> NodeRegistration:
    devices = [
        DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type="NVIDIA-H100", memory_mib=80 * GIB,
                   cores=100, split_count=4, numa=i // 2, healthy=i < healthy)
        for i in range(4)
    ]  # fmt: skip
    return NodeRegistration(node=name, devices=devices)


def pending(kind: int) -> dict[str, Any]:
    limits: dict[str, Any] = {"nvidia.com/gpu": 1}
    annotations: dict[str, str] = {}
    if kind == 0:
        limits["nvidia.com/gpumem"] = 79 * GIB
    elif kind == 1:
        limits.update({"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 90})
    elif kind == 2:
        limits.update({"nvidia.com/gpu": 3, "nvidia.com/gpucores": 100})
    elif kind == 3:
        limits.update({"nvidia.com/gpu": 5})
    elif kind == 4:
        annotations["nvidia.com/use-gputype"] = "A100"
    elif kind == 5:
        limits.update({"nvidia.com/gpu": 3, "nvidia.com/gpumem": 30 * GIB})
        annotations["nvidia.com/numa-bind"] = "true"
    else:
        limits.update({"nvidia.com/gpu": 4, "nvidia.com/gpucores": 80})
        annotations["hami.io/gpu-scheduler-policy"] = "mutex"
    uid = f"pending-{kind}"
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}  # fmt: skip


def filler(rng: random.Random, i: int) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": rng.choice([4, 10, 20, 40]) * GIB,
              "nvidia.com/gpucores": rng.choice([0, 10, 30, 60])}  # fmt: skip
    uid = f"fill-{i}"
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": {}},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}  # fmt: skip


def expected(index: ClusterIndex, spec: dict[str, Any], names: list[str]) -> tuple[dict, Counter]:
    request = hami.parse_pod_request(spec, SETTINGS)
    options = parse_pod_options(spec, SETTINGS)
    failed, counts = {}, Counter()
    for name in names:
        entry = index.node(name)
        assert entry is not None
        fit = fit_pod(entry.cards, request, FitContext(options))
        assert not fit.ok
        failed[name] = fit.reason_text()
        counts.update(fit.reasons.keys())
    return failed, counts


def seed_usage(index: ClusterIndex, names: list[str], rng: random.Random) -> None:
    """Something on every card (no card empty: no pod here fits anywhere)."""
    for name in names:
        grants = [[DeviceGrant(uuid=f"GPU-{name}-{i}", type="NVIDIA-H100",
                               memory_mib=rng.choice([9, 10, 12]) * GIB, cores=rng.choice([5, 10]))]
                  for i in range(4)]  # fmt: skip
        place(index, name, f"base-{name}", grants, rng)


def fill(index: ClusterIndex, names: list[str], rng: random.Random, pods: int, start: int) -> None:
    for i in range(pods):
        place_if_it_fits(index, filler(rng, start + i), rng.choice(names), rng)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_refusal_fits_one_node_per_shape_and_words_every_node_exactly(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"s{seed}-{i:03d}" for i in range(400)]
    for n, name in enumerate(names):
        index.set_registration(name, alike(name, healthy=3 if n % 17 == 0 else 4), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    seed_usage(index, names, rng)
    fill(index, names, rng, 900, 0)
    fits = count_fits(monkeypatch)
    for call in range(28):
        kind = call % 7
        spec = pending(kind)
        window = NodeNames(rng.sample(names, rng.choice([150, 400])))
        window.token = 10**6 * seed + call
        want, want_counts = expected(index, spec, window)
        before = fits["n"]
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), window)
        assert next(decision.fits(), None) is None
        decision.explain_rest()
        assert decision.failed == want, f"call {call}, kind {kind}"
        assert decision.reason_counts == want_counts, f"call {call}, kind {kind}"
        # one fit per shape met for the first time (plus the walk's head, fitted one by one):
        # a small number whatever the window, never a fit per node
        assert fits["n"] - before <= 40, f"call {call}: {fits['n'] - before} fits"
        fill(index, names, rng, rng.randint(0, 8), 10_000 * (call + 1))
        if rng.random() < 0.3:  # a card cordoned: that node's shape changes
            target = rng.choice(names)
            index.set_cordon(target, frozenset({f"GPU-{target}-0"}), 0.0)


def two(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    spec = pending(0)
    spec["spec"]["containers"] = [{"name": "a", "resources": {"limits": first}},
                                  {"name": "b", "resources": {"limits": second}}]
    return spec


def test_several_containers_group_by_the_container_they_fail_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two fitted containers (the second sees what the first took): nodes refusing the first
    are read by its shape, and so are those refusing the second on the cards the first left
    (`refusal_shapes.PodSteps`); a GPU UUID named: every node fitted. The same reasons as
    fitting each node in every case."""
    rng = random.Random(9)
    index = ClusterIndex()
    names = [f"u-{i:03d}" for i in range(60)]
    for name in names:
        index.set_registration(name, alike(name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    seed_usage(index, names, rng)
    fill(index, names, rng, 120, 0)
    small = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": GIB}
    first_refused = two({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 79 * GIB}, small)
    first_taken = two({"nvidia.com/gpu": 4, "nvidia.com/gpumem": GIB},
                      {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 79 * GIB})  # fmt: skip
    uuid = pending(3)
    uuid["metadata"]["annotations"]["nvidia.com/use-gpuuuid"] = "GPU-u-000-0"
    fits = count_fits(monkeypatch)
    for spec, most in ((first_refused, 20), (first_taken, 20), (uuid, None)):
        want, want_counts = expected(index, spec, names)
        before = fits["n"]
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), names)
        assert next(decision.fits(), None) is None
        decision.explain_rest()
        assert decision.failed == want
        assert decision.reason_counts == want_counts
        if most is not None:
            assert fits["n"] - before <= most
        else:
            assert fits["n"] - before >= len(names)  # every node fitted


def test_a_containers_pick_is_a_stable_sorts_first_cards() -> None:
    """The cards a container takes on every candidate at once (`first_smallest`: argmin's
    for one or two cards) are the first `count` of a stable sort of the cards' keys: ties by
    index, cards that do not pass (+inf) last, whatever the count."""
    import numpy as np
    from tessera.scheduler.refusal_steps import first_smallest

    rng = np.random.default_rng(3)
    for _trial in range(100):
        width = int(rng.choice([4, 8, 16]))
        key = rng.integers(-2, 3, size=(40, width)).astype(float)  # (many ties)
        key[rng.random((40, width)) < 0.3] = np.inf
        for count in range(1, width + 1):
            want = np.zeros(key.shape, dtype=bool)
            order = np.argsort(key, axis=1, kind="stable")[:, :count]
            np.put_along_axis(want, order, True, axis=1)
            assert (first_smallest(key, count) == want).all(), count
