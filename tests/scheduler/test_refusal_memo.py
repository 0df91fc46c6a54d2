"""A refused pod's reasons (every candidate's HAMi `N/M Reason`) come from the refusal memo
(`refusal_memo.py`) for the nodes whose rows did not change since the request was last refused,
and from a fresh fit for the others: the same texts and counts as fitting every node, while
several pending requests take turns (kube-scheduler's backoff retries), placements and cordons
move nodes in between, and a retry fits again only the nodes that changed."""

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
from tessera.models import NodeLedger
from tessera.settings import TesseraSettings

from .factories import GIB
from .test_decision_reference import count_fits, place, pod, registration

SETTINGS = TesseraSettings()


def unfit(shape: int) -> dict[str, Any]:
    limits: list[dict[str, Any]] = [
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 90 * GIB},  # more than any card has
        {"nvidia.com/gpu": 9, "nvidia.com/gpumem": GIB},  # more cards than any node
        {"nvidia.com/gpu": 2, "nvidia.com/gpumem": GIB},  # a type no node has (below)
    ]
    uid = f"pending-{shape}"
    annotations = {"nvidia.com/use-gputype": "B200"} if shape == 2 else {}
    container = {"name": "c", "resources": {"limits": limits[shape]}}
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"containers": [container]}}  # fmt: skip


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


@pytest.mark.parametrize("seed", [1, 2])
def test_retried_refusals_are_exact_and_refit_only_changed_nodes(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"r{seed}-{i:03d}" for i in range(300)]
    for name in names:
        index.set_registration(name, registration(rng, name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    fits = count_fits(monkeypatch)
    # per request: nodes changed since it was last refused there
    changed_since: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
    seen: dict[int, set[str]] = {}  # per request: nodes it was refused on so far
    for i in range(40):
        shape = i % 3
        spec = unfit(shape)
        window = NodeNames(rng.sample(names, rng.choice([100, 300])))
        window.token = 10**5 * seed + i
        want, want_counts = expected(index, spec, window)
        before = fits["n"]
        request = hami.parse_pod_request(spec, SETTINGS)
        decision = decide(index, request, parse_pod_options(spec, SETTINGS), window)
        assert next(decision.fits(), None) is None
        decision.explain_rest()
        assert decision.failed == want, f"call {i}"
        assert decision.reason_counts == want_counts, f"call {i}"
        # fitted: at most those this request never met and the nodes changed since (a write
        # may leave a row as it was: `ClusterIndex._kept_row`); nodes of one shape are fitted
        # once (`refusal_shapes`: test_refusal_shapes.py), so maybe fewer
        fresh = set(window) - seen.get(shape, set())
        refitted = fits["n"] - before
        assert refitted <= len((changed_since[shape] & set(window)) | fresh)

        seen[shape] = seen.get(shape, set()) | set(window)
        changed_since[shape] = changed_since.get(shape, set()) - set(window)
        # Between retries other pods are placed and nodes change.
        for _ in range(rng.randint(0, 6)):
            spec = pod(rng, 1000 * i + _)
            request = hami.parse_pod_request(spec, SETTINGS)
            target = rng.choice(names)
            placed = decide(index, request, parse_pod_options(spec, SETTINGS), [target])
            chosen = next(placed.fits(), None)
            if chosen is not None:
                place(index, target, spec["metadata"]["uid"], chosen[1].containers, rng)
                for changes in changed_since.values():
                    changes.add(target)
        if rng.random() < 0.3:
            target = rng.choice(names)
            index.set_cordon(target, frozenset(c.uuid for c in index.entries[target].cards[:1]),
                             0.0)  # fmt: skip
            for changes in changed_since.values():
                changes.add(target)
