"""`rules.plain_card` clears a card for the usual checks in one call; it must never clear a card
one of those checks refuses (and should clear every card they all pass, but for dynamic MIG
cards, which it leaves to the checks)."""

from __future__ import annotations

import random

import pytest
from tessera.scheduler import placement
from tessera.scheduler.cards import Card
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import (
    FIT_CHECKS,
    PLAIN_CHECKS,
    FitContext,
    PodOptions,
    card_refusal,
    plain_applies,
    plain_card,
    relevant_checks,
)

from tessera.hami import ContainerRequest, PodRequest

from .factories import GIB

PLAIN_IN_ORDER = [c for c in FIT_CHECKS if c in PLAIN_CHECKS]


def card(rng: random.Random, i: int) -> Card:
    memory = rng.choice([0, 16 * GIB, 80 * GIB])
    cores = rng.choice([0, 100])
    mig_model = "A100-40GB" if rng.random() < 0.1 else ""
    return Card(
        uuid=f"GPU-{i}", index=i, type="NVIDIA-H100", numa=0,
        mode=rng.choice(["hami-core", "HAMI-core", "mig", "MIG", "mps"]) if rng.random() < 0.3
        else "hami-core",
        healthy=rng.random() > 0.1, cordoned=rng.random() < 0.1, memory_mib=memory, cores=cores,
        split_count=rng.choice([1, 2, 10]), used_mem=rng.randint(0, memory + 1024),
        used_cores=rng.randint(0, cores + 10), used_slots=rng.randint(0, 11), mig_model=mig_model,
    )  # fmt: skip


def request(rng: random.Random) -> ContainerRequest:
    pct = rng.choice([None, None, 1, 10, 50, 100])
    return ContainerRequest(
        count=rng.choice([1, 2]), memory_mib=0 if pct else rng.randint(0, 90) * GIB,
        memory_percentage=pct, cores=rng.choice([0, 1, 10, 50, 99, 100]),
    )  # fmt: skip


def test_plain_card_clears_exactly_the_cards_the_checks_pass() -> None:
    rng = random.Random(11)
    ctx = FitContext(PodOptions())
    for i in range(20000):
        c, r = card(rng, i), request(rng)
        assert plain_applies(relevant_checks(r, ctx), ctx.options)
        passes = card_refusal(c, r, ctx, PLAIN_IN_ORDER) is None
        if c.mig_model:
            assert not plain_card(c, r)
        else:
            assert plain_card(c, r) == passes, (c, r)


def test_a_fit_on_cards_that_pass_asks_no_check_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> str:
        raise AssertionError("checked card by card")

    monkeypatch.setattr(placement, "card_refusal", refuse)
    cards = [Card(f"GPU-{i}", i, "NVIDIA-H100", "hami-core", 0, True, False, 80 * GIB, 100, 10)
             for i in range(4)]  # fmt: skip
    pod = PodRequest(containers=[ContainerRequest(2, 8 * GIB, None, 30)])
    fit = fit_pod(cards, pod, FitContext(PodOptions()))
    assert fit.ok and [g.uuid for g in fit.containers[0]] == ["GPU-0", "GPU-1"]


@pytest.mark.parametrize("options", [
    PodOptions(use_types=("a100",)), PodOptions(nouse_types=("h100",)),
    PodOptions(vgpu_mode="mps"), PodOptions(use_uuids=frozenset({"GPU-0"})),
    PodOptions(gpu_policies=("mutex",)),
])  # fmt: skip
def test_pods_naming_types_modes_or_cards_are_checked_card_by_card(options: PodOptions) -> None:
    ctx = FitContext(options)
    assert not plain_applies(relevant_checks(ContainerRequest(2, GIB, None, 10), ctx), options)
