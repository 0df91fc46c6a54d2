"""A candidate list's policy order kept between calls (candidate_order.py) must be exactly the
full stable sort of the current scores every time: non-busy first, then the key, ties in the
caller's order, every candidate once, while scores change a few at a time or many at once, with
few distinct scores (many ties) and snapshots held while later changes arrive."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tessera.scheduler.candidate_order import (
    BLOCK,
    HEAD,
    PolicyOrder,
    fresh_order,
    fresh_walk,
    full_order,
    policy_sign,
    walk,
)


def reference(
    scores: np.ndarray, policy: str, busy: np.ndarray | None, possible: np.ndarray | None = None
) -> list[int]:
    keys = policy_sign(policy) * scores
    order = np.argsort(keys, kind="stable") if busy is None else np.lexsort((keys, busy))
    return [int(p) for p in order if possible is None or possible[p]]


def walked(
    order: PolicyOrder, scores: np.ndarray, busy: np.ndarray | None,
    possible: np.ndarray | None = None,
) -> list[int]:
    snapshot = order.snapshot(scores)
    every = np.ones(len(scores), dtype=bool) if possible is None else possible
    chunks = list(walk(snapshot, busy, every))
    assert all(len(c) for c in chunks)
    got = [int(p) for c in chunks for p in c]
    assert full_order(snapshot, busy).tolist() == reference(scores, order_policy(order), busy)
    return got


def order_policy(order: PolicyOrder) -> str:
    return "binpack" if order.sign < 0 else "spread"


@pytest.mark.parametrize("policy", ["binpack", "spread"])
@pytest.mark.parametrize("with_busy", [True, False])
@pytest.mark.parametrize("n", [0, 1, 5, 63, 64, 65, 300, 513, 3000])
def test_the_walk_is_the_full_stable_sort_while_scores_move(
    policy: str, with_busy: bool, n: int
) -> None:
    rng = random.Random(n * 7 + len(policy) + with_busy)
    levels = [0.0, 1.5, 3.0, 7.25, 10.0, 12.5, 30.0]  # few distinct scores: many ties
    scores = np.array([rng.choice(levels) for _ in range(n)], dtype=np.float64)
    order = PolicyOrder(policy_sign(policy), scores)
    for step in range(120):
        busy = (np.array([rng.random() < 0.2 for _ in range(n)], dtype=bool)
                if with_busy else None)  # fmt: skip
        # Some candidates ruled out by their bounds (never walked), sometimes none.
        possible = np.array([rng.random() < (0.7 if step % 3 else 1.0) for _ in range(n)],
                            dtype=bool)  # fmt: skip
        assert walked(order, scores, busy, possible) == reference(scores, policy, busy, possible), (
            f"step {step}"
        )
        if not n:
            break
        # A few nodes change (a placement, a release), sometimes many (a list gathered anew);
        # sometimes to a score never seen, sometimes back to where it was.
        changes = rng.choice([1, 1, 2, 3, 40, n])
        moved = [rng.randrange(n) for _ in range(changes)]
        for p in moved:
            scores[p] = rng.choice(levels) if rng.random() < 0.7 else rng.random() * 30
        order.changed([*moved, rng.randrange(n)])  # told of one that did not change, too
        if step % 2:  # between calls, as the service does (merged there, if many changed)
            order.tidy(scores)


def test_merges_happen_between_calls_unless_they_fell_behind() -> None:
    """More than `REBUILD` changed positions: a snapshot (a decision) walks them merged in on
    the fly, `tidy` (between calls) merges them into the kept order; only past `BEHIND` (merges
    fell behind a flood of writes) does a snapshot merge itself. The walk is the full stable sort
    throughout."""
    rng = random.Random(11)
    n = 2000
    scores = np.array([rng.choice([0.0, 3.0, 7.25, 12.0]) for _ in range(n)], dtype=np.float64)
    order = PolicyOrder(policy_sign("binpack"), scores)
    kept = order.perm
    moved = rng.sample(range(n), PolicyOrder.REBUILD + 10)
    scores[moved] = [rng.choice([1.0, 7.25, 30.0]) for _ in moved]
    order.changed(moved)
    assert walked(order, scores, None) == reference(scores, "binpack", None)
    assert order.perm is kept and len(order.dirty_list) == len(moved)  # not merged in the call
    held = order.snapshot(scores)
    assert order.tidy(scores) and order.perm is not kept and not order.dirty_list
    assert not order.tidy(scores)  # nothing left to merge
    assert full_order(held, None).tolist() == reference(scores, "binpack", None)
    assert walked(order, scores, None) == reference(scores, "binpack", None)
    kept = order.perm
    flood = rng.sample(range(n), PolicyOrder.BEHIND + 1)
    scores[flood] = [rng.choice([0.0, 12.0, 31.0]) for _ in flood]
    order.changed(flood)
    assert walked(order, scores, None) == reference(scores, "binpack", None)
    assert order.perm is not kept and not order.dirty_list  # merged in the call: bounded


def test_a_snapshot_is_unaffected_by_later_changes() -> None:
    """A decision walking its order across an await: later placements must not change it."""
    rng = random.Random(5)
    scores = np.array([rng.choice([0.0, 5.0, 10.0]) for _ in range(500)], dtype=np.float64)
    order = PolicyOrder(policy_sign("binpack"), scores)
    order.changed([3, 4])
    scores[3], scores[4] = 20.0, 0.0
    expected = reference(scores, "binpack", None)
    pending = walk(order.snapshot(scores), None, np.ones(500, dtype=bool))
    first = [int(p) for p in next(pending)]
    for p in range(0, 500, 3):  # many changes, enough to rebuild the kept order
        scores[p] = 25.0
        order.changed([p])
    order.snapshot(scores)
    rest = np.concatenate(list(pending)).tolist()
    assert first + rest == expected
    assert walked(order, scores, None) == reference(scores, "binpack", None)


def test_a_first_fit_reads_one_chunk() -> None:
    scores = np.linspace(0, 30, 5000)
    order = PolicyOrder(policy_sign("binpack"), scores)
    every = np.ones(5000, dtype=bool)
    first = next(walk(order.snapshot(scores), ~every, every))
    assert first == list(range(4999, 4999 - HEAD, -1))


@pytest.mark.parametrize("density", [0.002, 0.02, 0.06, 0.5])
def test_sparse_candidates_beyond_the_first_block(density: float) -> None:
    """Few possible candidates: a head found in the first `BLOCK` of the kept order, or not (the
    walk then reads every candidate), with the busy ones apart and moved positions merged."""
    rng = random.Random(int(density * 1000))
    n = 3000
    levels = [0.0, 1.5, 3.0, 7.25, 10.0]
    scores = np.array([rng.choice(levels) for _ in range(n)], dtype=np.float64)
    for policy in ("binpack", "spread"):
        order = PolicyOrder(policy_sign(policy), scores)
        for _step in range(30):
            busy = np.array([rng.random() < 0.1 for _ in range(n)], dtype=bool)
            possible = np.array([rng.random() < density for _ in range(n)], dtype=bool)
            assert walked(order, scores, busy, possible) == reference(
                scores, policy, busy, possible
            )
            moved = [rng.randrange(n) for _ in range(rng.choice([1, 5, 30]))]
            for p in moved:
                scores[p] = rng.choice(levels)
            order.changed(moved)


def test_the_head_reads_the_bounds_of_the_first_block_only() -> None:
    """A call that fits on one of the first candidates reads the bounds of the first `BLOCK` of
    the kept order and of the moved positions, not of every candidate; the rest when the walk
    goes on past the head."""
    n = 5000
    scores = np.linspace(0, 30, n)
    order = PolicyOrder(policy_sign("binpack"), scores)
    order.changed([10, 20])
    scores[10], scores[20] = 31.0, 0.5
    read: list[int] = []

    def possible(at: np.ndarray | None) -> np.ndarray:
        read.append(n if at is None else len(at))
        return np.ones(n if at is None else len(at), dtype=bool)

    pending = walk(order.snapshot(scores), np.zeros(n, dtype=bool), possible)
    first = next(pending)
    assert first[0] == 10 and len(first) == HEAD + 1  # the moved 10 merged in
    assert read == [BLOCK + 2]
    rest = [int(p) for chunk in pending for p in chunk]
    assert first + rest == reference(scores, "binpack", np.zeros(n, dtype=bool))
    assert read == [BLOCK + 2, n]


def test_a_block_with_few_possible_candidates_still_spares_the_rest() -> None:
    """Fewer than `HEAD` possible candidates in the first block: they and the moved positions
    before the block's end are the head, read without the bounds of every candidate."""
    n = 5000
    scores = np.linspace(0, 30, n)
    order = PolicyOrder(policy_sign("binpack"), scores)
    order.changed([10, 4990])
    scores[10], scores[4990] = 29.99, 29.0  # first, and past the first block (~166th)
    mask = np.zeros(n, dtype=bool)
    mask[[4999 - 3, 4999 - 60, 10, 4990, 2000, 7]] = True
    read: list[int] = []

    def possible(at: np.ndarray | None) -> np.ndarray:
        read.append(n if at is None else len(at))
        return mask if at is None else mask[at]

    pending = walk(order.snapshot(scores), None, possible)
    first = next(pending)
    assert first == [10, 4999 - 3, 4999 - 60] and read == [BLOCK + 2]
    rest = [int(p) for chunk in pending for p in chunk]
    assert first + rest == reference(scores, "binpack", None, mask)


@pytest.mark.parametrize("with_busy", [True, False])
def test_moved_positions_only(with_busy: bool) -> None:
    """No kept candidate is possible, only moved ones: all of them, in order."""
    rng = random.Random(3)
    n = 2000
    scores = np.array([rng.choice([0.0, 3.0, 7.25]) for _ in range(n)], dtype=np.float64)
    order = PolicyOrder(policy_sign("spread"), scores)
    moved = rng.sample(range(n), 20)
    for p in moved:
        scores[p] = rng.choice([0.0, 3.0, 7.25, 12.0])
    order.changed(moved)
    mask = np.zeros(n, dtype=bool)
    mask[moved] = True
    busy = np.array([rng.random() < 0.3 for _ in range(n)], dtype=bool) if with_busy else None
    assert walked(order, scores, busy, mask) == reference(scores, "spread", busy, mask)


@pytest.mark.parametrize("policy", ["binpack", "spread"])
@pytest.mark.parametrize("with_busy", [True, False])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 200, 513, 600, 3000, 20000])
def test_a_fresh_list_is_walked_in_the_full_stable_sort(
    policy: str, with_busy: bool, n: int
) -> None:
    """A list seen once (kube-scheduler's rotating window) is walked without a kept order, in
    rounds of the smallest keys: exactly the possible positions of the full stable sort, each
    once, the head as a Python list; few distinct scores (ties across the rounds' thresholds)
    or all distinct, most positions impossible (binpack's full nodes first) or none."""
    rng = random.Random(n * 3 + len(policy) + with_busy)
    for levels in ([0.0, 1.5, 3.0, 7.25, 10.0], None):
        scores = np.array([rng.choice(levels) if levels else rng.random() for _ in range(n)],
                          dtype=np.float64)  # fmt: skip
        busy = np.array([rng.random() < 0.2 for _ in range(n)], dtype=bool) if with_busy else None
        for share in (1.0, 0.3, 0.01):
            possible = np.array([rng.random() < share for _ in range(n)], dtype=bool)
            keys = policy_sign(policy) * scores
            asked: list[int] = []

            def at(
                positions: np.ndarray, possible: np.ndarray = possible, asked: list[int] = asked
            ) -> np.ndarray:
                asked.extend(positions.tolist())
                return possible[positions]

            chunks = list(fresh_walk(keys, busy, at))
            assert all(len(c) for c in chunks)
            assert all(isinstance(c, np.ndarray) for c in chunks[1:])
            got = [int(p) for c in chunks for p in c]
            assert got == reference(scores, policy, busy, possible)
            assert sorted(asked) == list(range(n))  # each position's bounds read once
            assert fresh_order(keys, busy).tolist() == reference(scores, policy, busy)
