"""A new `nodenames` array read where it lies in the request body (`NativeNames.slots_in`,
`ClusterIndex.names_in_body`, `NodeNamesCache`'s in-place path): no copy of the array and no
search for its end first, and exactly what cutting it out and reading it gives: the same slots,
the same end, the same step aside; the same parsed body as decoding the whole of it."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest
from tessera.scheduler.node_names import NodeNamesCache

from .test_native_names import MIXED, UNIFORM, built, lists_of, same_as_numpy, table_of
from .test_node_names import compact, damaged, full, order_index

__all__ = ["built"]  # (the library as `make native` builds it, for every test here)

# what a body holds around its array: kube-scheduler's order (the pod first), and another
# where a `]`, an array and the key itself follow it
AROUND = [(b'{"pod":{"metadata":{"name":"p"},"a":[1]},"nodenames":', b"}"),
          (b'{"nodenames":', b',"pod":{"nodenames":["x"],"b":"]"},"c":[]}')]  # fmt: skip


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_an_array_read_in_place_is_what_cutting_it_out_gives(names: list[str]) -> None:
    """Every list kube-scheduler sends (and some it never does, duplicates included), read in
    its body: the slots `resolve` gives the array cut out, and its end (a `]` inside a
    registered name, `a]b`, is not taken for it)."""
    table = table_of(names)
    assert table.native is not None
    for listed in lists_of(names, random.Random(36)):
        array = compact(listed)
        expected = same_as_numpy(table, array)
        assert expected is not None
        for before, after in AROUND:
            found = table.native.slots_in(before + array + after, len(before))
            assert found is not None
            assert found[0].tolist() == expected[1].tolist()
            assert found[1] == len(before) + len(array)


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_a_damaged_or_cut_short_body_is_read_exactly_or_not_at_all(names: list[str]) -> None:
    """A byte changed, added or dropped anywhere in the array, or the body cut short inside
    it: whenever the in-place read gives slots, the bytes up to the end it gives decode to
    exactly those names; anything it cannot prove gives None (the caller cuts the array out
    and decodes it)."""
    table = table_of(names)
    assert table.native is not None
    rng = random.Random(len(names) + 3)
    damage = [b'"', b",", b"]", b"[", b"\\", b"\x00", b"\x1f", b" ", b"a", b"0", "é".encode(),
              b"\xff"]  # fmt: skip
    sources = [compact(listed) for listed in lists_of(names, rng)]
    read = refused = 0
    for _ in range(600):
        source = rng.choice(sources)
        sample = compact(json.loads(source)[: rng.choice([1, 2, 3, 40, 400])])
        before, after = rng.choice(AROUND)
        if rng.random() < 0.2:
            body = before + sample[: rng.randrange(len(sample))]  # (cut short)
        else:
            body = before + damaged(sample, rng, damage) + after
        found = table.native.slots_in(body, len(before))
        if found is None:
            refused += 1
            continue
        read += 1
        slots, end = found
        decoded = json.loads(body[len(before) : end])
        assert table.names[table.row_of_slot[slots]].tolist() == decoded
        assert body[len(before) : end] == compact(decoded)  # (its compact form, no more)
    assert read and refused


def test_a_table_with_a_name_json_escapes_reads_no_array_in_place() -> None:
    """A registered name holding a backslash, a quote or a control character: the array's end
    is not known before a pass over it, so it is not read in place; cut out, it still is."""
    names = [*UNIFORM[:300], "odd\\name", 'q"uote', "tab\tname"]
    table = table_of(names)
    assert table.native is not None
    array = compact(UNIFORM[:300])
    body = b'{"nodenames":' + array + b"}"
    assert table.native.slots_in(body, 13) is None
    assert same_as_numpy(table, array) is not None


def counting(calls: dict[str, int], name: str, method: object) -> object:
    """`method`, its lists read (results not None) counted in `calls[name]`."""

    def call(*args: object) -> object:
        found = method(*args)  # type: ignore[operator]
        calls[name] += found is not None
        return found

    return call


def parallel_lists(names: list[str], rng: random.Random, count: int) -> list[list[str]]:
    """kube-scheduler's parallel filters' lists: `lists_of`'s interleaved one, anew each time."""
    return [lists_of(names, rng)[2] for _ in range(count)]


def counting_cache(index: object, calls: dict[str, int]) -> NodeNamesCache:
    """A `NodeNamesCache` as the service builds it, counting its resolver's and its in-place
    reader's calls into `calls`."""
    counted = partial(counting, calls)
    return NodeNamesCache(
        100_000, resolver=counted("resolver", index.names_from_bytes),  # type: ignore[attr-defined]
        runs=index.names_of_run,  # type: ignore[attr-defined]
        in_place=counted("in_place", index.names_in_body),  # type: ignore[attr-defined]
    )  # fmt: skip


def parsed_as_decoded(cache, pod: dict, slots: dict[str, int], listed: list[str]) -> object:
    """The body of `listed` parsed by the cache: exactly what decoding it whole gives, its names
    resolved to their slots; its NodeNames."""
    body = json.dumps({"pod": pod, "nodenames": listed}, separators=(",", ":")).encode()
    data = cache.parse(body)
    assert data == full(body)
    assert data is not None
    assert data["nodenames"].resolved[1].tolist() == [slots[n] for n in listed]
    return data["nodenames"]


def test_the_cache_reads_new_lists_in_place_and_finds_them_and_their_rotations_again() -> None:
    """Through `NodeNamesCache` as the service builds it: lists in a new order every call are
    read in place once runs and rotations rest (the first ones cut out and looked at), each
    body parsed as decoding it whole; a list sent again is found without reading it; once
    lists are rotations of one read in place, they are read as rotations again."""
    names = UNIFORM
    index, slots = order_index(names)
    calls = {"in_place": 0, "resolver": 0}
    cache = counting_cache(index, calls)
    pod = {"metadata": {"name": "p", "uid": "u1"}, "spec": {"containers": []}}

    def parsed(listed: list[str]) -> object:
        return parsed_as_decoded(cache, pod, slots, listed)

    rng = random.Random(9)
    lists = parallel_lists(names, rng, 40)
    for listed in lists:
        parsed(listed)
    assert calls["in_place"] >= 25  # (every list but the looked-at ones)
    assert calls["resolver"] >= 8  # (the first lists, cut out)
    again = parsed(lists[-1])  # the same bytes: found, not read
    assert again.token == parsed(lists[-1]).token
    before = dict(calls)
    last = lists[-1]
    for shift in range(1, 13):
        parsed(last[shift:] + last[:shift])
    after_looks = dict(calls)
    assert after_looks["resolver"] - before["resolver"] < 8
    for shift in range(13, 17):
        parsed(last[shift:] + last[:shift])
    assert calls == after_looks  # (read as rotations again: no resolver, nothing in place)
    # a list the resolver cannot read in place (a stranger in it) is decoded whole
    body = json.dumps({"pod": pod, "nodenames": [*last[:500], "ghost"]}).encode()
    assert cache.parse(body) in (None, full(body))


def test_lists_in_the_node_order_are_read_as_runs_again_after_lists_read_in_place() -> None:
    """After lists read in place (the parallel order), lists that are runs of the node order
    again (kube-scheduler's filters one at a time, its window moving on) are found again as
    runs within a few lists, read with no name resolved, each exactly what decoding gives."""
    names = UNIFORM
    index, slots = order_index(names)
    calls = {"in_place": 0, "resolver": 0}
    cache = counting_cache(index, calls)
    pod = {"metadata": {"name": "p", "uid": "u2"}}

    def parsed(listed: list[str]) -> None:
        parsed_as_decoded(cache, pod, slots, listed)

    for listed in parallel_lists(names, random.Random(10), 30):
        parsed(listed)
    ordered = sorted(names)
    for k in range(12):  # windows of 900 names of the node order, moving on
        start = 250 * k
        parsed((ordered[start:] + ordered[:start])[:900])
    before = dict(calls)
    for k in range(12, 16):
        start = 250 * k
        parsed((ordered[start:] + ordered[:start])[:900])
    assert calls == before  # (runs: no name resolved, nothing read in place)
