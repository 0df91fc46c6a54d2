"""kube-scheduler's failedNodes built lazily (`node_reasons.py`): the same map, the same reply
bytes, and a FilteringFailed message bounded to an event's 1 kB note whatever the nodes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tessera.scheduler import failed_nodes_json
from tessera.scheduler.kube_events import EVENT_NOTE_LIMIT, refusal_message
from tessera.scheduler.node_reasons import NodeReasons, encode_compact

TEXTS = np.array([None, "8/8 CardInsufficientMemory",
                  "3/8 CardInsufficientMemory, 5/8 CardInsufficientCore"], dtype=object)
REASONS = [(), ("CardInsufficientMemory",), ("CardInsufficientMemory", "CardInsufficientCore")]


def built(plan: list[tuple[str, list[tuple[str, int]]]]) -> tuple[NodeReasons, dict[str, str]]:
    """A NodeReasons written as the decision writes it, and the dict the decision used to."""
    lazy, eager = NodeReasons(), {}
    for kind, entries in plan:
        if kind == "one":
            for name, reason in entries:
                text = str(TEXTS[reason or 1])
                lazy.add(name, text)
                eager[name] = text
        else:
            names = np.empty(len(entries), dtype=object)
            names[:] = [n for n, _ in entries]
            ids = np.array([r for _, r in entries], dtype=np.int64)
            lazy.add_bulk(names, ids, TEXTS, REASONS)
            eager.update((n, TEXTS[r]) for n, r in entries if r)
    return lazy, eager


names = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FFF,
                                       exclude_categories=("Cs",)), min_size=1, max_size=12)



@st.composite
def plans(draw: st.DrawFn) -> list[tuple[str, list[tuple[str, int]]]]:
    """Runs of nodes worded one by one or in bulk, each node worded once (as a decision does:
    kube-scheduler lists each node once)."""
    nodes = draw(st.lists(names, unique=True, max_size=40))
    plan, at = [], 0
    while at < len(nodes):
        size = draw(st.integers(1, 8))
        run = [(n, draw(st.integers(0, 2))) for n in nodes[at : at + size]]
        plan.append((draw(st.sampled_from(["one", "bulk"])), run))
        at += size
    return plan


@settings(max_examples=150, deadline=None)
@given(plans())
def test_the_lazy_map_is_the_dict_the_decision_built(plan: list) -> None:
    lazy, eager = built(plan)
    assert bool(lazy) == bool(eager)
    assert lazy.texts() == set(eager.values())
    assert lazy.head(3) == dict(list(eager.items())[:3])
    again, _ = built(plan)
    assert lazy == again  # (read segment by segment, not built)
    assert lazy == eager and eager == lazy
    assert list(lazy.items()) == list(eager.items())  # same order
    # the reply's bytes: what json.dumps wrote for the dict
    assert lazy.to_json() == json.dumps(eager, ensure_ascii=False,
                                        separators=(",", ":")).encode()  # fmt: skip


def test_equality_sees_a_different_reason_or_node() -> None:
    base = [("bulk", [("a", 1), ("b", 2), ("c", 0)]), ("one", [("d", 1)])]
    first, _ = built(base)
    other, _ = built([("bulk", [("a", 1), ("b", 1), ("c", 0)]), ("one", [("d", 1)])])
    assert first != other
    renamed, _ = built([("bulk", [("a", 1), ("x", 2), ("c", 0)]), ("one", [("d", 1)])])
    assert first != renamed
    shuffled, _ = built([("one", [("d", 1)]), ("bulk", [("b", 2), ("a", 1)])])
    assert first == shuffled  # (a dict's equality: order aside)


def table_rows(names: list[str]) -> tuple[object, dict[str, int]]:
    from tessera.scheduler.name_table import NameTable

    table = NameTable(names, list(range(len(names))))
    return table, {n: i for i, n in enumerate(names)}


def with_rows(plan: list[tuple[str, list[tuple[str, int]]]], table: object,
              row: dict[str, int], named: bool = True) -> NodeReasons:
    """`built`, the bulk runs carrying their names' rows in a name table (as the decision's
    do when the index's table is current); not `named`: the rows alone (the names read from
    the table when asked, as the decision gives them)."""
    lazy = NodeReasons()
    for kind, entries in plan:
        if kind == "one":
            for name, reason in entries:
                lazy.add(name, str(TEXTS[reason or 1]))
        else:
            names = np.empty(len(entries), dtype=object)
            names[:] = [n for n, _ in entries]
            ids = np.array([r for _, r in entries], dtype=np.int64)
            rows = np.array([row[n] for n, _ in entries], dtype=np.int64)
            lazy.add_bulk(names if named else None, ids, TEXTS, REASONS, (table, rows))
    return lazy


@settings(max_examples=100, deadline=None)
@given(plans())
def test_runs_given_by_rows_alone_read_as_the_dict(plan: list) -> None:
    """A run given by its names' rows alone (the names never gathered by the decision) reads
    as the dict: every entry in order, the first ones, the texts, HAMi's counts and example
    nodes per reason, the reply's bytes, and equality with the same run given by names."""
    every = [name for _kind, entries in plan for name, _ in entries] + ["spare"]
    table, row = table_rows(every)
    rows_only = with_rows(plan, table, row, named=False)
    named = with_rows(plan, table, row)
    _plain, eager = built(plan)
    assert rows_only.head(3) == dict(list(eager.items())[:3])
    assert rows_only.texts() == set(eager.values())
    assert rows_only.by_reason(3) == named.by_reason(3)
    assert rows_only.to_json() == json.dumps(eager, ensure_ascii=False,
                                             separators=(",", ":")).encode()  # fmt: skip
    assert rows_only == with_rows(plan, table, row, named=False)  # (read by rows, unbuilt)
    assert rows_only == named and named == rows_only
    assert list(rows_only.items()) == list(eager.items())  # (the dict: names gathered)
    if eager:
        first = next(iter(eager))
        other = {**eager, first: "1/8 CardInsufficientCore"}
        assert rows_only != other


@settings(max_examples=100, deadline=None)
@given(plans(), st.randoms())
def test_runs_read_by_rows_answer_as_the_dict(plan: list, rng: random.Random) -> None:
    every = [name for _kind, entries in plan for name, _ in entries] + ["spare", 'q"uote']
    table, row = table_rows(every)
    lazy = with_rows(plan, table, row)
    _plain, eager = built(plan)
    # the reply's bytes: json.dumps' of the dict, joined from the table's keys
    assert lazy.to_json() == json.dumps(eager, ensure_ascii=False,
                                        separators=(",", ":")).encode()  # fmt: skip
    # the same entries worded in another order and grouping (a rotated list): equal
    entries = [(n, r or 1) if kind == "one" else (n, r) for kind, run in plan for n, r in run]
    entries = [(n, r) for n, r in entries if r]  # (a node that fits has no entry)
    rng.shuffle(entries)
    cut = rng.randint(0, len(entries))
    other = with_rows([("one", entries[:cut]), ("bulk", entries[cut:])], table, row)
    assert (lazy == other) is True
    if entries and any(r for _n, r in entries):
        changed = [(n, 2 if r == 1 else 1) if r else (n, r) for n, r in entries]
        assert lazy != with_rows([("bulk", changed)], table, row)


def test_writes_from_outside_the_decision_go_through_the_dict() -> None:
    lazy, eager = built([("bulk", [("a", 1), ("b", 2)])])
    lazy["a"] = "NodeConstraint: x"
    lazy.update({"z": "LedgerUnreadable: y"})
    eager["a"] = "NodeConstraint: x"
    eager["z"] = "LedgerUnreadable: y"
    assert lazy == eager and list(lazy) == list(eager)


def test_the_filter_reply_is_encoded_as_json_dumps_did() -> None:
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0, 256)] + ["\u2028", "\U0001f600", '"', "\\"]
    for _ in range(500):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        value = {"failedNodes": {word: word + "!"}, "failedAndUnresolvableNodes": {},
                 "error": word, "nodenames": [word, "n-1"]}  # fmt: skip
        assert encode_compact(value) == json.dumps(
            value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def test_a_few_nodes_are_listed_node_by_node() -> None:
    failed = {"n2": "1/1 CardInsufficientMemory", "n1": "2/2 CardInsufficientCore"}
    message = refusal_message(NodeReasons(failed), {"n3": "NodeUnregistered: no agent"})
    assert message == ("no node fits the GPU request (3 refused): n1: 2/2 CardInsufficientCore; "
                       "n2: 1/1 CardInsufficientMemory; n3: NodeUnregistered: no agent")


def test_many_nodes_give_hamis_counts_per_reason_within_an_events_note() -> None:
    count = 5000
    names = np.empty(count, dtype=object)
    names[:] = [f"gpu-node-{i:05d}.example.internal" for i in range(count)]
    ids = np.array([1 if i % 5 else 2 for i in range(count)], dtype=np.int64)
    failed = NodeReasons()
    failed.add_bulk(names, ids, TEXTS, REASONS)
    message = refusal_message(failed, {})
    assert len(message) <= EVENT_NOTE_LIMIT
    assert message.startswith("no node fits the GPU request (5000 refused): ")
    # every node counts under each of its reasons, most nodes first, a few of its nodes named
    assert ("5000 nodes CardInsufficientMemory(gpu-node-00001.example.internal, "
            "gpu-node-00002.example.internal, gpu-node-00003.example.internal, ...)") in message
    assert ("1000 nodes CardInsufficientCore(gpu-node-00000.example.internal, "
            "gpu-node-00005.example.internal, gpu-node-00010.example.internal, ...)") in message
    assert message.index("5000 nodes") < message.index("1000 nodes")
    # the same counts from a plain dict (refusals worded elsewhere)
    plain = refusal_message(failed.as_dict(), {})
    assert len(plain) <= EVENT_NOTE_LIMIT
    assert "5000 nodes CardInsufficientMemory(" in plain
    assert "1000 nodes CardInsufficientCore(" in plain


def test_a_rotated_list_refused_alike_is_answered_as_json_dumps_would(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """kube-scheduler lists the same nodes rotated from call to call: without the refusals
    library (which writes every reply in one pass, `test_reply_json.py`), the reply reuses the
    request's last one's bytes, only where the same nodes refuse for the same texts."""
    monkeypatch.setattr(failed_nodes_json, "_written_in_c", lambda *args: None)
    rng = random.Random(11)
    every = [f"node-{i}" for i in range(60)] + ['q"uote', "ünï"]
    table, row = table_rows(every)
    reasons = [(), ("CardInsufficientMemory",), ("CardInsufficientCore",)]  # (this request's)
    texts = np.array([None, "8/8 CardInsufficientMemory", "8/8 CardInsufficientCore"],
                     dtype=object)  # fmt: skip
    ids = [rng.choice([0, 1, 1, 2]) for _ in every]

    def reply(order: list[int], ids: list[int], texts: np.ndarray) -> tuple[bytes, bytes]:
        names = np.empty(len(order), dtype=object)
        names[:] = [every[i] for i in order]
        lazy = NodeReasons()
        lazy.add_bulk(names, np.array([ids[i] for i in order], dtype=np.int64), texts,
                      reasons, (table, np.array([row[every[i]] for i in order])))  # fmt: skip
        eager = {every[i]: texts[ids[i]] for i in order if ids[i]}
        return lazy.to_json(), json.dumps(eager, ensure_ascii=False,
                                          separators=(",", ":")).encode()  # fmt: skip

    start = list(range(len(every)))
    for k in [0, 1, 5, 31, 61, 0, 17]:  # rotations of the same list, the same reasons
        got, want = reply(start[k:] + start[:k], ids, texts)
        assert got == want
    changed = list(ids)
    changed[3] = 2 if ids[3] != 2 else 1  # one node's reason changed since
    got, want = reply(start[7:] + start[:7], changed, texts)
    assert got == want and got != reply(start[7:] + start[:7], ids, texts)[1]
    reworded = np.array([None, "7/8 CardInsufficientMemory", texts[2]], dtype=object)
    got, want = reply(start[9:] + start[:9], changed, reworded)  # another text, same ids
    assert got == want and b"7/8" in got
    shuffled = list(start)
    rng.shuffle(shuffled)  # (not a rotation)
    got, want = reply(shuffled, changed, reworded)
    assert got == want
    fewer = start[4:40]  # (a window of the list)
    got, want = reply(fewer, changed, reworded)
    assert got == want
