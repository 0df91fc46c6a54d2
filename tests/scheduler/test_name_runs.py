"""A candidate list that is kube-scheduler's node order with some nodes left out (its own filters
refused them) is read run by run (`NameOrder.runs`: a lookup and a few memcmps a run); whatever
the list, the result is exactly what resolving every name gives, or the fast path steps aside."""

from __future__ import annotations

import json
import random

import numpy as np
from tessera.scheduler.name_table import NameTable

from .test_node_names import compact, order_index

NAMES = [f"node-{i:05d}" for i in range(3000)]
# names that are prefixes of others, of mixed lengths, non-ASCII
MIXED = sorted({*(f"n{i}" for i in range(300)), *(f"n{i}0" for i in range(300)),
                "n", "gpu-ß-über-1", "ip-10-0-3-17.eu-west-1.compute.internal"})  # fmt: skip


def truth(table: NameTable, names: list[str]) -> list[int] | None:
    rows = [table.row_of(name) for name in names]
    return None if -1 in rows else rows


def check(table: NameTable, names: list[str]) -> tuple | None:
    """`runs` of the names' compact array: None, or exactly their rows and slots."""
    assert table.order is not None
    found = table.order.runs(compact(names))
    if found is not None:
        assert found[0].tolist() == truth(table, names)
        assert found[1].tolist() == table.slots[found[0]].tolist()
    return found


def test_the_order_with_nodes_left_out_is_read_run_by_run() -> None:
    table = NameTable(NAMES[::-1], list(range(5, 5 + len(NAMES))))  # (registered in any order)
    rng = random.Random(35)
    for start in (0, 1, 1499, 2999):
        rotated = NAMES[start:] + NAMES[:start]
        for dropped in (0, 1, 3, 5):  # (3,000 names: up to 10 runs are read run by run)
            edges = {0, len(NAMES) - 1} if dropped == 5 else set()
            gone = set(rng.sample(range(len(NAMES)), dropped)) | edges
            names = [n for i, n in enumerate(rotated) if i not in gone]
            assert check(table, names) is not None, (start, dropped)
    # a window: part of the order, wrapping, a node left out
    assert check(table, NAMES[2900:] + NAMES[:40] + NAMES[41:100]) is not None
    assert check(table, NAMES[7:8]) is not None
    # kube-scheduler's parallel order (runs of ~1 name): left to `NameTable.rows`, which reads it
    interleaved = [NAMES[k * 55 + i] for i in range(55) for k in range(16)]
    assert check(table, interleaved) is None
    assert table.rows(compact(interleaved)).tolist() == truth(table, interleaved)


def test_adversarial_lists_resolve_exactly_or_step_aside() -> None:
    for known in (NAMES, MIXED):
        table = NameTable(known, list(range(len(known))))
        rng = random.Random(7)
        n = len(known)
        cases = [
            known[10:200] + known[150:400],  # a duplicate run
            known[10:200] + known[10:200],  # the same run twice
            known[5:60] + known[60:61] * 3 + known[61:300],  # a name three times
            known[::-1][:100],  # reversed: runs of one name
            [*known[:n // 2], "ghost", *known[n // 2:]],  # an unknown name
            [*known[:50], known[50] + "x", *known[51:]],  # a known name's prefix + more
            [*known[:50], known[50][:-1], *known[51:]],  # a known name cut short
            [*known[:100], "", *known[100:]],  # an empty name
            known + known[:5],  # more names than the order
            [known[i] for i in rng.sample(range(n), 200)],  # no order at all
        ]
        for names in cases:
            found = check(table, names)
            if truth(table, names) is None:
                assert found is None, names[:3]
        # a run that stops mid-chunk at the array's end, and every prefix length of one
        for size in (1, 2, 3, 63, 64, 65, 141):
            assert check(table, known[17 : 17 + size]) is not None


def test_malformed_arrays_step_aside() -> None:
    table = NameTable(NAMES, list(range(len(NAMES))))
    assert table.order is not None
    good = compact(NAMES[:300] + NAMES[301:600])
    assert table.order.runs(good) is not None
    for bad in (
        good[:-1] + b",]",  # a trailing comma
        good.replace(b'","', b'", "', 1),  # a space (not compact: the general path reads it)
        good.replace(b'","', b'";"', 1),
        good.replace(b'"node-00299","node-00301"', b'"node-00299",,"node-00301"'),
        good.replace(b'"node-00299","node-00301"', b'"node-00299""node-00301"'),
        good.replace(b"node-00400", b"node-0\\u0030400"),  # an escape of the same name
        b'["node-00001"', b"[]", b'[""]', b'["node-00001","node-00002"',
    ):
        assert table.order.runs(bad) is None, bad[:40]


def test_the_index_reads_the_order_with_gaps_as_decoding_would() -> None:
    ordered = sorted(MIXED)
    index, slots = order_index(ordered[::-1])
    names = [n for i, n in enumerate(ordered[200:] + ordered[:200]) if i % 97]
    found = index.names_from_bytes(compact(names))  # type: ignore[attr-defined]
    assert found is not None
    assert list(found[0]) == json.loads(compact(names))
    assert found[1][1].tolist() == [slots[n] for n in names]


def test_names_past_the_first_level_resolve_exactly_by_overflow_or_levels(monkeypatch) -> None:
    """The names the first level does not hold are found by their hash in the sorted overflow;
    when two of them share a hash the table builds more levels instead: either way every list
    resolves exactly, and a name that only shares a registered name's hash is no node. (The
    numpy path, `numpy_rows`: the native resolver has its own table, test_native_names.py.)"""
    known = MIXED + [f"node-{i:05d}" for i in range(2000)]
    rng = random.Random(3)

    def resolves_exactly(table: NameTable) -> None:
        shuffled = rng.sample(known, len(known))
        assert table.numpy_rows(compact(shuffled)).tolist() == truth(table, shuffled)
        some = known[:40] + known[-40:]
        assert table.numpy_rows(compact(some)).tolist() == truth(table, some)
        for stranger in ("node-99999", "n9999", "node-0000", "node-000000"):
            assert table.numpy_rows(compact([*known[:10], stranger])) is None

    plain = NameTable(known, list(range(len(known))))
    assert plain.overflow is not None and len(plain.levels) == 2
    resolves_exactly(plain)
    real = NameTable._hash
    for bits in range(20, 13, -1):  # a hash of `bits` bits: overflow names share one
        top = np.uint64(64 - bits)
        monkeypatch.setattr(NameTable, "_hash", lambda self, w, n, t=top: real(self, w, n) >> t)
        weak = NameTable(known, list(range(len(known))))
        if weak.overflow is None and weak.usable:
            assert len(weak.levels) > 2
            resolves_exactly(weak)  # (looked up with the same weak hash)
            return
    raise AssertionError("no hash width gave overflow names a shared hash")


def test_lists_in_a_new_order_each_time_rest_the_run_looks_and_runs_are_found_again() -> None:
    """kube-scheduler's parallel filters send every list in a new interleaved order: after
    `RUN_TRIES` such lists in a row only one in `RUN_TRIES` is looked at as runs (the looks
    cost more than they find), and a list in the node order is read as a run again within
    that many lists. Every list resolves to the same names and slots, whichever path reads it."""
    from tessera.scheduler.index import ClusterIndex
    from tessera.scheduler.name_table import RUN_TRIES

    from .factories import node

    index = ClusterIndex()
    names = [f"node-{i:05d}" for i in range(1200)]
    for name in names:
        index.set_registration(name, node(name, gpus=1), 0.0)
    rng = random.Random(4)
    order = index.name_table()[1].order
    assert order is not None

    def resolved(listed: list[str]) -> list[int]:
        found = index.names_from_bytes(compact(listed))
        assert found is not None and list(found[0]) == listed
        return found[1][1].tolist()

    for _ in range(RUN_TRIES + 1):
        shuffled = rng.sample(names, len(names))
        assert index.names_of_run(compact(shuffled)) is None
        assert resolved(shuffled) == [index.slot_of[n] for n in shuffled]
    assert order.resting()
    in_order = names[300:] + names[:300]
    looked = []
    for _ in range(RUN_TRIES):
        looked.append(index.names_of_run(compact(in_order)) is not None)
        assert resolved(in_order) == [index.slot_of[n] for n in in_order]
        if looked[-1]:
            break
    assert looked[-1] and not looked[0]  # (rested first, found again within RUN_TRIES lists)
    assert not order.resting()


def test_a_head_of_three_single_runs_is_answered_as_its_runs_would_answer_it() -> None:
    """`NameOrder.starts_with_runs` answers a head whose first three names are three runs of
    one name from those names alone: the answer is `runs`' on the head, whatever the list
    (kube-scheduler's parallel order, runs with gaps near the front, the order's wrap, a name
    twice, names too long for the rate check, unknown names)."""
    from tessera.scheduler.name_table import _HEAD_BYTES

    long_names = sorted(f"{'x' * 300}-{i:04d}" for i in range(400))
    shortcut = 0
    for known in (NAMES, MIXED, long_names):
        table = NameTable(known, list(range(len(known))))
        order = table.order
        assert order is not None
        rng = random.Random(len(known))
        n = len(known)
        lists = []
        for _ in range(60):
            chunk = rng.randrange(1, 60)
            starts = rng.sample(range(0, n, chunk), min(16, len(range(0, n, chunk))))
            runs = [[known[(s + i) % n] for i in range(chunk)] for s in starts]
            lists.append([run[i] for i in range(chunk) for run in runs])  # (interleaved)
            s = rng.randrange(n)
            ordered = known[s:] + known[:s]
            lists.append(ordered)
            gaps = sorted(rng.sample(range(40), rng.randrange(1, 6)))
            lists.append([name for i, name in enumerate(ordered) if i not in gaps])
            front = rng.sample(known, 3)
            lists.append(front + ordered[: rng.randrange(1, 400)])
            lists.append([*front[:2], front[1], *ordered[:300]])  # (a name twice)
            lists.append(known[-2:] + known[:300])  # (the order's wrap)
            lists.append([*front, "unregistered", *ordered[:300]])
        for listed in lists:
            array = compact(listed)
            body = b'{"pod":{},"nodenames":' + array + b"}"
            start = body.index(b"[")
            end = start + len(array)
            cut = body.rfind(b'","', start, min(end, start + _HEAD_BYTES))
            whole = end - start <= _HEAD_BYTES or cut < 0
            head = body[start:end] if whole else body[start : cut + 1] + b"]"
            expected = order.runs(head) is not None
            if order._three_single_runs(body, start, len(head) - 1):
                shortcut += 1
                assert not expected, listed[:4]
            assert order.starts_with_runs(body, start, end) == expected, listed[:4]
    assert shortcut > 100  # (the parallel order's lists, among others, take the shortcut)
