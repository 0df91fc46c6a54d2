"""A container of several cards under one ordering policy, with no NUMA nor topology selection,
is fitted in one pass over the node's cards (`placement._pick_in_one_pass`: the plain checks and
HAMi's device score inlined, the passing cards sorted once): the cards taken, in the order
taken, and for a refusal every reason in the order it was met (CardInsufficient for the cards
that passed when too few did), must be exactly those of checking every card with every check
and sorting the ones that pass by `device_score` (the policy's score, then the card index,
then the card's place on the node), whatever the node's cards."""

from __future__ import annotations

import random
from collections import Counter

from tessera.scheduler import placement
from tessera.scheduler.cards import Card
from tessera.scheduler.placement import device_score, fit_pod, pick_cards
from tessera.scheduler.rules import (
    CARDS_INSUFFICIENT,
    FitContext,
    PodOptions,
    QuotaBudget,
    card_refusal,
)

from tessera.hami import ContainerRequest, PodRequest

from .factories import GIB
from .test_fit_one_pass import cards

POLICIES = [("spread",), ("binpack",), ("binpack", "spread"), ("spread", "mutex"),
            ("mutex",), ("binpack", "numa"), ("spread", "topology-aware")]  # fmt: skip


def request(rng: random.Random) -> ContainerRequest:
    pct = rng.choice([None, None, None, 10, 25, 100])
    return ContainerRequest(
        count=rng.choice([2, 2, 3, 4, 8]), memory_mib=0 if pct else rng.randint(0, 24) * GIB,
        memory_percentage=pct, cores=rng.choice([0, 0, 10, 30, 100]),
    )  # fmt: skip


def reference(
    node: list[Card], many: ContainerRequest, ctx: FitContext
) -> tuple[list[Card] | None, list[tuple[str, int]]]:
    """Every check on every card; the passing cards sorted by the policies' device scores."""
    passing, local = [], Counter[str]()
    for card in node:
        reason = card_refusal(card, many, ctx)
        if reason is None:
            passing.append(card)
        else:
            local[reason] += 1
    if len(passing) < many.count:
        if passing:
            local[CARDS_INSUFFICIENT] += len(passing)
        return None, list(local.items())
    signs = [-1.0 if p == "binpack" else 1.0 for p in ctx.options.gpu_policies
             if p in ("binpack", "spread")]  # fmt: skip
    score = {id(c): device_score(c, many, ctx.options.weights) for c in passing}
    ordered = sorted(passing, key=lambda c: (*(s * score[id(c)] for s in signs), c.index))
    return ordered[: many.count], []


def test_the_cards_and_the_reasons_are_those_of_every_check_and_the_sorted_order() -> None:
    rng = random.Random(35)
    taken = refused = sorted_pass = 0
    for _ in range(12000):
        node = cards(rng)
        many = request(rng)
        options = PodOptions(gpu_policies=rng.choice(POLICIES),
                             weights=rng.choice([(1, 1, 1), (0, 1, 2), (3, 0, 0), (0, 0, 0)]))
        quota = QuotaBudget(rng.choice([None, None, 4 * GIB]), rng.choice([None, None, 20]))
        ctx = FitContext(options, quota)
        expected, reasons = reference(node, many, ctx)
        got = Counter[str]()
        picked = pick_cards(node, many, ctx, got)
        one = placement._plan(many, ctx).sorted_pass is not None
        sorted_pass += one
        if not one:
            continue  # (selects among the ordered cards, or not plain: not compared here)
        if expected is None:
            assert picked is None and list(got.items()) == reasons
            refused += 1
        else:
            assert picked is not None and not got
            assert [id(c) for c in picked] == [id(c) for c in expected]
            taken += 1
    assert taken > 250 and refused > 1000 and sorted_pass > 1400, (taken, refused, sorted_pass)


def test_equal_keys_keep_the_cards_order() -> None:
    """Cards alike with the same index (a registration may repeat one): the first on the node
    is taken first, as a stable sort keeps them."""
    node = [Card(uuid=f"GPU-{i}", index=0, type="NVIDIA-H100", mode="hami-core", numa=0,
                 healthy=True, cordoned=False, memory_mib=80 * GIB, cores=100, split_count=10)
            for i in range(4)]  # fmt: skip
    three = ContainerRequest(count=3, memory_mib=GIB, memory_percentage=None, cores=10)
    pod = PodRequest(containers=[three])
    for policy in ("spread", "binpack"):
        fit = fit_pod(node, pod, FitContext(PodOptions(gpu_policies=(policy,)), QuotaBudget()))
        assert fit.ok and [g.uuid for g in fit.containers[0]] == ["GPU-0", "GPU-1", "GPU-2"]
