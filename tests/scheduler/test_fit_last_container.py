"""A pod's last GPU container is granted its cards without copying and charging them (nothing is
fitted after it), and a one-card container takes the policy's best card without sorting the
others: the grants and refusals must be exactly those of copying, charging and sorting, and the
node's cards must be left as they were."""

from __future__ import annotations

import random
from collections import Counter

from tessera.scheduler.cards import Card
from tessera.scheduler.placement import _sort_key, fit_pod, pick_cards
from tessera.scheduler.rules import FitContext, PodOptions, card_refusal

from tessera.hami import ContainerRequest, PodRequest

from .factories import GIB

POLICIES = [("spread",), ("binpack",), ("binpack", "spread"), ("spread", "numa"),
            ("binpack", "topology-aware"), ("numa",), ("mutex",)]  # fmt: skip


def cards(rng: random.Random) -> list[Card]:
    out = []
    for i in range(8):
        memory = rng.choice([16 * GIB, 80 * GIB])
        out.append(Card(
            uuid=f"GPU-{i}", index=i, type="NVIDIA-H100", mode="hami-core",
            numa=i // 4 if rng.random() < 0.5 else 0, healthy=rng.random() > 0.05,
            cordoned=rng.random() < 0.05, memory_mib=memory, cores=100,
            split_count=rng.choice([2, 10]),
            links={f"GPU-{j}": rng.choice([0, 1, 2]) for j in range(8) if j != i},
            used_mem=rng.randint(0, memory // GIB) * GIB, used_cores=rng.choice([0, 10, 50, 90]),
            used_slots=rng.randint(0, 2),
        ))  # fmt: skip
    return out


def request(rng: random.Random) -> ContainerRequest:
    pct = rng.choice([None, None, None, 10, 25])
    return ContainerRequest(
        count=rng.choice([1, 1, 1, 2, 3, 4, 8]), memory_mib=0 if pct else rng.randint(1, 24) * GIB,
        memory_percentage=pct, cores=rng.choice([0, 10, 20, 30]),
    )  # fmt: skip


def state(of: list[Card]) -> list[tuple[object, ...]]:
    return [(c.uuid, c.used_mem, c.used_cores, c.used_slots, list(c.mig_instances),
             c.libvgpu_slices) for c in of]  # fmt: skip


def test_the_last_containers_grants_are_those_of_charged_copies() -> None:
    """Reference: the same pod with one more container after it (a card with no memory and no
    cores), so that the pod's own last container is copied and charged as every other is."""
    rng = random.Random(35)
    compared = refused = 0
    for _ in range(3000):
        node = cards(rng)
        init = [request(rng)] if rng.random() < 0.2 else []
        count = rng.choice([1, 1, 2, 3])
        app = [request(rng) if rng.random() < 0.9 else None for _ in range(count)]
        pod = PodRequest(init=init, containers=app)
        options = PodOptions(gpu_policies=rng.choice(POLICIES), numa_bind=rng.random() < 0.1)
        before = state(node)
        fit = fit_pod(node, pod, FitContext(options))
        assert state(node) == before  # (the node's cards are never charged)
        dummy = ContainerRequest(count=1, memory_mib=0, memory_percentage=None, cores=0)
        longer = PodRequest(init=init, containers=[*app, dummy])
        reference = fit_pod(node, longer, FitContext(options))
        if not fit.ok:
            assert not reference.ok and reference.reasons == fit.reasons
            refused += 1
        elif reference.ok:
            assert fit.containers == reference.containers[:-1]
            compared += 1
    assert compared > 1000 and refused > 100, (compared, refused)


def test_a_one_card_container_takes_the_first_card_of_the_sorted_order() -> None:
    rng = random.Random(36)
    taken = 0
    for _ in range(5000):
        node = cards(rng)
        one = request(rng)
        one = ContainerRequest(1, one.memory_mib, one.memory_percentage, one.cores)
        options = PodOptions(gpu_policies=rng.choice(POLICIES),
                             weights=rng.choice([(1, 1, 1), (0, 1, 2), (3, 0, 0)]))  # fmt: skip
        ctx = FitContext(options)
        picked = pick_cards(list(node), one, ctx, Counter())
        passing = [c for c in node if card_refusal(c, one, ctx) is None]
        if not passing:
            assert picked is None
            continue
        if options.numa_bind or {"numa", "topology-aware"} & set(options.gpu_policies):
            continue  # (those select among the ordered cards: not the fast path)
        assert picked == sorted(passing, key=_sort_key(one, options))[:1]
        taken += 1
    assert taken > 2000
