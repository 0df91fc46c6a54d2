"""The fast decision (per-node bounds, per-list columns patched from the written rows, lazy
partial ordering) against a straightforward reference: fit the pod on every candidate's cards,
keep the nodes where it fits, order them by busy, then the node policy's score, ties in the
caller's order. Random clusters (card sizes, cores, slots, health, cordons, usage), random pods
(1-3 containers, 1-8 GPUs, memory or %, 0-100 % cores, binpack or spread, GPU policies), random
candidate lists reused call after call while placements, binds in flight, cordons and
registration changes move the index between calls: the same nodes in the same order with the
same grants, and for a refused pod the same reason for every node."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tessera.scheduler.cards import node_score
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.node_names import NodeNames
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, parse_pod_options

from tessera import hami
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    NodeLedger,
    NodeRegistration,
)
from tessera.settings import TesseraSettings

from .factories import GIB

SETTINGS = TesseraSettings()


def registration(rng: random.Random, name: str, generation: int = 0) -> NodeRegistration:
    memory = rng.choice([16, 40, 80]) * GIB
    devices = [
        DeviceInfo(
            uuid=f"GPU-{name}-{generation}-{i}", index=i,
            type=rng.choice(["NVIDIA-H100", "NVIDIA-A10"]), memory_mib=memory, cores=100,
            split_count=rng.choice([2, 4, 10]), numa=i // 2, healthy=rng.random() > 0.05,
        )
        for i in range(rng.choice([1, 2, 4, 8]))
    ]  # fmt: skip
    return NodeRegistration(node=name, devices=devices)


def pod(rng: random.Random, i: int) -> dict[str, Any]:
    containers = []
    for c in range(rng.choices([1, 2, 3], weights=[80, 15, 5])[0]):
        limits: dict[str, Any] = {"nvidia.com/gpu": rng.choices([1, 2, 4, 8], [60, 25, 10, 5])[0]}
        if rng.random() < 0.3:
            limits["nvidia.com/gpumem-percentage"] = rng.choice([5, 10, 25, 50])
        else:
            limits["nvidia.com/gpumem"] = rng.choice([1, 2, 4, 8, 16, 30]) * GIB
        limits["nvidia.com/gpucores"] = rng.choices([0, 10, 30, 60, 100], [35, 25, 20, 12, 8])[0]
        containers.append({"name": f"c{c}", "resources": {"limits": limits}})
    annotations = {"hami.io/node-scheduler-policy": rng.choice(["binpack", "spread"])}
    if rng.random() < 0.4:
        annotations["hami.io/gpu-scheduler-policy"] = rng.choice(
            ["binpack", "spread", "spread,numa", "topology-aware"]
        )
    if rng.random() < 0.1:
        annotations["nvidia.com/use-gputype"] = "A10"
    uid = f"p{i}"
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": containers}}  # fmt: skip


def reference(index: ClusterIndex, spec: dict[str, Any], names: list[str]) -> tuple[list, dict]:
    """(fitting nodes in order with their grants, reason per refusing node)."""
    request = hami.parse_pod_request(spec, SETTINGS)
    options = parse_pod_options(spec, SETTINGS)
    fitting, failed = [], {}
    for position, name in enumerate(names):
        entry = index.node(name)
        if entry is None:
            continue
        fit = fit_pod(entry.cards, request, FitContext(options))
        if not fit.ok:
            failed[name] = entry.blocked or fit.reason_text()
            continue
        score = node_score(entry.cards)
        key = -score if options.node_policy == "binpack" else score
        fitting.append(((bool(index.busy[entry.slot]), key, position), name, fit.containers))
    fitting.sort(key=lambda f: f[0])
    return [(name, grants) for _key, name, grants in fitting], failed


def place(index: ClusterIndex, name: str, uid: str, grants: list, rng: random.Random) -> None:
    entry = index.entries[name]
    ledger = entry.ledger or NodeLedger(node=name)
    allocations = dict(ledger.allocations)
    allocations[uid] = Allocation(
        pod_uid=uid, namespace="ns", name=uid, node=name, containers=grants,
        state=rng.choice([AllocationState.RESERVED, AllocationState.ALLOCATED]),
        expires_at=1e12,
    )  # fmt: skip
    index.set_ledger(name, NodeLedger(node=name, allocations=allocations),
                     entry.ledger_revision + 1, 0.0)  # fmt: skip


def place_if_it_fits(index: ClusterIndex, spec: dict[str, Any], target: str,
                     rng: random.Random) -> None:
    """Place `spec` on `target` where the decision finds it a fit there (a cluster made busy)."""
    request = hami.parse_pod_request(spec, SETTINGS)
    chosen = next(decide(index, request, parse_pod_options(spec, SETTINGS), [target]).fits(), None)
    if chosen is not None:
        place(index, target, spec["metadata"]["uid"], chosen[1].containers, rng)


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> dict[str, int]:
    """Count the calls of `module.name` from here on (it still runs): {"n": calls so far}."""
    calls = {"n": 0}
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def count_fits(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the decision's calls of fit_pod (one per node it fits): {"n": calls so far}."""
    from tessera.scheduler import decide as decide_module

    return count_calls(monkeypatch, decide_module, "fit_pod")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_decision_is_the_reference_while_the_index_moves(seed: int) -> None:
    decide_against_reference(seed, fresh=False)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_a_new_list_every_call_is_decided_as_the_reference(seed: int) -> None:
    """kube-scheduler's lists change every cycle (its percentageOfNodesToScore window rotates;
    feasibility changes): each call a list not seen before, of every size, walked without a
    kept order (`candidate_order.fresh_walk`), some more than 4 × 128 long so that the
    partition rounds run."""
    decide_against_reference(seed, fresh=True)


def decide_against_reference(seed: int, fresh: bool) -> None:
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"n{seed}-{i:03d}" for i in range(520 if fresh else 130)]
    for name in names:
        index.set_registration(name, registration(rng, name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    # The lists kube-scheduler sends again and again (as the HTTP layer hands them over: one
    # object with a token each), a shuffled one, and one with names of unregistered nodes.
    lists = []
    for token, members in enumerate([names, names[::3], rng.sample(names, 100),
                                      [*names[:40], "ghost-1", "ghost-2"]], start=1):  # fmt: skip
        listed = NodeNames(members)
        listed.token = 1000 * seed + token
        lists.append(listed)
    generation = 0
    for i in range(100):
        spec = pod(rng, i)
        candidates = rng.choice(lists)
        if fresh:  # a rotating window, or the whole list from a rotating start, with ghosts
            start, size = rng.randrange(len(names)), rng.choice([50, 100, 600, len(names)])
            window = [names[(start + k) % len(names)] for k in range(min(size, len(names)))]
            if rng.random() < 0.2:
                window.insert(rng.randrange(len(window) + 1), "ghost-3")
            candidates = NodeNames(window)
            candidates.token = 10**6 * seed + i
        expected, expected_failed = reference(index, spec, candidates)
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        decision = decide(index, request, options, candidates)
        got = [(entry.name, fit.containers) for entry, fit in decision.fits()]
        assert got == expected, f"pod {i}"
        if not expected:
            decision.explain_rest()
            unknown = [n for n in candidates if index.node(n) is None]
            assert {n: r for n, r in decision.failed.items() if n not in unknown} == (
                expected_failed
            )  # fmt: skip
            assert all(decision.failed[n].startswith("NodeUnregistered") for n in unknown)
        else:
            name, grants = expected[0]
            place(index, name, spec["metadata"]["uid"], grants, rng)
        # Between calls the index moves as the watches and the filters move it.
        roll = rng.random()
        target = rng.choice(names)
        if roll < 0.25:
            index.mark_busy(index.entries[target].slot)  # a bind in flight there
        elif roll < 0.3:
            cards = index.entries[target].cards
            index.set_cordon(target, frozenset(c.uuid for c in cards[:1]), 0.0)
        elif roll < 0.33:
            generation += 1  # new cards: what was held there is on GPUs gone
            index.set_registration(target, registration(rng, target, generation), 0.0)
        elif roll < 0.4:
            index.refresh(target, 0.0)  # a sweep: the busy flag follows the ledger again
        if i % 2:  # the service's loop after a call: kept orders merged if due (or not: later)
            index.tidy_orders()


def test_many_candidates_full_at_the_top() -> None:
    """Binpack's fullest nodes first and most of them full for the pod: the growing selections
    (64, then 4× more, ...) must still walk the candidates in exactly the reference order."""
    rng = random.Random(9)
    index = ClusterIndex()
    names = [f"f{i:04d}" for i in range(700)]
    for n, name in enumerate(names):
        devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type="NVIDIA-H100",
                              memory_mib=80 * GIB, cores=100, split_count=10)
                   for i in range(2)]  # fmt: skip
        index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
        used = 100 if n % 7 else rng.choice([10, 40, 70])  # 6 of 7 nodes full on cores
        allocations = {
            f"{d.uuid}-p": Allocation(
                pod_uid=f"{d.uuid}-p", namespace="ns", name=f"{d.uuid}-p", node=name,
                containers=[[{"uuid": d.uuid, "type": d.type, "memory_mib": (n % 50) * GIB,
                              "cores": used}]],
                state=AllocationState.ALLOCATED,
            )
            for d in devices
        }  # fmt: skip
        index.set_ledger(name, NodeLedger(node=name, allocations=allocations), 1, 0.0)
    listed = NodeNames(names)
    listed.token = 77
    for i in range(20):
        spec = pod(rng, i)
        spec["metadata"]["annotations"]["hami.io/node-scheduler-policy"] = "binpack"
        expected, _failed = reference(index, spec, listed)
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        got = [(e.name, f.containers) for e, f in decide(index, request, options, listed).fits()]
        assert got == expected
        if expected:
            place(index, expected[0][0], spec["metadata"]["uid"], expected[0][1], rng)


def test_a_refused_pod_retried_gets_exact_reasons_fitting_only_changed_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kube-scheduler retries an unschedulable pod with backoff, and each retry asks for every
    node's reason. A retry refits only the nodes whose cards changed since; the reasons are the
    reference's every time, a freed node's included."""
    rng = random.Random(4)
    index = ClusterIndex()
    names = [f"r{i:03d}" for i in range(60)]
    for name in names:
        index.set_registration(name, registration(rng, name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    listed = NodeNames(names)
    listed.token = 4242
    spec = pod(rng, 0)
    spec["spec"]["containers"] = [{"name": "big", "resources": {"limits": {
        "nvidia.com/gpu": 8, "nvidia.com/gpumem": 90 * GIB, "nvidia.com/gpucores": 100}}}]
    fits = count_fits(monkeypatch)
    request = hami.parse_pod_request(spec, SETTINGS)
    options = parse_pod_options(spec, SETTINGS)
    for attempt in range(4):
        expected, expected_failed = reference(index, spec, listed)
        assert expected == []  # no card here has 90 GiB
        fits["n"] = 0
        decision = decide(index, request, options, listed)
        assert list(decision.fits()) == []
        decision.explain_rest()
        assert decision.failed == expected_failed, f"attempt {attempt}"
        if attempt == 0:  # nodes whose cards fail alike share one fit (`refusal_shapes`)
            assert 0 < fits["n"] <= len(names) // 2
        else:
            assert fits["n"] <= 2, f"attempt {attempt}: {fits['n']} nodes refitted"
        # Between retries one node changes: its reason must be found anew.
        target = names[attempt * 7]
        place(index, target, f"other-{attempt}", [[{
            "uuid": index.entries[target].cards[0].uuid, "type": "NVIDIA-H100",
            "memory_mib": GIB, "cores": 10}]], rng)  # fmt: skip


def two_card_node(index: ClusterIndex, name: str, free_gib: tuple[int, ...], healthy: bool = True,
                  memory_gib: int = 80) -> None:  # fmt: skip
    """A node whose cards have `free_gib` free (the rest held by one allocated pod each); the
    last card unhealthy unless `healthy`."""
    devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type="NVIDIA-H100",
                          memory_mib=memory_gib * GIB, cores=100, split_count=10,
                          healthy=healthy or i < len(free_gib) - 1)
               for i in range(len(free_gib))]  # fmt: skip
    index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
    allocations = {
        f"{d.uuid}-p": Allocation(
            pod_uid=f"{d.uuid}-p", namespace="ns", name=f"{d.uuid}-p", node=name,
            containers=[[{"uuid": d.uuid, "type": d.type,
                          "memory_mib": (memory_gib - free) * GIB, "cores": 10}]],
            state=AllocationState.ALLOCATED,
        )
        for d, free in zip(devices, free_gib, strict=True) if free < memory_gib
    }  # fmt: skip
    index.set_ledger(name, NodeLedger(node=name, allocations=allocations), 1, 0.0)


def two_containers(first_gib: int, second_gib: int, gpu_policy: str, uid: str) -> dict[str, Any]:
    containers = [
        {"name": f"c{i}", "resources": {"limits": {"nvidia.com/gpu": 1,
                                                   "nvidia.com/gpumem": gib * GIB}}}
        for i, gib in enumerate((first_gib, second_gib))
    ]  # fmt: skip
    annotations = {"hami.io/gpu-scheduler-policy": gpu_policy,
                   "hami.io/node-scheduler-policy": "binpack"}  # fmt: skip
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": containers}}  # fmt: skip


def test_two_container_pods_pruned_only_where_they_cannot_fit_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each container alone fits every node, together only some: the joint bound rules out the
    nodes where the pod's grants cannot be held at once (a single usable card with room for one
    container), and never a node where the fit (greedy, by GPU policy) succeeds: a node whose
    containers fit only on particular cards (the fuller card first, binpack) or both on one
    card. A pod that fits nowhere gets every node's exact reason."""
    index = ClusterIndex()
    names = []
    for i in range(60):  # one usable card with 30 GiB: each container alone, never both
        names.append(f"one-{i:02d}")
        two_card_node(index, names[-1], (30, 70), healthy=False)
    names.append("shared")  # one usable card with room for both containers on it
    two_card_node(index, "shared", (50, 70), healthy=False)
    names.append("particular")  # 25 and 60 GiB free: 20 + 50 fits only as 20 -> 25, 50 -> 60
    two_card_node(index, "particular", (25, 60))
    listed = NodeNames(names)
    listed.token = 5151
    fits = count_fits(monkeypatch)
    for uid, spec, fitting in (
        ("both-on-one", two_containers(20, 20, "spread", "p1"), ["shared", "particular"]),
        ("particular-cards", two_containers(20, 50, "binpack", "p2"), ["particular"]),
        ("greedy-misses", two_containers(20, 50, "spread", "p3"), []),  # spread takes 60 first
        ("nowhere", two_containers(40, 40, "binpack", "p4"), []),
    ):
        expected, expected_failed = reference(index, spec, listed)
        assert sorted(name for name, _grants in expected) == sorted(fitting), uid
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        fits["n"] = 0
        decision = decide(index, request, options, listed)
        got = [(entry.name, fit.containers) for entry, fit in decision.fits()]
        assert got == expected, uid
        assert fits["n"] <= len(fitting) + 2, f"{uid}: {fits['n']} nodes fitted"  # pruned
        if not expected:
            decision.explain_rest()
            assert decision.failed == expected_failed, uid


def test_a_percentage_at_the_rounding_boundary_is_not_pruned() -> None:
    """1 % of an 80 GiB card is 819 MiB (819.2 rounded down, as the fit charges it): a card
    with exactly 819 MiB free takes it, and the index must not rule the node out."""
    index = ClusterIndex()
    device = DeviceInfo(uuid="GPU-edge-0", index=0, type="NVIDIA-H100", memory_mib=80 * GIB,
                        cores=100, split_count=10)  # fmt: skip
    index.set_registration("edge", NodeRegistration(node="edge", devices=[device]), 0.0)
    held = Allocation(pod_uid="held", namespace="ns", name="held", node="edge",
                      containers=[[{"uuid": device.uuid, "type": device.type,
                                    "memory_mib": 80 * GIB - 819, "cores": 10}]],
                      state=AllocationState.ALLOCATED)  # fmt: skip
    index.set_ledger("edge", NodeLedger(node="edge", allocations={"held": held}), 1, 0.0)
    listed = NodeNames(["edge"])
    listed.token = 819
    for percentage, fits in ((1, True), (2, False)):
        spec = {"metadata": {"name": "p", "namespace": "ns", "uid": f"p{percentage}"},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {
                    "nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": percentage}}}]}}
        expected, _failed = reference(index, spec, listed)
        assert bool(expected) is fits
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        got = [(e.name, f.containers) for e, f in decide(index, request, options, listed).fits()]
        assert got == expected


def test_pod_options_are_remembered_and_refusals_are_not() -> None:
    spec = pod(random.Random(1), 0)
    spec["metadata"]["annotations"]["hami.io/gpu-scheduler-policy"] = "binpack,numa"
    first, again = parse_pod_options(spec, SETTINGS), parse_pod_options(spec, SETTINGS)
    assert first == again and first.gpu_policies == ("binpack", "numa")
    spec["metadata"]["annotations"]["hami.io/gpu-scheduler-policy"] = "fastest"
    for _ in range(2):  # refused every time, with its sentence
        with pytest.raises(hami.RequestError, match="unknown policy 'fastest'"):
            parse_pod_options(spec, SETTINGS)
    spec["metadata"]["annotations"]["hami.io/gpu-scheduler-policy"] = ["binpack"]
    with pytest.raises(hami.RequestError, match="must be a string"):
        parse_pod_options(spec, SETTINGS)
    spec["metadata"]["annotations"].pop("hami.io/gpu-scheduler-policy")
    spec["spec"]["initContainers"] = [{"name": "side", "restartPolicy": "Always"}]
    assert parse_pod_options(spec, SETTINGS).sidecar_init == (True,)


def test_refusals_of_one_workload_are_remembered_until_the_node_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pods of one shape (a workload's replicas) with two containers that the per-card bounds
    let through on nodes where the per-GPU fit refuses them (spread puts the first container on
    the card the second one needed): the next replica is not fitted again on the nodes the last
    one was refused on, until such a node changes; decisions and reasons stay the reference's,
    a node that changed into one that fits included."""
    index = ClusterIndex()
    traps = [f"trap{i:02d}" for i in range(30)]
    good = [f"good{i:02d}" for i in range(10)]
    for name in traps:  # fuller: binpack tries them first; the summaries let the pod through
        two_card_node(index, name, (35, 20))
    for name in good:
        two_card_node(index, name, (60, 60))
    listed = NodeNames([*traps, *good])
    listed.token = 5151
    only_traps = NodeNames(traps)
    only_traps.token = 5152
    fits = count_fits(monkeypatch)
    rng = random.Random(5)

    def replica(i: int) -> dict[str, Any]:
        containers = [
            {"name": "a", "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem":
                                                   10 * GIB, "nvidia.com/gpucores": 10}}},
            {"name": "b", "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem":
                                                   30 * GIB, "nvidia.com/gpucores": 10}}},
        ]  # fmt: skip
        return {"metadata": {"name": f"w{i}", "namespace": "ns", "uid": f"w{i}",
                             "annotations": {}}, "spec": {"containers": containers}}  # fmt: skip

    def decide_all(spec: dict[str, Any], names: NodeNames) -> tuple[list, Any]:
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        fits["n"] = 0
        decision = decide(index, request, options, names)
        got = [(entry.name, fit.containers) for entry, fit in decision.fits()]
        expected, expected_failed = reference(index, spec, names)
        assert got == expected
        refused = {n: r for n, r in decision.failed.items() if n in expected_failed}
        assert refused == {n: expected_failed[n] for n in refused}
        return got, decision

    got, _ = decide_all(replica(0), listed)
    # every good node fits; the traps refused at most once each (fewer: nodes that refuse
    # the second container alike are read by their shape, `refusal_shapes.PodSteps`)
    assert len(good) < fits["n"] <= len(traps) + len(good)
    assert {name for name, _grants in got} == set(good)
    place(index, got[0][0], "w0", got[0][1], rng)
    got, _ = decide_all(replica(1), listed)
    assert fits["n"] == len(good)  # the traps are not fitted again
    # One trap changes (a small pod lands there): it is fitted again, and still refuses.
    entry = index.entries[traps[3]]
    place(index, traps[3], "small", [[{"uuid": entry.cards[1].uuid, "type": "NVIDIA-H100",
                                       "memory_mib": GIB, "cores": 1}]], rng)  # fmt: skip
    got, _ = decide_all(replica(2), listed)
    assert fits["n"] == len(good) + 1
    # Another trap is freed so that the pod fits there: found.
    entry = index.entries[traps[7]]
    freed = dict(entry.ledger.allocations)  # type: ignore[union-attr]
    uuid = entry.cards[1].uuid
    freed[f"{uuid}-p"] = freed[f"{uuid}-p"].model_copy(update={"containers": [[DeviceGrant(
        uuid=uuid, type="NVIDIA-H100", memory_mib=45 * GIB, cores=10)]]})
    index.set_ledger(traps[7], NodeLedger(node=traps[7], allocations=freed),
                     entry.ledger_revision + 1, 0.0)  # fmt: skip
    got, _ = decide_all(replica(3), listed)
    placed = dict(got)
    assert traps[7] in placed
    assert fits["n"] == len(good) + 1
    # A refused replica (only traps listed): every node's reason is the reference's, from the
    # remembered refusals (nothing fitted again except the node that changed).
    place(index, traps[7], "w3", placed[traps[7]], rng)
    spec = replica(4)
    got, decision = decide_all(spec, only_traps)
    assert got == []
    decision.explain_rest()
    assert decision.failed == reference(index, spec, only_traps)[1]
    assert fits["n"] <= 2  # (and its first container alone on its new shape: it takes it)
