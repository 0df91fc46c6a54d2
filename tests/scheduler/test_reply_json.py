"""A refused pod's failedNodes JSON written in C (`native/refusals/src/reply.c`,
`native_steps.NativeSteps.reasons_json`, used by `failed_nodes_json.bulk_json`) is byte for byte
what `json.dumps(dict, ensure_ascii=False, separators=(",", ":"))` writes, for names and texts
that need escapes, are not ASCII, or are longer than its 16-byte moves; anything it cannot
take (a row or id out of range, tables without their padding, an output too small, a library
built before the writer) is refused, and the reply is then joined in Python, the same bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tessera.scheduler import failed_nodes_json
from tessera.scheduler.name_table import NameTable
from tessera.scheduler.native_address import address_of
from tessera.scheduler.native_steps import LIBRARY_ENV, PADDING, NativeSteps
from tessera.scheduler.node_reasons import NodeReasons

from .test_native_steps import built  # noqa: F401  (the library as `make native` builds it)

REFUSALS_DIR = Path(__file__).resolve().parents[2] / "native" / "refusals"
ALPHABET = [chr(c) for c in range(1, 128)] + ["é", "ü", "\u2028", "\U0001f600", '"', "\\", "\n"]


def word(rng: random.Random, longest: int) -> str:
    """A name or a text: plain mostly, sometimes with what JSON escapes, sometimes long."""
    size = rng.choice([1, 5, 12, 15, 16, 17, 31, 33, 63, 64, 65, longest])
    if rng.random() < 0.6:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789-.") for _ in range(size))
    return "".join(rng.choice(ALPHABET) for _ in range(size))


def refusal(seed: int) -> tuple[NodeReasons, dict[str, str]]:
    """A bulk run of refused nodes given by their rows in a name table (as a decision gives
    them), some nodes fitting (no entry), and the dict the reply must encode."""
    rng = random.Random(seed)
    names = list(dict.fromkeys(word(rng, 200) for _ in range(rng.randint(1, 300))))
    table = NameTable(names, list(range(len(names))))
    texts = np.array([None] + [word(rng, 150) for _ in range(rng.randint(1, 6))], dtype=object)
    reasons = [(f"Reason{i}",) for i in range(len(texts))]
    order = rng.sample(range(len(names)), rng.randint(1, len(names)))
    ids = np.array([rng.randrange(len(texts)) for _ in order], dtype=np.int64)
    lazy = NodeReasons()
    lazy.add_bulk(None, ids, texts, reasons, (table, np.array(order, dtype=np.int64)))
    eager = {names[r]: texts[i] for r, i in zip(order, ids.tolist(), strict=True) if i}
    return lazy, eager


def dumped(eager: dict[str, str]) -> bytes:
    return json.dumps(eager, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("seed", range(60))
def test_the_reply_written_in_c_is_what_json_dumps_writes(seed: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    lazy, eager = refusal(seed)
    taken = []
    written_in_c = failed_nodes_json._written_in_c

    def spy(*args: object) -> bytes | None:
        taken.append(written := written_in_c(*args))
        return written

    monkeypatch.setattr(failed_nodes_json, "_written_in_c", spy)
    assert lazy.to_json() == dumped(eager)
    assert (taken and taken[0] is not None) or not eager  # (written in C, not joined)


@pytest.mark.parametrize("seed", range(20))
def test_joined_in_python_without_the_writer_the_same_bytes(seed: int,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:  # fmt: skip
    lazy, eager = refusal(seed)
    with_c = lazy.to_json()
    monkeypatch.setattr(failed_nodes_json, "_written_in_c", lambda *args: None)
    again, _ = refusal(seed)
    assert again.to_json() == with_c == dumped(eager)


def tables(rng: random.Random) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    keys = [json.dumps(word(rng, 90), ensure_ascii=False).encode() + b":" for _ in range(50)]
    texts = [json.dumps(word(rng, 90), ensure_ascii=False).encode() for _ in range(4)]

    def packed(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        at = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in parts], out=at[1:])
        return np.frombuffer(b"".join(parts) + bytes(PADDING), dtype=np.uint8), at

    return (*packed(keys), *packed(texts))


def test_rows_ids_and_tables_it_cannot_take_are_refused() -> None:
    native = NativeSteps.load()
    assert native is not None
    keys, key_at, texts, text_at = tables(random.Random(5))
    rows, ids = np.array([3, 7, 0], dtype=np.int64), np.array([1, 0, 3], dtype=np.int64)
    good = native.reasons_json(keys, key_at, rows, texts, text_at, ids)
    assert good is not None and json.loads(good)
    for bad_rows, bad_ids in [([3, 50, 0], [1, 0, 3]), ([3, -1, 0], [1, 0, 3]),
                              ([3, 7, 0], [1, 4, 3]), ([3, 7, 0], [1, -2, 3])]:  # fmt: skip
        assert native.reasons_json(keys, key_at, np.array(bad_rows), texts, text_at,
                                   np.array(bad_ids)) is None  # fmt: skip
    unpadded = np.ascontiguousarray(keys[: key_at[-1]])
    assert native.reasons_json(unpadded, key_at, rows, texts, text_at, ids) is None
    assert native.reasons_json(keys, key_at, rows, texts, text_at, ids[:2]) is None
    empty = np.zeros(0, dtype=np.int64)
    assert native.reasons_json(keys, key_at, empty, texts, text_at, empty) == b"{}"


def test_an_output_too_small_is_left_unwritten() -> None:
    native = NativeSteps.load()
    assert native is not None
    keys, key_at, texts, text_at = tables(random.Random(6))
    rows, ids = np.arange(20, dtype=np.int64), np.arange(20, dtype=np.int64) % 4
    write = native._reasons_json
    pairs = (address_of(keys), address_of(key_at), len(key_at) - 1, address_of(rows),
             address_of(texts), address_of(text_at), len(text_at) - 1, address_of(ids), 20)
    size = write(*pairs, None, 0)
    assert size > 2
    out = np.full(size + 8, 0xAB, dtype=np.uint8)
    assert write(*pairs, address_of(out), size - 1) == -1
    assert (out == 0xAB).all()
    assert write(*pairs, address_of(out), size) == size
    assert (out[size:] == 0xAB).all()  # (nothing past the object: its 16-byte moves stop short)
    want = {json.loads(bytes(keys[key_at[r] : key_at[r + 1] - 1])):
            json.loads(bytes(texts[text_at[i] : text_at[i + 1]]))
            for r, i in zip(rows, ids, strict=True)}  # fmt: skip
    assert json.loads(out[:size].tobytes()) == want


def test_a_library_built_before_the_writer_keeps_its_steps_and_the_reply_is_joined(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A library without `tr_reasons_json` (an older build) still loads for the refusal
    steps; the reply is then joined in Python, the same bytes."""

    def entry() -> SimpleNamespace:
        return SimpleNamespace(restype=None, argtypes=None)

    old = NativeSteps(SimpleNamespace(tr_steps=entry(), tr_group=entry(),  # type: ignore[arg-type]
                                      tr_distinct=entry()))  # fmt: skip
    keys, key_at, texts, text_at = tables(random.Random(7))
    one = np.array([1], dtype=np.int64)
    assert old.reasons_json(keys, key_at, one, texts, text_at, one) is None
    monkeypatch.setattr(NativeSteps, "load", classmethod(lambda cls: old))
    lazy, eager = refusal(8)
    assert lazy.to_json() == dumped(eager)


def test_without_the_library_the_reply_is_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIBRARY_ENV, str(REFUSALS_DIR / "build" / "missing.so"))
    assert NativeSteps.load() is None
    lazy, eager = refusal(9)
    assert lazy.to_json() == dumped(eager)


def test_the_writer_copies_only_what_it_is_given() -> None:
    """The C writer reads its tables 64 bytes past an entry at most (the padding): a key at
    the very end of its table, followed by nothing but the padding, is written whole."""
    native = NativeSteps.load()
    assert native is not None
    key = json.dumps("z" * 70).encode() + b":"
    keys = np.frombuffer(b'"a":' + key + bytes(PADDING), dtype=np.uint8)
    key_at = np.array([0, 4, 4 + len(key)], dtype=np.int64)
    text = json.dumps("y" * 3).encode()
    texts = np.frombuffer(text + bytes(PADDING), dtype=np.uint8)
    text_at = np.array([0, len(text)], dtype=np.int64)
    got = native.reasons_json(keys, key_at, np.array([1, 0]), texts, text_at,
                              np.array([0, 0]))  # fmt: skip
    assert got == dumped({"z" * 70: "yyy", "a": "yyy"})
