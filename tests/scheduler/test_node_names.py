"""The candidate list of a filter call is parsed once per distinct list; whatever the body, the
result is what parsing the whole body gives (or the fast path steps aside)."""

from __future__ import annotations

import json

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
