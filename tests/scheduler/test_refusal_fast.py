"""A retry of a request refused everywhere is answered at once (`refusal_fast.py`), without
walking its candidates, and says exactly what fitting every candidate says: the same reason
text for every node and the same counts; a retry that fits somewhere now (capacity freed,
cordon lifted) is placed on the reference's node with its grants. A backlog of pending pods
(one container too big for any card, too many cards, a type no node has, two containers that
fit the cards alone but not together) is retried with rotating windows and full lists while
placements, releases and cordons move the nodes in between."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rules import parse_pod_options

from tessera import hami
from tessera.models import DeviceGrant, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB
from .test_decision_reference import place, place_if_it_fits, pod, reference, registration

SETTINGS = TesseraSettings()


def pending(kind: int, uid: str) -> dict[str, Any]:
    """A pod of the backlog (most nodes, or every node, refuse it)."""
    annotations: dict[str, str] = {}
    containers: list[dict[str, Any]]
    if kind == 0:  # more memory than any card has
        containers = [{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 90 * GIB}]
    elif kind == 1:  # more cards than any node
        containers = [{"nvidia.com/gpu": 9, "nvidia.com/gpumem": GIB}]
    elif kind == 2:  # a type no node has
        containers = [{"nvidia.com/gpu": 2, "nvidia.com/gpumem": GIB}]
        annotations["nvidia.com/use-gputype"] = "B200"
    elif kind == 3:  # two whole-card containers: each fits an idle card alone
        containers = [{"nvidia.com/gpu": 4, "nvidia.com/gpucores": 100}] * 2
    else:  # two containers of 30 GiB on 40 GiB cards: alone yes, together on one card no
        containers = [{"nvidia.com/gpu": 4, "nvidia.com/gpumem": 30 * GIB}] * 2
        annotations["hami.io/gpu-scheduler-policy"] = "binpack"
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": [{"name": f"c{i}", "resources": {"limits": dict(limits)}}
                                    for i, limits in enumerate(containers)]}}  # fmt: skip


def release(index: ClusterIndex, name: str) -> None:
    """Every allocation on the node is gone (capacity freed: a refused pod may fit now)."""
    entry = index.entries[name]
    index.set_ledger(name, NodeLedger(node=name), entry.ledger_revision + 1, 0.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_retried_refusal_is_answered_at_once_and_exactly(seed: int) -> None:
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"f{seed}-{i:03d}" for i in range(160)]
    for name in names:
        index.set_registration(name, registration(rng, name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    for i in range(250):  # a busy cluster: most cards partly used
        place_if_it_fits(index, pod(rng, 10_000 + i), rng.choice(names), rng)
    at_once = refused = placed = 0
    start = 0
    for i in range(150):
        spec = pending(i % 5, f"pending-{i % 5}")
        if rng.random() < 0.5:  # kube-scheduler's window from a rotating start
            size = rng.choice([40, 100])
            start = (start + size) % len(names)
            window = (names + names)[start : start + size]
        else:  # every node, from another start (a rotation)
            start = rng.randrange(len(names))
            window = names[start:] + names[:start]
        if rng.random() < 0.1:
            window = [*window, "not-registered"]
        want_fitting, want_failed = reference(index, spec, window)
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), window)
        chosen = next(decision.fits(), None)
        if want_fitting:
            assert chosen is not None, f"call {i}"
            assert (chosen[0].name, chosen[1].containers) == want_fitting[0], f"call {i}"
            placed += 1
        else:
            assert chosen is None, f"call {i}"
            walked = decision.slots == ()
            decision.explain_rest()
            want_failed["not-registered"] = (
                "NodeUnregistered: no Tessera node agent registered this node"
            )
            if "not-registered" not in window:
                del want_failed["not-registered"]
            assert dict(decision.failed) == want_failed, f"call {i}"
            assert decision.reason_counts == reference_counts(index, spec, window), f"call {i}"
            refused += 1
            at_once += walked
        # between retries: placements, a release now and then, cordons
        for j in range(rng.randint(0, 4)):
            other = pod(rng, 1000 * i + j)
            target = rng.choice(names)
            request = hami.parse_pod_request(other, SETTINGS)
            found = next(decide(index, request, parse_pod_options(other, SETTINGS),
                                [target]).fits(), None)  # fmt: skip
            if found is not None:
                place(index, target, other["metadata"]["uid"], found[1].containers, rng)
        if rng.random() < 0.1:
            release(index, rng.choice(names))
        if rng.random() < 0.1:
            target = rng.choice(names)
            index.set_cordon(target, frozenset(c.uuid for c in index.entries[target].cards[:1]),
                             0.0)  # fmt: skip
    assert refused > 50 and placed > 0, (refused, placed)
    assert at_once > refused // 2, (at_once, refused)  # most retries were answered at once


def reference_counts(index: ClusterIndex, spec: dict[str, Any], names: list[str]) -> Any:
    from collections import Counter

    from tessera.scheduler.placement import fit_pod
    from tessera.scheduler.rules import FitContext

    request = hami.parse_pod_request(spec, SETTINGS)
    options = parse_pod_options(spec, SETTINGS)
    counts: Counter[str] = Counter()
    for name in names:
        entry = index.node(name)
        if entry is None:
            counts["NodeUnregistered"] += 1
            continue
        fit = fit_pod(entry.cards, request, FitContext(options))
        counts.update(fit.reasons.keys())
    return counts


def several(rng: random.Random, i: int) -> dict[str, Any]:
    """A pod of 2-3 GPU containers, often too much for one node together."""
    containers = []
    for c in range(rng.choice([2, 2, 3])):
        limits: dict[str, Any] = {"nvidia.com/gpu": rng.choice([1, 2, 4, 8])}
        if rng.random() < 0.3:
            limits["nvidia.com/gpumem-percentage"] = rng.choice([10, 25, 50, 60])
        else:
            limits["nvidia.com/gpumem"] = rng.choice([4, 8, 16, 30, 38]) * GIB
        limits["nvidia.com/gpucores"] = rng.choice([0, 0, 10, 30, 60, 100])
        containers.append({"name": f"c{c}", "resources": {"limits": limits}})
    annotations: dict[str, str] = {}
    if rng.random() < 0.7:
        annotations["hami.io/gpu-scheduler-policy"] = rng.choice(["binpack", "spread", "mutex"])
    if rng.random() < 0.3:
        annotations["hami.io/device-scoring-weights"] = rng.choice(
            ["slot=1,core=2,memory=3", "slot=3,core=0,memory=1", "slot=0,core=0,memory=1"])
    if rng.random() < 0.1:
        annotations["nvidia.com/use-gputype"] = "A10"
    uid = f"several-{i}"
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": containers}}  # fmt: skip


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_pods_of_several_containers_are_refused_as_fitting_each_node(seed: int) -> None:
    """Every node's reason for pods of several containers (read per container they fail at,
    `refusal_shapes.PodSteps`) is the one fitting that node gives, and a node they fit is
    placed as the reference places it, under GPU policies, weights, mutex and percentages."""
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"s{seed}-{i:03d}" for i in range(120)]
    for name in names:
        index.set_registration(name, registration(rng, name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    refused = 0
    for i in range(120):
        for j in range(rng.randint(0, 5)):  # the cluster fills up
            other = pod(rng, 1000 * i + j)
            target = rng.choice(names)
            request = hami.parse_pod_request(other, SETTINGS)
            found = next(decide(index, request, parse_pod_options(other, SETTINGS),
                                [target]).fits(), None)  # fmt: skip
            if found is not None:
                place(index, target, other["metadata"]["uid"], found[1].containers, rng)
        spec = several(rng, i)
        window = rng.sample(names, rng.choice([30, 120]))
        want_fitting, want_failed = reference(index, spec, window)
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), window)
        got = [(entry.name, fit.containers) for entry, fit in decision.fits()]
        assert got == want_fitting, f"call {i}"
        decision.explain_rest()
        assert dict(decision.failed) == want_failed, f"call {i}"
        assert decision.reason_counts == reference_counts(index, spec, window), f"call {i}"
        refused += not got
    assert refused > 10, refused


def test_a_backlogs_memos_outlive_the_requests_of_placed_pods() -> None:
    """Between two retries of a pending pod (seconds of backoff) many placed pods' requests
    come and go; the pending request's memo, which answers its retry at once, is forgotten
    only after every memo of a request that was not refused."""
    from tessera.scheduler.refusal_memo import RefusalMemos, sketch

    memos = RefusalMemos()
    kept = [memos.of(f"pending-{i}", 10) for i in range(3)]
    request = hami.parse_pod_request(pending(0, "x"), SETTINGS)
    for memo in kept:
        memos.mark_refused(memo, request)
    for i in range(500):  # placed pods' lookups
        memos.of(f"placed-{i}", 10)
    assert all(memos.peek(f"pending-{i}") is kept[i] for i in range(3))
    assert memos.maybe_refused(sketch(request))
    assert not memos.maybe_refused(sketch(hami.parse_pod_request(pending(1, "y"), SETTINGS)))
    assert memos.peek("placed-0") is None  # (the others are forgotten as before)


def h100(spec: dict[str, Any]) -> dict[str, Any]:
    """The pod asking for H100s only."""
    spec["metadata"]["annotations"]["nvidia.com/use-gputype"] = "H100"
    return spec


def test_a_first_refusal_on_a_long_list_is_worded_at_once_and_exactly() -> None:
    """A walk of a long list that checked hundreds of candidates, or words a run of known
    refusals to its end, without a fit asks whether every candidate refuses
    (`refused_rest_at_once`): a pod refused everywhere on its first call is then worded at
    once, every node as fitting it says; one that a late node fits (a type the summaries
    cannot see) is still placed where fitting every node places it."""
    rng = random.Random(7)
    index = ClusterIndex()
    names = [f"l-{i:04d}" for i in range(1100)]
    usages = [(9, 10), (10, 5), (12, 10), (20, 60)]
    for n, name in enumerate(names):
        card_type = "NVIDIA-A10" if n == 1000 else "NVIDIA-H100"
        devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type=card_type,
                              memory_mib=40 * GIB, cores=100, split_count=4, numa=i // 2)
                   for i in range(4)]  # fmt: skip
        index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
        grants = [[DeviceGrant(uuid=f"GPU-{name}-{i}", type=card_type, memory_mib=gib * GIB,
                               cores=cores)]
                  for i, (gib, cores) in enumerate(rng.sample(usages, 4))]  # fmt: skip
        if card_type == "NVIDIA-H100":  # (the A10 node idle: the last under binpack)
            place(index, name, f"base-{name}", grants, rng)
    cases = [
        (h100({"metadata": {"name": "four", "namespace": "ns", "uid": "four", "annotations": {}},
               "spec": {"containers": [{"name": "c", "resources": {"limits": {
                   "nvidia.com/gpu": 4, "nvidia.com/gpumem-percentage": 62}}}]}}),
         False),  # (three cards of an H100 node hold 62 % of 40 GiB)
        # 2 × 75 % (30 GiB) on 40 GiB cards, 9-20 GiB used (in %: no node's 4th most free
        # MiB rules it out unchecked, as 4 × 30 GiB would be, below)
        (h100({**pending(4, "together"), "spec": {"containers": [
            {"name": f"c{i}", "resources": {"limits": {
                "nvidia.com/gpu": 4, "nvidia.com/gpumem-percentage": 75}}} for i in range(2)]},
               "metadata": {"name": "together", "namespace": "ns", "uid": "together",
                            "annotations": {"hami.io/gpu-scheduler-policy": "binpack"}}}),
         False),
        (pending(2, "b200"), False),  # (the summaries pass every node: the walk fits some)
        ({**pending(2, "a10"), "metadata": {"name": "a10", "namespace": "ns", "uid": "a10",
          "annotations": {"nvidia.com/use-gputype": "A10"}}}, True),  # one node has A10s
    ]  # fmt: skip
    for spec, fits_late in cases:
        window = names[300:] + names[:300]  # (from another start)
        want_fitting, want_failed = reference(index, spec, window)
        assert bool(want_fitting) == fits_late
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        decision = decide(index, request, options, window)
        got = [(entry.name, fit.containers) for entry, fit in decision.fits()]
        assert got == want_fitting
        assert decision._at_once is (not fits_late)  # (asked, and the answer)
        if not fits_late:
            decision.explain_rest()
            assert dict(decision.failed) == want_failed
            assert decision.reason_counts == reference_counts(index, spec, window)
    # 4 x 25 GiB: the node's 4th most free memory (`bound_mem_kth`) rules out every H100 node
    # before it is checked: nothing walked, every node worded as fitting it says
    spec = h100({"metadata": {"name": "mib", "namespace": "ns", "uid": "mib", "annotations": {}},
                 "spec": {"containers": [{"name": "c", "resources": {"limits": {
                     "nvidia.com/gpu": 4, "nvidia.com/gpumem": 25 * GIB}}}]}})  # fmt: skip
    window = names[300:] + names[:300]
    want_fitting, want_failed = reference(index, spec, window)
    decision = decide(index, hami.parse_pod_request(spec, SETTINGS),
                      parse_pod_options(spec, SETTINGS), window)  # fmt: skip
    assert list(decision.fits()) == want_fitting == []
    # (only the idle A10 node reaches them; its type refuses it)
    assert decision.slots._ordering.checked == 1  # type: ignore[attr-defined]
    decision.explain_rest()
    assert dict(decision.failed) == want_failed
    assert decision.reason_counts == reference_counts(index, spec, window)
