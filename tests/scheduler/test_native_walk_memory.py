"""A fresh list's walk in C and its memory: the walk is freed the moment no decision holds it
(no reference cycle waits for the collector), its block is handed to the next walk only when
no walk reads it, and the walk's plan (`index._FreshPlans`, kept per request shape) follows the
index's arrays when nodes are added. Each ordering is checked against the plain algorithm
(`test_index_order.reference`)."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Iterator

import pytest
from tessera.scheduler.index import Need
from tessera.scheduler.native_walk import NATIVE_FROM, Blocks, NativeWalk

from .factories import GIB
from .test_index_order import cluster, reference
from .test_native_names import built  # noqa: F401  (the library, built once per module)

NEEDS = [Need(1, 10 * GIB, 0, 10)]


@pytest.fixture(scope="module")
def fresh_cluster() -> tuple:
    """An index just over `NATIVE_FROM` nodes (a fifth busy, many ties), built once: the
    tests below only read it."""
    return cluster(random.Random(21), NATIVE_FROM + 50)


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cyclic collector held off for the test (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_walk_no_decision_holds_is_freed_at_once(
    fresh_cluster: tuple, collector_off: None
) -> None:
    """With the collector off, a walk dropped halfway is gone once its ordering is dropped:
    nothing but the cyclic collector would free a walk that its rounds refer back to (and
    every walk's ~180 KB at 20,000 candidates stayed until then)."""
    index, names = fresh_cluster
    slots, _unknown = index.resolve(random.Random(1).sample(names, len(names)))
    ordered, pruned = index.order(slots, NEEDS, "binpack", True)
    walk = ordered._ordering._pending
    assert isinstance(walk, NativeWalk)
    first = list(zip(range(20), ordered, strict=False))  # (into C's second round)
    assert len(first) == 20
    gone = weakref.ref(walk)
    del walk, ordered, pruned
    assert gone() is None


def test_a_block_is_handed_out_again_only_when_no_walk_reads_it() -> None:
    """A walk reads its block through the block's views (keys, rounds, flags) or slices of
    them: while any is held, the block is not handed out again; its views follow the length
    asked for."""
    blocks = Blocks()
    one = blocks.take(500)
    one_at = one.address
    out = one.out[2:4]  # (a round's positions: a slice of the block's view)
    two = blocks.take(500)
    two_at = two.address
    assert two_at != one_at  # (`out` still reads the first)
    del out
    three = blocks.take(100)
    assert three.address == one_at  # (nothing reads the first any more; large enough)
    assert (len(three.keys), len(three.out), len(three.busy)) == (100, 129, 100)
    assert three.keys.__array_interface__["data"][0] == one_at
    keys = three.keys  # (a walk's keys: the block's own view)
    four = blocks.take(100)
    assert four.address == two_at  # (`keys` reads the first; the second is free)
    flags = four.busy
    five = blocks.take(100)
    assert five.address not in (one_at, two_at)  # (both read)
    del keys, flags
    bigger = blocks.take(5000)
    assert len(bigger.keys) == 5000 and bigger.address not in (one_at, two_at, five.address)
    assert len(bigger.block) >= 8 * (5000 + 129) + 5000


def test_a_walk_in_flight_keeps_its_block_while_other_decisions_walk(
    fresh_cluster: tuple,
) -> None:
    """A decision held across others (a filter's CAS in flight between its candidates) walks
    on exactly as alone, into C's later rounds and numpy's, while other decisions on other
    fresh lists take and free blocks."""
    index, names = fresh_cluster
    rng = random.Random(2)
    lists = [index.resolve(rng.sample(names, len(names)))[0] for _ in range(4)]
    held, _pruned = index.order(lists[0], NEEDS, "spread", True)
    assert isinstance(held._ordering._pending, NativeWalk)
    walked = iter(held)
    before = [next(walked) for _ in range(10)]
    for slots in lists[1:]:  # (each taken and freed while `held` is walked)
        ordered, _pruned = index.order(slots, NEEDS, "binpack", False)
        assert list(ordered) == reference(index, slots, NEEDS, "binpack", False)[0]
        del ordered, _pruned
    after = list(walked)
    assert before + after == reference(index, lists[0], NEEDS, "spread", True)[0]


def test_consecutive_decisions_reuse_one_block(fresh_cluster: tuple) -> None:
    """A decision dropped before the next one is made leaves its block to it: the walks'
    memory stays put (no fresh pages per call)."""
    index, names = fresh_cluster
    rng = random.Random(3)
    seen = set()
    for _ in range(6):
        slots = index.resolve(rng.sample(names, len(names)))[0]
        ordered, pruned = index.order(slots, NEEDS, "binpack", True)
        walk = ordered._ordering._pending
        assert isinstance(walk, NativeWalk)
        seen.add(walk.keys.__array_interface__["data"][0])
        assert next(iter(ordered)) == reference(index, slots, NEEDS, "binpack", True)[0][0]
        del ordered, pruned, walk
    assert len(seen) == 1


def test_the_walk_plan_follows_the_index_when_nodes_are_added() -> None:
    """The plan kept per request shape (bound columns, their addresses) is not used once a
    node added has replaced the index's arrays: the order after growth is the plain one, and
    the new nodes are walked too."""
    rng = random.Random(4)
    index, names = cluster(rng, NATIVE_FROM + 10)
    slots = index.resolve(rng.sample(names, len(names)))[0]
    ordered, _pruned = index.order(slots, NEEDS, "spread", True)
    assert list(ordered) == reference(index, slots, NEEDS, "spread", True)[0]
    scores_before = index.scores
    more, more_names = cluster(random.Random(5), 2 * NATIVE_FROM)
    for name in more_names:
        entry = more.entries[name]
        index.set_registration(f"x{name}", entry.registration.model_copy(
            update={"node": f"x{name}"}), 0.0)  # fmt: skip
        index.set_ledger(f"x{name}", entry.ledger.model_copy(update={"node": f"x{name}"}), 1, 0.0)
    assert index.scores is not scores_before  # (the arrays were replaced: grown)
    every = names + [f"x{name}" for name in more_names]
    slots = index.resolve(rng.sample(every, len(every)))[0]
    ordered, pruned = index.order(slots, NEEDS, "spread", True)
    assert isinstance(ordered._ordering._pending, NativeWalk)
    expected, expected_pruned = reference(index, slots, NEEDS, "spread", True)
    assert list(ordered) == expected
    assert sorted(pruned) == expected_pruned
    assert any(index.names_at[slot].startswith("x") for slot in expected[:50])
