"""The scheduler's GC policy once ready (gc_policy.py): collections happen between calls, on the
event loop's schedule, not inside a call at CPython's threshold; cyclic garbage is still
reclaimed within an interval, so memory stays bounded."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
import weakref
from collections.abc import Iterator

import pytest
from tessera.scheduler.gc_policy import GcPolicy


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    gc.collect()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()  # what a full collection of the policy froze goes back to the old generation
        if not enabled:
            gc.disable()


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def cycles(n: int) -> list[weakref.ref[Node]]:
    """n pairs of objects referring to each other, dropped at once: garbage only the cyclic GC
    can free. Weak references tell when they are gone."""
    refs = []
    for _ in range(n):
        a, b = Node(), Node()
        a.peer, b.peer = b, a
        refs.append(weakref.ref(a))
    return refs


def alive(refs: list[weakref.ref[Node]]) -> int:
    return sum(r() is not None for r in refs)


def test_no_collection_inside_a_call_below_the_ceiling() -> None:
    """A call that allocates thousands of objects (more than CPython's 700) is not interrupted
    by a collection: its garbage waits for the next `collect` between calls."""
    policy = GcPolicy()
    policy.install()
    collections = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        refs = cycles(5_000)  # 10,000 objects: 14 collections at CPython's default threshold
    finally:
        gc.callbacks.remove(seen)
    assert collections == []
    assert alive(refs) == len(refs)
    assert policy.collect() == 0  # between calls: the youngest generation
    assert alive(refs) == 0


def test_collect_waits_for_young_objects_and_follows_cpythons_generations() -> None:
    policy = GcPolicy(young=500)
    policy.install()
    gc.collect()
    assert policy.collect() is None  # nothing accumulated: nothing to do
    kept = [[] for _ in range(1000)]  # survivors: counted, then moved to older generations
    generations = []
    while 2 not in generations and len(generations) < 1000:
        kept.extend([] for _ in range(600))
        generations.append(policy.collect())
    # As CPython: a gen-1 collection once more than `middle` gen-0 ones ran since the last, a
    # full one once more than `old` gen-1 ones did; younger generations are collected with it.
    ones = [i for i, g in enumerate(generations) if g == 1]
    assert generations[: policy.middle + 1] == [0] * (policy.middle + 1)
    assert len(ones) == policy.old + 1
    assert all(b - a == policy.middle + 2 for a, b in itertools.pairwise(ones))
    assert generations[-1] == 2 and len(generations) == ones[-1] + 2  # the next one
    assert gc.get_freeze_count() > len(kept)  # a full collection freezes what survived it
    assert gc.get_count()[0] < policy.young


def test_the_running_policy_reclaims_cycles_within_an_interval() -> None:
    async def scenario() -> int:
        policy = GcPolicy(interval_s=0.005)
        task = asyncio.create_task(policy.run())
        await asyncio.sleep(0)
        refs = cycles(2_000)
        deadline = time.monotonic() + 10.0
        while alive(refs) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gc.get_threshold()[0] == policy.ceiling
        return alive(refs)

    assert asyncio.run(scenario()) == 0


def test_the_ceiling_still_collects_when_no_loop_runs() -> None:
    """A loop stuck in one long call: CPython collects on its own at the ceiling."""
    policy = GcPolicy(ceiling=5_000)
    policy.install()
    refs = cycles(10_000)  # 20,000 objects: past the ceiling several times
    assert alive(refs) < len(refs)


def test_frozen_cycles_that_become_garbage_are_reclaimed_after_the_thaw_interval() -> None:
    """Objects frozen while in use (a connection's transport and protocol) and dropped later are
    cyclic garbage the collector no longer sees; the periodic thaw reclaims them within
    `thaw_every_s`, so memory stays bounded over days."""
    now = [1000.0]
    policy = GcPolicy(thaw_every_s=600.0, clock=lambda: now[0])
    policy.install()
    refs = cycles(1_000)
    gc.freeze()  # as a full collection of the policy does to survivors still referenced
    assert alive(refs) == len(refs)
    # Dropped: unreachable, but frozen, so no ordinary collection reclaims them.
    gc.collect()
    assert alive(refs) == len(refs)
    now[0] += 599.0
    policy.collect()
    assert alive(refs) == len(refs)
    now[0] += 1.0
    assert policy.collect() == 2
    assert alive(refs) == 0
