"""The fresh list's walk in C (`native_walk.NativeWalk`, `native/names/src/walk.c`) gives the
positions numpy's `candidate_order.fresh_walk` gives, in the same order, on every list:
adversarial keys (ties, -0.0, infinities), busy nodes or none, bounds of every width and at
every edge, the walk handed on to numpy after C's rounds; where C cannot order a list (a NaN
key, a slot past the arrays, a bound outside int64) it steps aside (None) and numpy walks. A
decision over the index is the same with the library and without it."""

from __future__ import annotations

import json
import random
from itertools import islice

import numpy as np
import pytest
from tessera.scheduler import native_names, native_walk
from tessera.scheduler.candidate_order import fresh_walk
from tessera.scheduler.decide import decide
from tessera.scheduler.index import Need
from tessera.scheduler.native_walk import NATIVE_FROM, Addresses, NativeWalk
from tessera.scheduler.node_names import NodeNamesCache
from tessera.scheduler.rules import parse_pod_options

from tessera.hami import parse_pod_request
from tessera.settings import TesseraSettings

from .factories import GIB, container, pod
from .test_index_order import cluster, reference
from .test_native_names import (
    built,  # noqa: F401  (the library, built once per module)
    lists_of,
)

WIDTHS = (np.int8, np.int16, np.int32, np.int64)


def flat(walk) -> list[int]:  # type: ignore[no-untyped-def]
    out: list[int] = []
    for chunk in walk:
        out.extend(int(p) for p in (chunk if isinstance(chunk, list) else chunk.tolist()))
    return out


def case(rng: random.Random, n: int, slots_total: int) -> dict:
    """A list of `n` positions over `slots_total` slots: scores drawn from a few values (many
    ties), -0.0 and 0.0 both, infinities; some busy; 1-6 bounds of any width."""
    values = [0.0, -0.0, 1.5, 3.0, -2.25, float("inf"), float("-inf"), 7.0, 1e300]
    pool = rng.sample(values, rng.randint(1, len(values)))
    scores = np.array([rng.choice(pool) for _ in range(slots_total)], dtype=np.float64)
    slots = np.array([rng.randrange(slots_total) for _ in range(n)], dtype=np.int64)
    busy_share = rng.choice([0.0, 0.0, 0.1, 0.5, 1.0])
    busy = np.array([rng.random() < busy_share for _ in range(slots_total)], dtype=bool)
    bounds = []
    for _ in range(rng.randint(1, 6)):
        dtype = rng.choice(WIDTHS)
        info = np.iinfo(dtype)
        column = np.array([rng.choice([info.min, -1, 0, 1, 2, 5, info.max])
                           for _ in range(slots_total)], dtype=dtype)  # fmt: skip
        minimum = rng.choice([info.min, -1, 0, 1, 2, 5, info.max, 1 << 62, -(1 << 62)])
        bounds.append((column, int(minimum)))
    return {"slots": slots, "scores": scores, "busy": busy, "bounds": bounds,
            "sign": rng.choice([1.0, -1.0])}  # fmt: skip


def bounds_of(c: dict) -> list:
    return [(column, None, minimum) for column, minimum in c["bounds"]]


def numpy_possible(c: dict):  # type: ignore[no-untyped-def]
    def possible(positions: np.ndarray) -> np.ndarray:
        at = c["slots"][positions]
        ok = np.ones(len(positions), dtype=bool)
        for column, minimum in c["bounds"]:
            ok &= column[at].astype(np.int64) >= minimum
        return ok

    return possible


def walked_both(c: dict, avoid_busy: bool, width: type = np.int64
                ) -> tuple[list[int], list[int], NativeWalk]:  # fmt: skip
    """(C's walk of the list's slots as `width` integers, numpy's, C's walk)."""
    busy = c["busy"] if avoid_busy else None
    keys = c["sign"] * c["scores"][c["slots"]]
    expected = flat(fresh_walk(keys, None if busy is None else busy[c["slots"]],
                               numpy_possible(c)))  # fmt: skip
    walk = native_walk.native_walk(c["slots"].astype(width), c["scores"], c["sign"], busy,
                                   bounds_of(c), numpy_possible(c), Addresses(),
                                   shortest=0)  # fmt: skip
    assert walk is not None
    np.testing.assert_array_equal(walk.keys, keys)
    if busy is not None and busy[c["slots"]].any():
        np.testing.assert_array_equal(walk.busy, busy[c["slots"]])
    else:  # (no candidate busy: one group, no flags)
        assert walk.busy is None
    return flat(walk), expected, walk


@pytest.mark.parametrize("seed", range(40))
def test_every_position_in_numpys_order_on_adversarial_lists(seed: int) -> None:
    """Slots as the native resolver gives them (int32), as numpy's paths do (int64), and of
    another width (int16: read as a converted int64 copy)."""
    rng = random.Random(seed)
    n = rng.choice([0, 1, 2, 7, 8, 9, 127, 128, 129, 300, 2500])
    c = case(rng, n, rng.choice([1, 3, 50, 4000]))
    for width in (np.int32, np.int64, np.int16):
        for avoid_busy in (True, False):
            native, expected, _walk = walked_both(c, avoid_busy, width)
            assert native == expected, (seed, width, avoid_busy)


@pytest.mark.parametrize("width", [np.int32, np.int64])
def test_a_slot_below_zero_or_past_the_arrays_is_left_to_numpy_at_either_width(
    width: type,
) -> None:
    """A slot the walk cannot read (negative, the arrays' length, the largest or smallest
    int32) makes C step aside whatever the list's width: never a read outside the arrays."""
    rng = random.Random(21)
    c = case(rng, NATIVE_FROM + 300, 2000)
    args = (c["scores"], c["sign"], c["busy"], bounds_of(c), numpy_possible(c), Addresses())
    slots = c["slots"].astype(width)
    assert native_walk.native_walk(slots, *args) is not None
    for bad in (-1, 2000, np.iinfo(np.int32).max, np.iinfo(np.int32).min):
        for at in (0, NATIVE_FROM // 2, len(slots) - 1):
            broken = slots.copy()
            broken[at] = bad
            assert native_walk.native_walk(broken, *args) is None, (bad, at)


def test_a_walk_stopped_early_reads_one_pass_and_its_head_first() -> None:
    """The head comes as a list (checked one by one), the rest as arrays; a walk that stops
    at its head never reaches numpy."""
    rng = random.Random(7)
    c = case(rng, 5000, 5000)
    c["bounds"] = [(np.zeros(5000, dtype=np.int32), 0)]  # every candidate possible
    walk = native_walk.native_walk(c["slots"], c["scores"], c["sign"], None, bounds_of(c),
                                   lambda positions: pytest.fail("numpy asked"),  # type: ignore[arg-type]
                                   Addresses())  # fmt: skip
    assert walk is not None
    head = next(walk)
    assert isinstance(head, list) and len(head) == native_walk.HEAD
    keys = c["sign"] * c["scores"][c["slots"]]
    assert head == np.lexsort((np.arange(5000), keys))[: native_walk.HEAD].tolist()


def test_what_c_cannot_order_is_left_to_numpy() -> None:
    rng = random.Random(3)
    c = case(rng, NATIVE_FROM, 2000)
    args = (c["scores"], c["sign"], c["busy"], bounds_of(c), numpy_possible(c), Addresses())
    assert native_walk.native_walk(c["slots"], *args) is not None
    assert native_walk.native_walk(c["slots"][: NATIVE_FROM - 1], *args) is None  # short
    nan = c["scores"].copy()
    nan[c["slots"][NATIVE_FROM // 2]] = np.nan
    assert native_walk.native_walk(c["slots"], nan, *args[1:]) is None
    beyond = c["slots"].copy()
    beyond[-1] = 2000  # past every array
    assert native_walk.native_walk(beyond, *args) is None
    huge = [(c["bounds"][0][0], None, 1 << 63)]
    assert native_walk.native_walk(c["slots"], c["scores"], c["sign"], c["busy"], huge,
                                   *args[4:]) is None  # fmt: skip
    wide = np.zeros((3, 2000), dtype=np.int64)
    assert native_walk.native_walk(c["slots"], *args[:3], [(wide, 3, 0)], *args[4:]) is None
    assert native_walk.native_walk(c["slots"], *args[:3], [(wide, 2, 0)], *args[4:]) is not None


@pytest.fixture(scope="module")
def fresh_cluster() -> tuple:
    """An index just over `NATIVE_FROM` nodes (a fifth busy, few distinct scores: many ties),
    built once: the order test only reads it."""
    return cluster(random.Random(9), NATIVE_FROM + 76)


@pytest.mark.parametrize("policy", ["binpack", "spread"])
@pytest.mark.parametrize("avoid_busy", [True, False])
def test_the_index_order_walked_in_c_is_the_full_stable_sort(
    policy: str, avoid_busy: bool, fresh_cluster: tuple
) -> None:
    """`ClusterIndex.order` on a fresh list, walked in C, is the plain algorithm's order."""
    index, names = fresh_cluster
    names = random.Random(policy + str(avoid_busy)).sample(names, len(names))
    slots, _unknown = index.resolve(names)
    for needs in ([Need(1, 10 * GIB, 0, 10)], [Need(1, 0, 50, 100)], [Need(4, 70 * GIB, 0, 0)],
                  [Need(1, 0, 0, 0), Need(3, 1, 0, 5)]):  # fmt: skip
        ordered, pruned = index.order(slots, needs, policy, avoid_busy)
        assert isinstance(ordered._ordering._pending, NativeWalk)
        expected_order, expected_pruned = reference(index, slots, needs, policy, avoid_busy)
        assert list(ordered) == expected_order
        assert sorted(pruned) == expected_pruned


def test_a_decision_is_the_same_with_the_library_and_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over an index just over `NATIVE_FROM` nodes, fresh lists: the same fitting nodes in
    the same order with the same cards, and the same reasons for a refused pod, walked in C
    or in numpy (each on an index of its own, built alike)."""
    settings = TesseraSettings()
    pods = [pod(container(gpus=g, mem=m, cores=k),
                annotations={"hami.io/node-scheduler-policy": policy})
            for policy in ("binpack", "spread")
            for g, m, k in ((1, 4 * GIB, None), (2, 20 * GIB, 30), (1, 70 * GIB, None),
                            (4, GIB, 10), (1, 200 * GIB, None))]  # fmt: skip

    def walked() -> list:
        index, names = cluster(random.Random(13), NATIVE_FROM + 76)
        rng = random.Random(5)
        out = []
        for names_list in [rng.sample(names, len(names)) for _ in range(2)]:
            for spec in pods:
                request = parse_pod_request(spec, settings)
                decision = decide(index, request, parse_pod_options(spec, settings), names_list)
                # (the first 150: past C's rounds, into numpy's)
                fitting = [(entry.name, [[g.uuid for g in c] for c in fit.containers])
                           for entry, fit in islice(decision.fits(), 150)]  # fmt: skip
                if not fitting:
                    decision.explain_rest()
                out.append((fitting, sorted(decision.failed.items())))
        return out

    with_library = walked()
    monkeypatch.setattr(native_walk, "walk_function", lambda: None)
    assert walked() == with_library
    assert any(len(fitting) == 150 for fitting, _ in with_library)
    assert any(not fitting for fitting, _ in with_library)


def test_a_decision_on_lists_read_from_the_body_is_the_same_with_the_library_and_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lists as the service reads them (`NodeNamesCache` over the body, the index's resolvers:
    int32 slots from the native resolver, walked in C at that width) give the same fitting
    nodes, cards and refusal reasons as numpy with no library at all (int64 slots), on fresh
    lists in kube-scheduler's orders, duplicates and a list with an unknown name included."""
    settings = TesseraSettings()
    pods = [pod(container(gpus=g, mem=m, cores=k),
                annotations={"hami.io/node-scheduler-policy": policy})
            for policy in ("binpack", "spread")
            for g, m, k in ((1, 4 * GIB, None), (2, 20 * GIB, 30), (1, 200 * GIB, None))]

    def decided() -> tuple[list, set[str]]:
        index, names = cluster(random.Random(13), NATIVE_FROM + 76)
        cache = NodeNamesCache(100_000, resolver=index.names_from_bytes,
                               runs=index.names_of_run, in_place=index.names_in_body)
        lists = [listed for listed in lists_of(names, random.Random(6)) if len(listed) > 100]
        lists += [lists[2] + ["ghost"]] * 2
        out, dtypes = [], set()
        for listed in lists:
            for spec in pods:
                body = json.dumps({"pod": spec, "nodenames": listed},
                                  separators=(",", ":")).encode()  # fmt: skip
                parsed = cache.parse(body) or json.loads(body)  # (as the service falls back)
                candidates = parsed["nodenames"]
                resolved = getattr(candidates, "resolved", None)
                if resolved is not None:
                    dtypes.add(resolved[1].dtype.name)
                request = parse_pod_request(parsed["pod"], settings)
                decision = decide(index, request, parse_pod_options(parsed["pod"], settings),
                                  candidates)  # fmt: skip
                fitting = [(entry.name, [[g.uuid for g in c] for c in fit.containers])
                           for entry, fit in islice(decision.fits(), 150)]  # fmt: skip
                if not fitting:
                    decision.explain_rest()
                out.append((fitting, sorted(decision.failed.items())))
        return out, dtypes

    with_library, widths = decided()
    assert "int32" in widths  # (read in place by the native resolver)
    monkeypatch.setattr(native_names, "library", lambda: None)
    monkeypatch.setattr(native_walk, "walk_function", lambda: None)
    without, widths = decided()
    assert "int32" not in widths
    assert without == with_library
    assert any(len(fitting) == 150 for fitting, _ in with_library)
    assert any(not fitting for fitting, _ in with_library)


@pytest.mark.parametrize("extra", [0, 1, 2, 3])
def test_what_c_cannot_order_at_any_lane_is_left_to_numpy(extra: int) -> None:
    """The first round reads an int32 list four positions at a time (AVX2 where the CPU has
    it) once its heap is full, and its last few one by one: a NaN key or a slot out of range
    at any of those places (the heap's first positions, each lane of a four, the last ones)
    makes C step aside; the same list without them is walked as numpy walks it."""
    rng = random.Random(40 + extra)
    n = NATIVE_FROM + extra
    c = case(rng, n, 2000)
    c["slots"] = np.array([rng.randrange(1999) for _ in range(n)], dtype=np.int32)
    c["scores"][1999] = np.nan  # (read only where a slot 1999 is put)
    for avoid_busy in (True, False):
        native, expected, _walk = walked_both(c, avoid_busy, np.int32)
        assert native == expected
    args = (c["scores"], c["sign"], None, bounds_of(c), numpy_possible(c), Addresses())
    places = [0, 7, 8, 9, 10, 11, 12, n // 2, n // 2 + 1, n // 2 + 2, n // 2 + 3,
              *range(n - 7, n)]  # fmt: skip
    for at in places:
        for bad in (1999, -1, 2000, np.iinfo(np.int32).max, np.iinfo(np.int32).min):
            broken = c["slots"].copy()
            broken[at] = bad
            assert native_walk.native_walk(broken, *args) is None, (at, bad)


@pytest.mark.parametrize("seed", range(6))
def test_keys_falling_along_the_list_enter_the_heap_lane_by_lane(seed: int) -> None:
    """Keys that fall along the list's start, not evenly (a four's lanes often below the
    heap's largest, some of them no longer once an earlier lane entered; ties), then stay
    above them: every lane offered in position order against the heap as it is then, so the
    head and every later round are numpy's."""
    rng = random.Random(seed)
    for _ in range(40):
        n = NATIVE_FROM + rng.randrange(64)
        sign = rng.choice([1.0, -1.0])
        spread, falls = rng.choice([4, 12, 30]), rng.randrange(12, 200)  # (then none enters)
        scores = sign * np.array([rng.randrange(spread) / 2 - (i / 4 if i < falls else -1e6)
                                  for i in range(n)])  # fmt: skip
        possible = np.array([rng.random() < 0.9 for _ in range(n)], dtype=np.int8)
        c = {"slots": np.arange(n, dtype=np.int32), "scores": scores, "sign": sign,
             "busy": np.zeros(n, dtype=bool), "bounds": [(possible, 1)]}  # fmt: skip
        for avoid_busy in (True, False):
            native, expected, _walk = walked_both(c, avoid_busy, np.int32)
            assert native == expected


@pytest.mark.parametrize("seed", range(12))
def test_the_first_round_in_six_arguments_is_the_eighteen_argument_round(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tn_walk_first` (the plan's arguments read from one array) walks every list as
    `tn_walk_round` given them one by one does (a build without it takes that path): same
    rounds, keys and busy flags, the same lists left to numpy."""
    rng = random.Random(100 + seed)
    n = (0, 9, 130, 1500)[seed % 4]
    total = rng.choice([3, 50, 4000])
    c = case(rng, n, total)
    if seed % 3 != 2:  # (every candidate possible: long walks)
        c["bounds"] = [(np.zeros(total, dtype=np.int32), 0)]
    bad = seed % 6 == 5
    if bad:
        c["slots"][rng.randrange(n)] = total  # (past every array: left to numpy)
    walks = []
    for first in (native_walk.first_function, lambda: None):
        monkeypatch.setattr(native_walk, "first_function", first)
        for width in (np.int32, np.int64):
            for busy in (c["busy"], None):
                walk = native_walk.native_walk(c["slots"].astype(width), c["scores"], c["sign"],
                                               busy, bounds_of(c), numpy_possible(c),
                                               Addresses(), shortest=0)  # fmt: skip
                walks.append(None if walk is None else (
                    walk.keys.tolist(), None if walk.busy is None else walk.busy.tolist(),
                    [(type(chunk), list(chunk)) for chunk in walk]))  # (the rounds apart)
    assert walks[:4] == walks[4:]
    assert (walks[0] is None) == bad


@pytest.mark.parametrize("where", ["none", "outside", "last slot", "first slot", "candidate"])
def test_busy_flags_anywhere_in_the_index_or_none(where: str) -> None:
    """The first round walks one group when no node of the index is busy (a pass over the
    flags, not one a candidate); a flag set anywhere, a candidate's or not, the first slot's
    or the last's, walks the two groups: numpy's order either way, the flags as numpy reads
    them (None where no candidate is busy)."""
    rng = random.Random(len(where))
    total = 3000
    c = case(rng, NATIVE_FROM + 77, total)
    c["slots"] = np.array(rng.sample(range(1, total - 1), NATIVE_FROM + 77), dtype=np.int64)
    busy = np.zeros(total, dtype=bool)
    outside = sorted(set(range(1, total - 1)) - set(c["slots"].tolist()))
    at = {"none": None, "outside": outside[len(outside) // 2], "last slot": total - 1,
          "first slot": 0, "candidate": int(c["slots"][NATIVE_FROM // 2])}[where]  # fmt: skip
    if at is not None:
        busy[at] = True
    if where.endswith("slot"):  # (a candidate too, at the arrays' either end)
        c["slots"][rng.randrange(len(c["slots"]))] = at
    c["busy"] = busy
    for width in (np.int32, np.int64):
        native, expected, walk = walked_both(c, True, width)
        assert native == expected
        assert (walk.busy is None) == (where in ("none", "outside"))


_SCALAR_CHILD = """
import random, sys
sys.path.insert(0, "tests")
import numpy as np
from scheduler.test_native_walk import case, walked_both
from tessera.scheduler.native_walk import NATIVE_FROM
walks = 0
for seed in range(60):
    rng = random.Random(seed)
    c = case(rng, rng.choice([NATIVE_FROM, NATIVE_FROM + 3, 2500]), rng.choice([50, 4000]))
    for avoid_busy in (True, False):
        native, expected, _walk = walked_both(c, avoid_busy, np.int32)
        assert native == expected, seed
        walks += 1
print("walks", walks)
"""


def test_the_scalar_first_round_is_numpys_where_avx2_would_take_it() -> None:
    """On an AVX2 machine an int32 list's first round runs vectorised; a process whose
    environment says `TESSERA_WALK_SCALAR=1` takes the scalar round instead (read once, by the
    library; the suite's own processes drop `TESSERA_*` variables, so a child checks it): its
    walks of adversarial int32 lists are numpy's too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _SCALAR_CHILD], cwd=root, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "TESSERA_WALK_SCALAR": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["walks", "120"]
