"""The candidate list of a filter call is parsed once per distinct list; whatever the body, the
result is what parsing the whole body gives (or the fast path steps aside)."""

from __future__ import annotations

import json
import random

import pytest
from tessera.scheduler.node_names import NodeNames, NodeNamesCache

NAMES = [f"node-{i:05d}" for i in range(1000)]
POD = {"metadata": {"name": "p", "uid": "u1", "annotations": {"a": "nodenames"}}}


def full(body: bytes) -> dict:
    return {str(k).lower(): v for k, v in json.loads(body).items()}


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"pod": POD, "nodenames": NAMES}),
        json.dumps({"nodenames": NAMES, "pod": POD}, indent=2),
        # A nested key of the same name after the real one: not taken for it.
        json.dumps({"nodenames": NAMES, "pod": {**POD, "nodenames": NAMES[:600]}}),
        # Two top-level spellings: the later one wins, as in the plain parse.
        json.dumps({"NodeNames": NAMES[:500], "nodenames": NAMES}),
        '{"nodenames": ' + json.dumps(NAMES) + ', "NodeNames": ' + json.dumps(NAMES[:500]) + "}",
        # A name with a bracket: the cut is not the whole array.
        json.dumps({"pod": POD, "nodenames": ["a]b", *NAMES]}),
        # The placeholder itself in the pod.
        json.dumps({"pod": {"x": "\u0000tessera-nodenames"}, "nodenames": NAMES}),
        json.dumps({"pod": POD, "nodenames": [*NAMES, 5]}),
    ],
)
def test_same_result_as_parsing_the_whole_body(body: str) -> None:
    cache = NodeNamesCache(100_000)
    for _ in range(2):  # first sight, then the remembered list
        data = cache.parse(body.encode())
        if data is not None:
            assert data == full(body.encode())
            assert isinstance(data["nodenames"], NodeNames)


def test_a_repeated_list_keeps_its_token_and_a_new_one_gets_another() -> None:
    cache = NodeNamesCache(100_000)
    one = cache.parse(json.dumps({"pod": POD, "nodenames": NAMES}).encode())
    two = cache.parse(json.dumps({"pod": {**POD, "x": 1}, "nodenames": NAMES}).encode())
    other = cache.parse(json.dumps({"pod": POD, "nodenames": NAMES[::-1]}).encode())
    assert one and two and other
    assert one["nodenames"].token == two["nodenames"].token != other["nodenames"].token
    with pytest.raises(TypeError):  # one list shared by the calls: nobody may change it
        two["nodenames"].append("mutated")
    with pytest.raises(TypeError):
        two["nodenames"][0] = "mutated"
    again = cache.parse(json.dumps({"pod": POD, "nodenames": NAMES}).encode())
    assert again and again["nodenames"] == NAMES


def test_over_the_limit_is_left_to_the_plain_path() -> None:
    assert NodeNamesCache(10).parse(json.dumps({"pod": POD, "nodenames": NAMES}).encode()) is None


# --- a new list resolved from its bytes (NameTable) ---------------------------------------------

KNOWN = [f"node-{i:05d}" for i in range(800)] + ["ip-10-0-3-17.eu-west-1.compute.internal",
                                                 "gpu-ß-über-1", "a", "x" * 70]  # fmt: skip


def table_index() -> tuple[object, dict[str, int]]:
    from tessera.scheduler.index import ClusterIndex

    from tessera.models import DeviceInfo, NodeRegistration

    index = ClusterIndex()
    for name in KNOWN:
        device = DeviceInfo(uuid=f"GPU-{name}", index=0, type="T", memory_mib=1024, cores=100)
        index.set_registration(name, NodeRegistration(node=name, devices=[device]), 0.0)
    index.set_ledger("ledger-only", None, 1, 0.0)  # known to the index, not registered
    return index, {name: index.entries[name].slot for name in KNOWN}


@pytest.mark.parametrize(
    "names",
    [
        KNOWN,
        KNOWN[::-1],
        KNOWN[5:300] + KNOWN[:5],
        [KNOWN[3], KNOWN[3], KNOWN[801]],  # a name twice: two candidates, as parsed
        KNOWN[800:],  # long, non-ASCII, one byte
    ],
)
def test_a_list_of_registered_nodes_resolves_from_its_bytes(names: list[str]) -> None:
    index, slots = table_index()
    array = json.dumps(names, separators=(",", ":"), ensure_ascii=False).encode()
    found = index.names_from_bytes(array)  # type: ignore[attr-defined]
    assert found is not None
    got_names, (version, got_slots) = found
    assert got_names == json.loads(array) == names
    assert got_slots.tolist() == [slots[n] for n in names]
    assert version == index.topology_version  # type: ignore[attr-defined]
    # and a filter body with it: the same as parsing the whole body, resolved
    body = json.dumps({"pod": POD, "nodenames": names * (1 + 8192 // len(array))},
                      separators=(",", ":"), ensure_ascii=False).encode()  # fmt: skip
    data = NodeNamesCache(100_000, resolver=index.names_from_bytes, resolve_from=0).parse(body)  # type: ignore[attr-defined]
    assert data == full(body)
    assert data is not None and data["nodenames"].resolved is not None


@pytest.mark.parametrize(
    "array",
    [
        json.dumps([*KNOWN[:10], "ghost"], separators=(",", ":")),  # an unknown name
        json.dumps([*KNOWN[:10], "ledger-only"], separators=(",", ":")),  # not registered
        json.dumps(KNOWN[:10]),  # Python's ", " spacing: not the compact form
        json.dumps(KNOWN[:10], separators=(",", ":")).replace('"node-00001"', '"node-0000\\u0031"'),
        json.dumps([*KNOWN[:10], "node-00001\\u0000"], separators=(",", ":")),
        json.dumps([*KNOWN[:10], "node-0000"], separators=(",", ":")),  # a known name's prefix
        json.dumps([*KNOWN[:10], "node-000011"], separators=(",", ":")),  # ... and longer
        json.dumps([*KNOWN[:10], "x" * 80], separators=(",", ":")),  # longer than any known
        json.dumps([*KNOWN[:10], ""], separators=(",", ":")),
        "[]",
        '["node-00001",5]',
        '["node-00001","node-00002"',
        '["node-00001"]]',
        '["node-00001"\t]',
    ],
)
def test_what_the_bytes_cannot_prove_is_left_to_the_decoder(array: str) -> None:
    index, _slots = table_index()
    assert index.names_from_bytes(array.encode()) is None  # type: ignore[attr-defined]


def test_the_table_follows_registrations() -> None:
    index, _slots = table_index()
    array = json.dumps(KNOWN[:20], separators=(",", ":")).encode()
    assert index.names_from_bytes(array) is not None  # type: ignore[attr-defined]
    index.set_registration(KNOWN[7], None, 0.0)  # type: ignore[attr-defined]
    assert index.names_from_bytes(array) is None  # type: ignore[attr-defined]
    found = index.names_from_bytes(json.dumps(KNOWN[8:20], separators=(",", ":")).encode())  # type: ignore[attr-defined]
    assert found is not None and found[1][0] == index.topology_version  # type: ignore[attr-defined]


def test_a_rotated_list_is_read_as_the_rotation_it_is() -> None:
    """kube-scheduler scoring every node walks its list from a start that advances each cycle:
    a rotation of the last array is recognised (same names, same slots rolled), and anything
    that is not exactly one (a name gone, two swapped, another name first) is read as before."""
    index, slots = table_index()
    resolved: list[bytes] = []  # the arrays resolved name by name (NameTable)

    def resolver(array: bytes) -> object:
        resolved.append(array)
        return index.names_from_bytes(array)  # type: ignore[attr-defined]

    cache = NodeNamesCache(100_000, resolver=resolver, resolve_from=0)  # type: ignore[arg-type]

    def parsed(names: list[str]) -> dict:
        body = json.dumps({"pod": POD, "nodenames": names}, separators=(",", ":"),
                          ensure_ascii=False).encode()  # fmt: skip
        data = cache.parse(body)
        assert data == full(body)
        assert data is not None and data["nodenames"].resolved is not None
        assert data["nodenames"].resolved[1].tolist() == [slots[n] for n in names]
        return data

    tokens = {parsed(KNOWN)["nodenames"].token}
    for shift in (1, 17, 400, 801, len(KNOWN) - 1):  # (801 on: the long, non-ASCII ones first)
        rotated = KNOWN[shift:] + KNOWN[:shift]
        names = parsed(rotated)["nodenames"]
        assert list(names) == rotated and names.token not in tokens
        tokens.add(names.token)
    assert len(resolved) == 1  # (only the first: the rotations were read as rotations)
    swapped = KNOWN[1:]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    for other in (KNOWN[5:] + KNOWN[:4], swapped + KNOWN[:1], ["node-00000", *KNOWN[1:]][::-1]):
        assert list(parsed(other)["nodenames"]) == other
    assert len(resolved) == 4  # (each resolved name by name)


# --- a run of kube-scheduler's node order, and lists of equal-length names ------------------------

def order_index(names: list[str]) -> tuple[object, dict[str, int]]:
    from tessera.scheduler.index import ClusterIndex

    from tessera.models import DeviceInfo, NodeRegistration

    index = ClusterIndex()
    for name in names:
        device = DeviceInfo(uuid=f"GPU-{name}", index=0, type="T", memory_mib=1024, cores=100)
        index.set_registration(name, NodeRegistration(node=name, devices=[device]), 0.0)
    return index, {name: index.entries[name].slot for name in names}


def damaged(sample: bytes, rng: random.Random, damage: list[bytes]) -> bytes:
    """`sample` with one byte replaced by, one inserted from, or one deleted (rng's choice)."""
    at = rng.randrange(len(sample))
    change = rng.choice(damage)
    how = rng.randrange(3)
    if how == 0:
        return sample[:at] + change + sample[at + 1 :]
    if how == 1:
        return sample[:at] + change + sample[at:]
    return sample[:at] + sample[at + 1 :]


def compact(names: list[str]) -> bytes:
    return json.dumps(names, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_window_of_the_node_order_is_read_as_a_run_of_it() -> None:
    """kube-scheduler's window (its node order from a start that advances each cycle, wrapping)
    is a run of the names in order: read without resolving a name, the same names and slots as
    decoding it; what is not exactly a run (a name skipped, two swapped, a name twice, more
    names than nodes) is resolved name by name, still exactly."""
    ordered = sorted(KNOWN)
    registered = ordered[::-1]  # (the index's own order does not matter)
    index, slots = order_index(registered)
    count = len(ordered)
    starts, sizes = (0, 1, 400, count - 3, count - 1), (1, 2, 100, count)
    runs = [ordered[start : start + size] + ordered[: max(0, start + size - count)]
            for start in starts for size in sizes]  # fmt: skip
    for names in runs:
        found = index.names_of_run(compact(names))  # type: ignore[attr-defined]
        assert found is not None, names[:3]
        assert list(found[0]) == names and found[1][1].tolist() == [slots[n] for n in names]
    skipped = ordered[10:20] + ordered[21:30]
    swapped = ordered[10:30]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    for names in (skipped, swapped, ordered[5:9] + ordered[8:12], ordered + ordered[:2],
                  ordered[::-1][:50], [*ordered[3:5], "ghost"]):  # fmt: skip
        array = compact(names)
        assert index.names_of_run(array) is None  # type: ignore[attr-defined]
        found = index.names_from_bytes(array)  # type: ignore[attr-defined]
        if "ghost" in names:
            assert found is None
            continue
        assert found is not None
        assert list(found[0]) == json.loads(array) and found[1][1].tolist() == [
            slots[n] for n in names]  # fmt: skip


def test_a_run_through_the_filter_body_parses_as_the_whole_body() -> None:
    ordered = sorted(KNOWN)
    index, slots = order_index(ordered)
    cache = NodeNamesCache(100_000, resolver=index.names_from_bytes,  # type: ignore[attr-defined]
                           runs=index.names_of_run, resolve_from=0)  # type: ignore[attr-defined]
    for start in (0, 300, 790):
        names = ordered[start:] + ordered[:start]
        body = json.dumps({"pod": POD, "nodenames": names}, separators=(",", ":"),
                          ensure_ascii=False).encode()  # fmt: skip
        data = cache.parse(body)
        assert data == full(body)
        assert data is not None and data["nodenames"].resolved[1].tolist() == [
            slots[n] for n in names]  # fmt: skip
    index.set_registration(ordered[4], None, 0.0)  # type: ignore[attr-defined]
    gone = ordered[2:9]  # a name no longer registered: no run, and not resolved from the bytes
    assert index.names_of_run(compact(gone)) is None  # type: ignore[attr-defined]
    assert index.names_from_bytes(compact(gone)) is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("width", [1, 5, 8, 10, 17])
def test_lists_of_equal_length_names_resolve_exactly_or_step_aside(width: int) -> None:
    """Names of one length are read as a grid of the array's bytes. Random damage to such an
    array (a byte changed, added or dropped: quotes, commas, brackets, backslashes, controls,
    other bytes) is either resolved to exactly what decoding the array gives, or left to the
    decoder (None); never another list."""
    import random

    rng = random.Random(width)
    alphabet = "abcdefghij0123456789-."
    names = sorted({"".join(rng.choice(alphabet) for _ in range(width)) for _ in range(300)})
    index, slots = order_index(names)
    shuffled = names[:]
    rng.shuffle(shuffled)
    array = compact(shuffled)
    found = index.names_from_bytes(array)  # type: ignore[attr-defined]
    assert found is not None and list(found[0]) == shuffled
    assert found[1][1].tolist() == [slots[n] for n in shuffled]
    damage = [b'"', b",", b"]", b"[", b"\\", b"\x00", b" ", b"a", b"0", "é".encode()]
    resolved = 0
    for _ in range(400):
        size = min(len(names), rng.choice([1, 2, 3, 40]))
        sample = compact(rng.sample(names, size) if rng.random() < 0.5 else shuffled[:size])
        hurt = damaged(sample, rng, damage)
        found = index.names_from_bytes(hurt)  # type: ignore[attr-defined]
        if found is None:
            continue
        resolved += 1
        decoded = json.loads(hurt)
        assert list(found[0]) == decoded
        assert found[1][1].tolist() == [slots[n] for n in decoded]
    assert resolved  # (some damage leaves valid lists of known names: e.g. a dropped name)


@pytest.mark.parametrize(
    "pod",
    [
        '{"a":1,"a":2}',  # a repeated key: the last, as json
        '{"big":123456789012345678901234567890,"neg":-12345678901234567890123}',
        '{"inf":1e400}', '{"nan":NaN}', '{"x":"\\ud800"}',  # json's own extensions
        '{"f":[1.5e3,-0.0,1E2,0.1,5e-324],"s":"\\u00e9\\n\\"","t":true,"n":null}',
        "[" * 5000 + "]" * 5000,  # too deep for either: the whole body's parse decides
    ],
)
def test_the_rest_of_the_body_reads_as_json_reads_it(pod: str) -> None:
    body = ('{"pod": ' + pod + ', "nodenames": ' + json.dumps(NAMES) + "}").encode()
    cache = NodeNamesCache(100_000)
    try:
        expected = full(body)
    except RecursionError:
        assert cache.parse(body) is None
        return
    data = cache.parse(body)
    assert data is not None
    assert repr(data["pod"]) == repr(expected["pod"])  # (repr: nan, -0.0 and types compared)
    assert data == {**expected, "pod": data["pod"]}


def test_a_list_in_the_parallel_filters_order_resolves_exactly_and_no_stranger_does() -> None:
    """kube-scheduler's 16 filter workers each take chunks of consecutive nodes and append the
    nodes that pass as they finish, so a list is the node order's chunks interleaved in no
    fixed pattern. Such a list (and every permutation) is resolved name by name to exactly the
    slots of its names, whichever level of the name table holds each name; a name that is not
    registered, next to them, is never resolved to a node (the whole list steps aside)."""
    import random

    rng = random.Random(35)
    names = [f"node-{i:05d}" for i in range(3000)] + [
        f"ip-10-{i // 250}-{i % 250}-{i % 7}.eu-west-1.compute.internal" for i in range(2000)]
    index, slots = order_index(names)
    table = index.name_table()[1]  # type: ignore[attr-defined]
    # (names that met a taken bucket live in the overflow, or in later levels)
    assert table.overflow is not None or len(table.levels) > 1
    chunk = 70  # kube-scheduler's chunk at 5,000 nodes: min(sqrt(n), n / 16 + 1)
    start = 1234
    rotated = names[start:] + names[:start]
    streams = [rotated[k : k + chunk] for k in range(0, len(rotated), chunk)]
    working: list[list[str]] = [streams.pop(0) for _ in range(16)]
    interleaved: list[str] = []
    while working:  # workers finish in a random order; a worker done takes the next chunk
        worker = rng.randrange(len(working))
        interleaved.append(working[worker].pop(0))
        if not working[worker]:
            if streams:
                working[worker] = streams.pop(0)
            else:
                working.pop(worker)
    assert sorted(interleaved) == sorted(names) and interleaved != rotated
    for listed in (interleaved, interleaved[:250], rng.sample(names, 1000)):
        found = index.names_from_bytes(compact(listed))  # type: ignore[attr-defined]
        assert found is not None
        assert list(found[0]) == listed
        assert found[1][1].tolist() == [slots[n] for n in listed]
    strangers = [f"node-{i:05d}" for i in range(3000, 4500)] + [
        f"ip-10-{i}-0-0.eu-west-1.compute.internal" for i in range(100, 600)]
    for stranger in strangers:  # (many meet a taken bucket in the first level or later ones)
        at = rng.randrange(40)
        listed = [*interleaved[:at], stranger, *interleaved[at:40]]
        assert index.names_from_bytes(compact(listed)) is None  # type: ignore[attr-defined]


def test_rotations_are_found_again_after_lists_in_other_orders() -> None:
    """Lists in a new order every call (kube-scheduler's parallel filters) are not searched for
    as rotations every time; once lists are rotations again (its filters one at a time), they
    are read as rotations again within a few lists, every list exactly what decoding gives."""
    import random

    index, slots = table_index()
    resolved: list[bytes] = []

    def resolver(array: bytes) -> object:
        resolved.append(array)
        return index.names_from_bytes(array)  # type: ignore[attr-defined]

    cache = NodeNamesCache(100_000, resolver=resolver, resolve_from=0)  # type: ignore[arg-type]
    rng = random.Random(8)

    def parsed(names: list[str]) -> None:
        body = json.dumps({"pod": POD, "nodenames": names}, separators=(",", ":"),
                          ensure_ascii=False).encode()  # fmt: skip
        data = cache.parse(body)
        assert data == full(body)
        assert data is not None and data["nodenames"].resolved[1].tolist() == [
            slots[n] for n in names]  # fmt: skip

    names = KNOWN[:]
    for _ in range(21):
        rng.shuffle(names)
        parsed(names)
    assert len(resolved) == 21
    for shift in range(1, 13):
        parsed(names[shift:] + names[:shift])
    assert len(resolved) - 21 < 8  # (some read name by name before a rotation is looked for)
    before = len(resolved)
    for shift in range(13, 17):
        parsed(names[shift:] + names[:shift])
    assert len(resolved) == before  # (read as rotations again)
