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
