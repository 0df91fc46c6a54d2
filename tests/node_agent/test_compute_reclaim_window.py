"""Compute reclaims coalesced per container and GPU (pure): an operator gets the first reclaim at
once and then at most one summary per window, however often neighbours wake."""

from __future__ import annotations

import itertools

from tessera.node_agent.compute_reclaim_window import ReclaimCoalescer

from tessera.elastic_compute import ComputeTaken


def taken(before: int, after: int, *, key: str = "uid-a/0", uuid: str = "GPU-1",
          for_keys: tuple[str, ...] = ("uid-b/0",)) -> ComputeTaken:  # fmt: skip
    return ComputeTaken(key, uuid, before, after, 30, 100, for_keys)


def test_the_first_reclaim_is_reported_at_once_the_rest_of_the_window_in_one_summary() -> None:
    window = ReclaimCoalescer(60)
    [first] = window.add([taken(10000, 7000)], at=100.0)
    assert (first.reclaims, first.max_taken_x100, first.allowance_x100) == (1, 3000, 7000)
    # a neighbour waking every second for the rest of the window: nothing more until it ends
    for i in range(1, 50):
        assert window.add([taken(10000 - i, 5000 + i, for_keys=("uid-c/0",))], at=100.0 + i) == []
        assert window.due(100.0 + i) == []
    [summary] = window.due(160.0)
    assert summary.reclaims == 49
    assert summary.max_taken_x100 == 10000 - 1 - 5001  # the largest single reclaim
    assert summary.allowance_x100 == 5049  # where the last one left it
    assert summary.for_keys == ("uid-c/0",)
    assert (summary.first_at, summary.last_at) == (101.0, 149.0)


def test_at_most_one_event_per_window_per_container_and_gpu() -> None:
    window = ReclaimCoalescer(10)
    reported: list[float] = []
    t = 0.0
    while t < 100:  # a reclaim every 20 ms for 100 s, as the lender could
        out = window.add([taken(10000, 7000)], at=t) + window.due(t)
        reported.extend(t for _ in out)
        t = round(t + 0.02, 2)
    assert 9 <= len(reported) <= 11
    gaps = [b - a for a, b in itertools.pairwise(reported)]
    assert min(gaps) >= 10 - 1e-9


def test_containers_and_gpus_are_coalesced_apart() -> None:
    window = ReclaimCoalescer(60)
    out = window.add([taken(10000, 7000), taken(10000, 7000, uuid="GPU-2"),
                      taken(10000, 7000, key="uid-b/0")], at=0.0)  # fmt: skip
    assert {(s.key, s.uuid) for s in out} == {("uid-a/0", "GPU-1"), ("uid-a/0", "GPU-2"),
                                              ("uid-b/0", "GPU-1")}  # fmt: skip


def test_a_quiet_window_closes_so_the_next_reclaim_is_reported_at_once() -> None:
    window = ReclaimCoalescer(60)
    assert len(window.add([taken(10000, 7000)], at=0.0)) == 1
    assert window.due(60.0) == []
    assert len(window) == 0  # nothing kept for a container that stopped being reclaimed
    assert len(window.add([taken(10000, 7000)], at=61.0)) == 1


def test_held_reclaims_are_not_lost_when_the_window_ended_unseen_or_the_agent_stops() -> None:
    window = ReclaimCoalescer(60)
    window.add([taken(10000, 7000)], at=0.0)
    window.add([taken(9000, 8000, for_keys=("uid-c/0",))], at=30.0)
    # the window ended but `due` was not called: the next reclaim carries the held one with it
    [both] = window.add([taken(10000, 4000)], at=70.0)
    assert (both.reclaims, both.max_taken_x100, both.first_at, both.last_at) == (2, 6000, 30, 70)
    assert both.for_keys == ("uid-b/0", "uid-c/0")
    window.add([taken(10000, 7000)], at=80.0)
    [held] = window.flush()
    assert held.reclaims == 1 and len(window) == 0


def test_window_zero_reports_every_reclaim() -> None:
    window = ReclaimCoalescer(0)
    assert sum(len(window.add([taken(10000, 7000)], at=float(i))) for i in range(5)) == 5


async def test_a_bus_that_does_not_keep_up_never_blocks_the_lending_loop() -> None:
    """The lending loop hands reclaims over synchronously; with nobody publishing (the bus
    stalled) the queue holds what it can and counts the rest, and the loop goes on."""
    import logging

    from tessera.node_agent.compute_reclaims import QUEUE_MAX, ComputeReclaimReporter

    reporter = ComputeReclaimReporter(
        node="n1", js=None, cluster=None, log=logging.getLogger("test"), source="t",
        window_s=60, names=dict, clock=lambda: 100.0)  # fmt: skip
    many = [taken(10000, 7000, key=f"uid-{i}/0") for i in range(QUEUE_MAX + 10)]
    assert reporter.offer(many) is None  # returns at once: no await anywhere
    assert reporter.dropped == 10
    reporter.offer(many)  # the same containers within their window: held, nothing queued
    assert reporter.dropped == 10
