"""The native resolver's guesses for kube-scheduler's parallel lists (native/names/src/names.c):
cursors set at once for the chunks its 16 workers start with, the next chunk's first name
tried before the hash table, and the names after the last few found there (runs whose cursor
keys collide name after name). Each is a guess checked byte for byte: every list here, made to
meet the guesses, to miss them and to break them, resolves as the numpy path and decoding
say (`same_as_numpy`), or steps aside in both."""

from __future__ import annotations

import math
import random

import pytest
from tessera.scheduler.name_table import NameTable

from .test_native_names import built, same_as_numpy  # noqa: F401  (the library, built)
from .test_node_names import compact

WORKERS = 16
MUL = 0x9E3779B97F4A7C15


def chunk_size(count: int) -> int:
    """kube-scheduler's `chunkSizeFor` over `count` nodes (as the resolver guesses it)."""
    return max(1, min(math.isqrt(count), count // WORKERS + 1))


def parallel(ordered: list[str], start: int, chunk: int, rng: random.Random,
             keep: float = 1.0, find: int | None = None) -> list[str]:  # fmt: skip
    """kube-scheduler's parallel filters' list: the order from `start` in chunks of `chunk`,
    each worker appending its chunk's names in order and taking the next chunk when done, at
    random times; a name kept with probability `keep` (its filters refuse the others); at
    most `find` names."""
    count = len(ordered)
    chunks = [(at, min(count, at + chunk)) for at in range(0, count, chunk)]
    working = [list(c) for c in chunks[:WORKERS]]
    taken = len(working)
    out: list[str] = []
    while working and (find is None or len(out) < find):
        worker = working[rng.randrange(len(working))]
        name = ordered[(start + worker[0]) % count]
        if rng.random() < keep:
            out.append(name)
        worker[0] += 1
        if worker[0] == worker[1]:
            if taken < len(chunks):
                worker[:] = chunks[taken]
                taken += 1
            else:
                working.remove(worker)
    return out


def key(name: bytes) -> int:
    """The resolver's cursor key of a name of 8 to 16 bytes (`tn_key`: its last 8 bytes)."""
    tail = int.from_bytes(name[-8:], "little")
    return (((tail ^ len(name)) * MUL) % 2**64) >> 54


def table_of(names: list[str]) -> NameTable:
    table = NameTable(random.Random(len(names)).sample(names, len(names)),
                      [5 + 2 * i for i in range(len(names))])  # fmt: skip
    assert table.native is not None and table.usable
    return table


SIZES = [1, 2, 15, 16, 17, 33, 100, 257, 1000, 3001]


@pytest.mark.parametrize("count", SIZES)
def test_kube_schedulers_parallel_lists_resolve_exactly_at_every_size(count: int) -> None:
    """Full lists, windows, lists with refused nodes, from every kind of start (0, the last
    node, random: wrapping past the order's end), with the chunk size kube-scheduler uses and
    others (the resolver's guess then misses): the same slots as the numpy path."""
    names = [f"node-{i:05d}" for i in range(count)]
    table = table_of(names)
    rng = random.Random(count)
    for start in {0, count - 1, rng.randrange(count), rng.randrange(count)}:
        for chunk in {chunk_size(count), max(1, chunk_size(count) - 1), chunk_size(count) + 3}:
            for keep, find in ((1.0, None), (1.0, max(1, count // 4)), (0.9, None),
                               (0.5, None)):  # fmt: skip
                listed = parallel(names, start, chunk, rng, keep, find)
                if listed:
                    assert same_as_numpy(table, compact(listed)) is not None, (start, chunk)


@pytest.mark.parametrize("count", [17, 257, 3001])
def test_a_chunks_first_name_missing_moved_or_unknown_is_still_exact(count: int) -> None:
    """The names the guesses expect (each chunk's first) dropped, given twice, swapped with
    another, put first, or replaced by a name not in the table (the list then steps aside in
    both paths): exact, or refused by both."""
    names = [f"node-{i:05d}" for i in range(count)]
    table = table_of(names)
    chunk = chunk_size(count)
    firsts = {names[(7 + at) % count] for at in range(0, count, chunk)}
    rng = random.Random(count + 1)
    for _ in range(12):
        listed = parallel(names, 7, chunk, rng)
        at = [i for i, n in enumerate(listed) if n in firsts]
        pick = rng.sample(at, min(3, len(at)))
        cases = [
            [n for i, n in enumerate(listed) if i not in pick],
            [*listed[: pick[0] + 1], listed[pick[0]], *listed[pick[0] + 1 :]],
            [listed[pick[-1]], *listed],
            listed[:-1] if len(listed) > 1 else listed,
        ]
        if len(pick) > 1:
            swapped = list(listed)
            swapped[pick[0]], swapped[pick[1]] = swapped[pick[1]], swapped[pick[0]]
            cases.append(swapped)
        unknown = list(listed)
        unknown[pick[0]] = "node-99999"
        cases.append(unknown)
        longer = list(listed)
        longer[pick[0]] = listed[pick[0]] + "0"  # (a name the table lacks, one byte longer)
        cases.append(longer)
        for case in cases:
            same_as_numpy(table, compact(case))


def colliding_runs(names: list[str], length: int) -> list[tuple[int, int]]:
    """Pairs of positions whose runs of `length` names have the same cursor key name after
    name (each run takes the other's cursors)."""
    keys = [key(n.encode()) for n in names]
    at_key: dict[int, list[int]] = {}
    for position, k in enumerate(keys[: len(names) - length]):
        at_key.setdefault(k, []).append(position)
    pairs = []
    for a in range(0, len(names) - length, 97):
        b = next((b for b in at_key[keys[a]] if b >= a + length
                  and keys[a : a + length] == keys[b : b + length]), None)  # fmt: skip
        if b is not None:
            pairs.append((a, b))
        if len(pairs) >= 6:
            break
    return pairs


def test_runs_whose_keys_collide_name_after_name_resolve_exactly() -> None:
    """Two (and more) runs whose every name has the key of the other run's name beside it,
    interleaved among others, across the order's end and with names dropped or unknown: each
    name resolves to its own slot, as the numpy path says."""
    names = [f"node-{i:05d}" for i in range(20_000)]
    table = table_of(names)
    pairs = colliding_runs(names, 8)
    assert pairs, "no colliding runs found"  # (the key is fixed: found every time)
    rng = random.Random(9)
    for a, b in pairs:
        runs = [names[a : a + 40], names[b : b + 40]]
        runs += [names[s : s + 40] for s in rng.sample(range(len(names) - 40), 6)]
        for listed in (interleave_evenly(runs),
                       interleave_evenly(runs[:2]),
                       interleave_evenly([names[-20:] + names[:20], runs[1]]),
                       [n for i, n in enumerate(interleave_evenly(runs)) if i % 11],
                       [*interleave_evenly(runs)[:30], "node-99999"]):  # fmt: skip
            same_as_numpy(table, compact(listed))


def interleave_evenly(runs: list[list[str]]) -> list[str]:
    """The runs merged one name of each in turn (every run's next cursor taken before it is
    read when their keys collide)."""
    out: list[str] = []
    for i in range(max(map(len, runs))):
        out.extend(run[i] for run in runs if i < len(run))
    return out


def test_lists_of_long_and_short_names_meet_the_guesses_exactly() -> None:
    """Names shorter than 8 bytes and longer than 16 are compared with the table's bytes, not
    its words: kube-scheduler's lists of such names, and damaged ones, resolve exactly."""
    names = sorted({*(f"n{i}" for i in range(400)),
                    *(f"ip-10-0-{i // 250}-{i % 250}.eu-west-1.compute.internal"
                      for i in range(600))})  # fmt: skip
    table = table_of(names)
    ordered = sorted(names, key=str.encode)
    rng = random.Random(12)
    for start in (0, len(ordered) - 3, rng.randrange(len(ordered))):
        listed = parallel(ordered, start, chunk_size(len(ordered)), rng)
        assert same_as_numpy(table, compact(listed)) is not None
        listed[rng.randrange(len(listed))] = "ip-10-0-9-9.eu-west-1.compute.internal"
        assert same_as_numpy(table, compact(listed)) is None
