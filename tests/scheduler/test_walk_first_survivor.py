"""The walk fits its first survivor on its own before it groups the candidates by shape
(`decide.Decision.fits`): a pod that fits there is placed without any grouping (an 8-GPU binpack
pod whose first chunk brought ~100 survivors paid 0.15-0.35 ms for it, bench/RESULTS.md
"fresh2"); a pod refused there has that node worded one by one and the rest read per shape,
with the same placement and the same reason for every node walked as fitting each node."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tessera.scheduler import decide as decide_module
from tessera.scheduler.cards import node_score
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.node_names import NodeNames
from tessera.scheduler.rules import parse_pod_options

from tessera import hami
from tessera.models import DeviceGrant, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB
from .test_decision_reference import count_calls, count_fits, place, reference

SETTINGS = TesseraSettings()


def node(name: str, kind: str) -> NodeRegistration:
    devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type=kind, memory_mib=80 * GIB,
                          cores=100, split_count=4)
               for i in range(8)]  # fmt: skip
    return NodeRegistration(node=name, devices=devices)


def use(index: ClusterIndex, name: str, kind: str, memory: list[int], rng: random.Random) -> None:
    """One pod per card holding `memory[i]` GiB of card i (none where 0)."""
    grants = [[DeviceGrant(uuid=f"GPU-{name}-{i}", type=kind, memory_mib=mib * GIB, cores=0)]
              for i, mib in enumerate(memory) if mib]  # fmt: skip
    if grants:
        place(index, name, f"base-{name}", grants, rng)


def pod(gpus: int, memory_gib: int, gpu_type: str | None = None) -> dict[str, Any]:
    annotations = {"hami.io/node-scheduler-policy": "binpack"}
    if gpu_type:
        annotations["nvidia.com/use-gputype"] = gpu_type
    limits = {"nvidia.com/gpu": gpus, "nvidia.com/gpumem": memory_gib * GIB}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "p", "annotations": annotations},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}  # fmt: skip


def walk_key(index: ClusterIndex, listed: list[str], name: str) -> tuple[bool, int, int]:
    """Where binpack's walk meets a node: not busy first, the fullest first, then list order."""
    entry = index.node(name)
    assert entry is not None
    return bool(index.busy[entry.slot]), -node_score(entry.cards), listed.index(name)


def count_groupings(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    return count_calls(monkeypatch, decide_module, "group")


@pytest.mark.parametrize("listed", [200, 1500])  # (numpy's walk; C's from 1,024 candidates)
def test_a_pod_that_fits_its_first_survivor_is_placed_without_grouping(
    listed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Binpack's first nodes (the fullest) pass the per-node bounds but not the per-card
    # summaries (one card's memory full: 7 cards hold 12 GiB): the head's checks find no
    # survivor, the next chunk brings many at once, and the first of them fits.
    rng = random.Random(listed)
    index = ClusterIndex()
    names = [f"n{listed}-{i:04d}" for i in range(listed)]
    for i, name in enumerate(names):
        index.set_registration(name, node(name, "NVIDIA-H100"), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
        use(index, name, "NVIDIA-H100", [80 if i < 40 else 0] + [1] * 7, rng)
    listed_names = NodeNames(rng.sample(names, len(names)))
    listed_names.token = listed
    spec = pod(8, 12)
    want, _failed = reference(index, spec, listed_names)
    groupings, fits = count_groupings(monkeypatch), count_fits(monkeypatch)
    request = hami.parse_pod_request(spec, SETTINGS)
    decision = decide(index, request, parse_pod_options(spec, SETTINGS), listed_names)
    entry, fit = next(decision.fits())
    assert (entry.name, fit.containers) == want[0]
    assert decision.failed == {}
    assert (groupings["n"], fits["n"]) == (0, 1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_first_survivor_refused_then_shapes_words_every_node_walked_exactly(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # H100 nodes fuller than the A10 ones (binpack walks them first), in a few usages (shapes):
    # they pass the summaries and the fit refuses them (the pod asks for an A10); the first
    # is fitted on its own, the others read per shape until the first A10 node fits.
    rng = random.Random(seed)
    index = ClusterIndex()
    names = []
    for i in range(rng.choice([120, 1200])):
        kind = "NVIDIA-H100" if i % 2 else "NVIDIA-A10"
        name = f"m{seed}-{i:04d}"
        names.append(name)
        index.set_registration(name, node(name, kind), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
        fuller = rng.choice([20, 30, 40]) if kind == "NVIDIA-H100" else 1
        use(index, name, kind, [fuller] * 8, rng)
    listed = NodeNames(rng.sample(names, len(names)))
    listed.token = seed
    fits = count_fits(monkeypatch)
    for call in range(3):  # (the next calls: the shapes and the refused rows remembered)
        spec = pod(rng.choice([1, 2, 8]), 8, "A10")
        want, failed = reference(index, spec, listed)
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), listed)
        before = fits["n"]
        entry, fit = next(decision.fits())
        assert (entry.name, fit.containers) == want[0]
        walked = {name: failed[name] for name in failed
                  if walk_key(index, listed, name) < walk_key(index, listed, entry.name)}
        assert decision.failed == walked, f"call {call}"
        # the walk's head (8 candidates, fitted one by one), one per shape met after it (3 H100
        # usages, the A10 that fits) and the walk's fit of that A10 node: not one per H100 node
        assert fits["n"] - before <= 13, f"call {call}: {fits['n'] - before} fits"
