"""A candidate list's kept policy order is merged anew once more than `PolicyOrder.REBUILD` of
its positions changed (~0.2 ms at 5,000 candidates): between calls, never inside a decision
(the decision's p99 at 5,000 nodes was those merges), while the placements stay the reference's.
The pure index as the benchmark drives it (`tidy_orders` after each call), and the service,
whose filter call schedules the merges once its decision has answered."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from tessera.scheduler import filtering
from tessera.scheduler.candidate_order import PolicyOrder
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.node_names import NodeNames
from tessera.scheduler.rules import parse_pod_options

from tessera import hami
from tessera.cluster.memory import InMemoryCluster
from tessera.models import NodeLedger

from .conftest import MakeService, register, unique, wait_until
from .factories import GIB, container, node
from .factories import pod as make_pod
from .test_decision_reference import SETTINGS, place, pod, reference, registration


class Merges:
    """Every merge of a kept order, noted as inside a decision or not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
        self.inside: list[bool] = []
        self._deciding = False
        real_merge, real_decide = PolicyOrder._merge, module.decide

        def merge(order: PolicyOrder, scores: np.ndarray) -> None:
            self.inside.append(self._deciding)
            real_merge(order, scores)

        def deciding(*args: Any, **kwargs: Any) -> Any:
            self._deciding = True
            try:
                return real_decide(*args, **kwargs)
            finally:
                self._deciding = False

        monkeypatch.setattr(PolicyOrder, "_merge", merge)
        monkeypatch.setattr(module, "decide", deciding)

    def __iter__(self) -> Iterator[bool]:
        return iter(self.inside)


def test_a_decision_leaves_the_merge_to_between_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spread places each pod on another node: every call changes one more position of the
    list's order. Past `REBUILD` changed positions the decision still walks them merged in on the
    fly and `tidy_orders` (between calls) merges them; every placement is the reference's."""
    merges = Merges(monkeypatch, sys.modules[__name__])  # (the `decide` called below)
    rng = random.Random(21)
    index = ClusterIndex()
    names = [f"m{i:03d}" for i in range(160)]
    for name in names:
        index.set_registration(name, registration(rng, name), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    listed = NodeNames(names)
    listed.token = 2121
    # kube-scheduler sent this list before: it is kept with its orders (a list seen once is
    # walked without any: `candidate_order.fresh_walk`)
    index.resolve(listed)
    deepest = 0
    for i in range(3 * PolicyOrder.REBUILD):
        spec = pod(rng, i)
        spec["metadata"]["annotations"]["hami.io/node-scheduler-policy"] = "spread"
        expected, _failed = reference(index, spec, listed)
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        got = [(e.name, f.containers) for e, f in decide(index, request, options, listed).fits()]
        assert got == expected, f"pod {i}"
        # (its kept order is built between calls once it was seen again: from the 2nd call)
        kept = index._column_cache.kept.get(id(index.resolve(listed)[0]))
        if i:
            deepest = max(deepest, len(kept.orders["spread"].dirty_list))
        if expected:
            place(index, expected[0][0], spec["metadata"]["uid"], expected[0][1], rng)
        index.tidy_orders()  # what the service's loop runs once the call has answered
    assert deepest > PolicyOrder.REBUILD  # a decision did see more than REBUILD changed
    assert list(merges) and not any(merges), list(merges)  # merged, never inside a decision


async def test_the_service_merges_after_the_decision_answered(
    make_service: MakeService, cluster: InMemoryCluster, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The filter call schedules `tidy_orders` on its loop once its decision has answered: a
    burst of placements (spread: each on another node) merges the list's kept order, and never
    inside a decision."""
    merges = Merges(monkeypatch, filtering)
    service = await make_service()
    prefix = unique("merge")
    names = [f"{prefix}-{i:03d}" for i in range(PolicyOrder.REBUILD + 16)]
    for name in names:
        await register(service.buckets, node(name, gpus=1, memory_mib=10 * GIB))
    await wait_until(lambda: all(service.index.node(name) is not None for name in names))
    spread = {"hami.io/node-scheduler-policy": "spread"}
    placed = []
    for _ in range(len(names)):
        spec = cluster.add_pod(make_pod(container(mem=GIB), annotations=spread))
        outcome = await service.scheduler.filter(spec, names)
        assert outcome.nodenames is not None
        placed.extend(outcome.nodenames)
    assert sorted(placed) == sorted(names)  # spread: one pod on each node
    assert list(merges) and not any(merges), list(merges)
