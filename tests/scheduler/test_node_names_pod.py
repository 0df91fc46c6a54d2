"""The pod of a filter call is decoded where it lies in the body when the body is ExtenderArgs as
kube-scheduler writes it (`{"Pod":...,"Nodes":null,"NodeNames":[...]}`, no JSON tags) or as
kube-sim does (`{"pod":...,"nodenames":[...]}`): the same members, in the same order, as the old
path (the array cut out, the rest decoded) and as parsing the whole body; anything else steps
aside to the old path."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tessera.scheduler import node_names
from tessera.scheduler.node_names import NodeNames, NodeNamesCache

NAMES = [f"node-{i:05d}" for i in range(600)]
WS = ["", " ", "\n", "\t ", "\r\n  "]
# Strings a pod may hold that look like the members around the array.
TRICKY = ['"NodeNames":[', '"Nodes": null,', "null", "}", "{", "]", ",", '\\"pod\\":',
          "\u0000tessera-nodenames", "ames\"", "é", "\U0001f600"]  # fmt: skip


def full(body: bytes) -> dict[str, Any]:
    return {str(k).lower(): v for k, v in json.loads(body).items()}


def old_path(body: bytes, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any] | None:
    with monkeypatch.context() as patched:
        patched.setattr(node_names, "_pod_around", lambda *_args: None)
        return NodeNamesCache(100_000).parse(body)


def value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.3:
        return rng.choice([0, -1, 2.5, 1e20, True, False, None, "x", rng.choice(TRICKY)])
    if roll < 0.6:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "nodenames", "NodeNames", "pod", "Nodes", rng.choice(TRICKY)]):
            value(rng, depth + 1) for _ in range(rng.randint(0, 4))}  # fmt: skip


def dumps(data: Any, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return json.dumps(data, separators=(",", ":"))
    return json.dumps(data, indent=rng.choice([None, 1, 2]), ensure_ascii=rng.random() < 0.5)


def body_of(rng: random.Random) -> bytes:
    pod = {"metadata": {"name": "p", "annotations": {"a": rng.choice(TRICKY)}},
           "spec": value(rng)}  # fmt: skip
    if rng.random() < 0.1:
        pod = value(rng)  # (not a pod object: the service refuses it; the parse reads it alike)
    names = rng.sample(NAMES, rng.randint(450, 600))
    w = lambda: rng.choice(WS)  # noqa: E731
    pod_key = rng.choice(['"Pod"', '"pod"'])
    nodes = rng.choice(["", f'{w()}"Nodes"{w()}:{w()}null{w()},', f'"nodes":{w()}null,'])
    key = rng.choice(['"NodeNames"', '"nodenames"'])
    text = (f"{w()}{{{w()}{pod_key}{w()}:{w()}{dumps(pod, rng)}{w()},{w()}{nodes}{w()}{key}{w()}:"
            f"{w()}{json.dumps(names, separators=(',', ':'))}{w()}}}{w()}")
    return text.encode()


def test_kube_scheduler_bodies_read_as_the_old_path_and_the_whole_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(35)
    cache = NodeNamesCache(100_000)
    around = 0
    for _ in range(400):
        body = body_of(rng)
        start = cache._start(body)
        assert start is not None
        got = cache.parse(body)
        reference = old_path(body, monkeypatch)
        if got is None:  # (a `"NodeNames":[` inside the pod: both step aside)
            assert reference is None
            continue
        assert got == full(body) and list(got) == list(full(body))  # (members in order too)
        if reference is not None:  # (the old path steps aside where the pod holds its placeholder)
            assert got == reference and list(got) == list(reference)
        assert isinstance(got["nodenames"], NodeNames)
        end = start + len(json.dumps(got["nodenames"][:], separators=(",", ":")))
        around += node_names._pod_around(body, start, end) is not None
    assert around > 300  # (most such bodies read the new way)


POD = '{"metadata":{"name":"p"},"spec":{"containers":[]}}'
ARRAY = json.dumps(NAMES, separators=(",", ":"))


@pytest.mark.parametrize(
    "text",
    [
        f'{{"Pod":{POD},"Nodes":null,"NodeNames":{ARRAY}}}',
        f'{{"pod": {POD}, "nodenames": {ARRAY}}}',
        f'{{"Pod":{POD},"Nodes":null,"NodeNames":{ARRAY},"x":1}}',  # a member after the array
        f'{{"Pod":{POD},"Nodes":null,"NodeNames":{ARRAY}}}x',  # bytes after the object
        f'{{"Pod":{POD},"Nodes":null,"NodeNames":{ARRAY}}}}}',
        f'{{"Pod":{POD},"Nodes":{{}},"NodeNames":{ARRAY}}}',  # Nodes not null
        f'{{"Pod":{POD},"Nodes":nul,"NodeNames":{ARRAY}}}',
        f'{{"Pod":{POD},"Nodes":null "NodeNames":{ARRAY}}}',
        f'{{"Pod":{POD},"x":null,"NodeNames":{ARRAY}}}',  # another member
        f'{{"Pod":{POD},,"NodeNames":{ARRAY}}}',
        f'{{"Pod":{POD}"NodeNames":{ARRAY}}}',
        f'{{"POD":{POD},"NodeNames":{ARRAY}}}',  # (the old path lower-cases it)
        f'{{"Pod":{POD},"NODENAMES":{ARRAY}}}',
        f'{{"Pod":{POD},"NodeNames":{ARRAY},"NodeNames":{ARRAY}}}',  # twice
        f'{{"nodenames":[],"Pod":{POD},"NodeNames":{ARRAY}}}',
        f'{{"Pod":{POD[:-1]},"NodeNames":{ARRAY}}}',  # the pod cut short
        f'{{"Pod":{POD}}},"NodeNames":{ARRAY}}}',  # a brace too many
        f'{{"Pod":{POD} {POD},"NodeNames":{ARRAY}}}',  # two values
        f'{{"Pod":,"NodeNames":{ARRAY}}}',  # no value
        f'{{"Pod":NaN,"NodeNames":{ARRAY}}}',  # json's to read
        f'{{"Pod":{{"x":1e400}},"NodeNames":{ARRAY}}}',
        f'{{"Pod":{{"x":"\\ud800"}},"NodeNames":{ARRAY}}}',  # a lone surrogate
        f'{{"Pod":{"[" * 5000 + "]" * 5000},"NodeNames":{ARRAY}}}',  # deep
        f'{{"Pod":"{"a" * 100}","Nodes":null,"NodeNames":{ARRAY}}}',  # a string
        f'{{"Pod":12,"NodeNames":{ARRAY}}}',
        f'{{"Pod":null,"Nodes":null,"NodeNames":{ARRAY}}}',
        f'[{{"Pod":{POD},"NodeNames":{ARRAY}}}]',
        f'{{"Pod":{POD},"NodeNames":{ARRAY[:-1]}}}',  # the array unclosed
        f'{{"Pod":{POD},"NodeNames":{ARRAY}',  # the object unclosed
        f'{{"Pod":{{"spec":{{"a":"NodeNames\\":["}}}},"NodeNames":{ARRAY}}}',
        f'{{"Pod":{{"Nodes":null,"NodeNames":{ARRAY}}},"NodeNames":{ARRAY}}}',
        f'{{"Pod":{POD},"Nodes":null,"NodeNames":{ARRAY}}}'.replace('"Pod"', '"P\\u006fd"'),
    ],
)
def test_other_bodies_read_as_the_whole_body_or_step_aside(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = text.encode()
    try:
        whole: dict[str, Any] | None = full(body)
    except (ValueError, RecursionError, AttributeError):
        whole = None  # (not a JSON object: the fast path must step aside)
    cache = NodeNamesCache(100_000)
    for _ in range(2):  # first sight, then the remembered list
        got = cache.parse(body)
        reference = old_path(body, monkeypatch)
        if got is None:
            assert reference is None
            continue
        assert whole is not None
        assert got == whole and list(got) == list(whole)
        if reference is not None:
            assert got == reference and list(got) == list(reference)


def test_the_pod_is_a_new_object_each_call() -> None:
    cache = NodeNamesCache(100_000)
    body = f'{{"Pod":{POD},"Nodes":null,"NodeNames":{ARRAY}}}'.encode()
    one, two = cache.parse(body), cache.parse(body)
    assert one is not None and two is not None
    assert one["pod"] == two["pod"] and one["pod"] is not two["pod"]
    assert list(one) == ["pod", "nodes", "nodenames"] and one["nodes"] is None
