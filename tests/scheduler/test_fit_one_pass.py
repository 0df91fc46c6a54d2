"""A one-card container under one ordering policy is fitted in one pass over the node's cards
(`placement._pick_in_one_pass`: the plain checks and HAMi's device score inlined, the least key
taken), and a request's checks and sort key are worked out once for node after node: the card
taken, and for a refusal every reason in the order it was met, must be exactly those of checking
every card with every check and sorting the ones that pass by `device_score` (the policy's
score, then the card index), whatever the node's cards and the request before it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from tessera.scheduler import placement
from tessera.scheduler.cards import Card
from tessera.scheduler.placement import device_score, fit_pod, pick_cards
from tessera.scheduler.rules import FitContext, PodOptions, QuotaBudget, card_refusal

from tessera.hami import ContainerRequest, PodRequest

from .factories import GIB

POLICIES = [("spread",), ("binpack",), ("binpack", "spread"), ("spread", "mutex"),
            ("mutex",), ("binpack", "numa")]  # fmt: skip
MODES = ["hami-core"] * 6 + ["mps", "mig", "smlu"]


def cards(rng: random.Random) -> list[Card]:
    out = []
    indices = rng.sample(range(8), 8) if rng.random() < 0.3 else list(range(8))
    same = rng.random() < 0.3  # (cards alike: the score ties, the card index decides)
    for i in range(8):
        memory = rng.choice([16 * GIB, 80 * GIB]) if not same else 80 * GIB
        cores = rng.choice([100, 100, 0])
        out.append(Card(
            uuid=f"GPU-{i}", index=indices[i], type="NVIDIA-H100", mode=rng.choice(MODES),
            numa=0, healthy=rng.random() > 0.05, cordoned=rng.random() < 0.05,
            memory_mib=memory, cores=cores if not same else 100,
            split_count=rng.choice([2, 10, 0]) if not same else 10,
            used_mem=rng.randint(0, memory // GIB) * GIB if not same else 8 * GIB,
            used_cores=rng.choice([0, 10, 50, 100]) if not same else 10,
            used_slots=rng.randint(0, 3) if not same else 1,
        ))  # fmt: skip
    return out


def request(rng: random.Random) -> ContainerRequest:
    pct = rng.choice([None, None, None, 10, 25, 100])
    return ContainerRequest(
        count=rng.choice([1, 1, 1, 1, 2]), memory_mib=0 if pct else rng.randint(0, 24) * GIB,
        memory_percentage=pct, cores=rng.choice([0, 0, 10, 30, 100]),
    )  # fmt: skip


def reference(
    node: list[Card], one: ContainerRequest, ctx: FitContext
) -> tuple[Card | None, list[tuple[str, int]]]:
    """Every check on every card; the passing cards sorted by the policies' device scores."""
    passing, local = [], Counter[str]()
    for card in node:
        reason = card_refusal(card, one, ctx)
        if reason is None:
            passing.append(card)
        else:
            local[reason] += 1
    if not passing:
        return None, list(local.items())
    signs = [-1.0 if p == "binpack" else 1.0 for p in ctx.options.gpu_policies
             if p in ("binpack", "spread")]  # fmt: skip
    scores = {id(c): device_score(c, one, ctx.options.weights) for c in passing}
    return min(passing, key=lambda c: (*(s * scores[id(c)] for s in signs), c.index)), []


def test_the_card_and_the_reasons_are_those_of_every_check_and_the_sorted_order() -> None:
    rng = random.Random(19)
    taken = refused = one_pass = 0
    for _ in range(6000):
        node = cards(rng)
        one = request(rng)
        if one.count != 1:
            continue
        options = PodOptions(gpu_policies=rng.choice(POLICIES),
                             weights=rng.choice([(1, 1, 1), (0, 1, 2), (3, 0, 0), (0, 0, 0)]))
        quota = QuotaBudget(rng.choice([None, None, 4 * GIB]), rng.choice([None, None, 20]))
        ctx = FitContext(options, quota)
        expected, reasons = reference(node, one, ctx)
        got = Counter[str]()
        picked = pick_cards(node, one, ctx, got)
        one_pass += placement._plan(one, ctx).one_pass is not None
        if "numa" in options.gpu_policies:
            continue  # (selects among the ordered cards: not compared here)
        if expected is None:
            assert picked is None and list(got.items()) == reasons
            refused += 1
        else:
            assert picked is not None and picked[0] is expected and not got
            taken += 1
    assert taken > 700 and refused > 1000 and one_pass > 500, (taken, refused, one_pass)


def afresh(request: ContainerRequest, ctx: FitContext) -> placement._Plan:
    quota = ctx.quota
    return placement._Plan(request, ctx, (quota.memory_mib is None) + 2 * (quota.cores is None))


def test_a_pod_fitted_node_after_node_gets_what_a_fresh_request_gets() -> None:
    """The request's worked-out checks and key are kept for the next node: a pod fitted on many
    nodes in a row, between other pods, must get on each exactly what an equal but new request
    object gets (nothing of one node or one request carries over to another)."""
    rng = random.Random(20)
    nodes = [cards(rng) for _ in range(40)]
    pods = [PodRequest(containers=[request(rng) for _ in range(rng.choice([1, 1, 2]))])
            for _ in range(30)]  # fmt: skip
    shared = [PodOptions(gpu_policies=policies) for policies in POLICIES]
    for _ in range(400):
        pod = rng.choice(pods)
        options = rng.choice(shared)
        fitted = []
        for node in rng.sample(nodes, 5):  # (one after the other, as a decision's walk does)
            budget = QuotaBudget(rng.choice([None, 1 * GIB, 8 * GIB]), rng.choice([None, 10]))
            fit = fit_pod(node, pod, FitContext(options, QuotaBudget(budget.memory_mib,
                                                                     budget.cores)))
            fitted.append((node, budget, fit))
        for node, budget, fit in fitted:
            twin = PodRequest(containers=[None if r is None else ContainerRequest(
                r.count, r.memory_mib, r.memory_percentage, r.cores) for r in pod.containers])
            with pytest.MonkeyPatch.context() as mp:  # (worked out afresh for every container)
                mp.setattr(placement, "_plan", afresh)
                fresh = fit_pod(node, twin, FitContext(
                    PodOptions(gpu_policies=options.gpu_policies), budget))
            assert (fit.ok, fit.containers, list(fit.reasons.items())) == (
                fresh.ok, fresh.containers, list(fresh.reasons.items()))
