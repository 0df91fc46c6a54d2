"""The native name resolver (`native/names`, `native_names.NativeNames`) reads a `nodenames`
array exactly as the numpy path (`NameTable.numpy_rows`) and decoding it do: on every list,
adversarial ones included, it gives the names' rows and slots, or steps aside (None) where the
numpy path does; never another list. Without the library the scheduler resolves in numpy."""

from __future__ import annotations

import fcntl
import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tessera.scheduler import native_names
from tessera.scheduler.name_table import NameTable
from tessera.scheduler.native_names import NativeNames
from tessera.scheduler.native_walk import NATIVE_FROM

from .test_node_names import compact, damaged, order_index

NAMES_DIR = Path(__file__).resolve().parents[2] / "native" / "names"
UNIFORM = [f"node-{i:05d}" for i in range(3000)]
# prefixes of others, 1 byte to longer than 16, non-ASCII, a DEL, a `]` inside a name
MIXED = sorted({*(f"n{i}" for i in range(300)), *(f"n{i}0" for i in range(300)),
                "n", "x", "gpu-ß-über-1", "ip-10-0-3-17.eu-west-1.compute.internal",
                "ip-10-0-3-170.eu-west-1.compute.internal", "a\x7fb", "a]b", "0123456789abcdef",
                "0123456789abcdef0", "節點-1"})  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The library as `make native` builds it (built here when missing: one cc call)."""
    build = NAMES_DIR / "build"
    build.mkdir(exist_ok=True)
    with (build / ".lock").open("a") as lock:  # (the suite's workers share the build)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            made = subprocess.run(["make", "-s", "-C", str(NAMES_DIR)], capture_output=True,
                                  text=True)  # fmt: skip
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert made.returncode == 0, made.stdout + made.stderr
    assert native_names.library() is not None, native_names.library_path()


def table_of(names: list[str]) -> NameTable:
    rng = random.Random(len(names))
    registered = rng.sample(names, len(names))  # (the index's own order does not matter)
    table = NameTable(registered, [7 + 3 * i for i in range(len(registered))])
    assert table.native is not None and table.usable
    return table


def same_as_numpy(table: NameTable, array: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """The native result of the array, checked against the numpy path's and (when it resolves)
    against decoding it."""
    assert table.native is not None
    native = table.native.resolve(array)
    rows = table.numpy_rows(array)
    if rows is None:
        assert native is None, array[:200]
        return None
    assert native is not None, array[:200]
    assert native[0].tolist() == rows.tolist()
    assert native[1].tolist() == table.slots[rows].tolist()
    assert table.names[native[0]].tolist() == json.loads(array)
    return native


def lists_of(names: list[str], rng: random.Random) -> list[list[str]]:
    """kube-scheduler's orders and some it never sends."""
    ordered = sorted(names, key=str.encode)
    count = len(ordered)
    start = rng.randrange(count)
    rotated = ordered[start:] + ordered[:start]
    chunk = max(1, int(count**0.5))
    chunks = [rotated[i : i + chunk] for i in range(0, count, chunk)]
    interleaved: list[str] = []  # (16 workers, each walking its chunks, one name at a time)
    workers = [list(c) for c in chunks[:16]]
    pending = chunks[16:]
    while any(workers):
        w = rng.randrange(len(workers))
        if not workers[w]:
            if pending:
                workers[w] = list(pending.pop(0))
            continue
        interleaved.append(workers[w].pop(0))
    shuffled = rng.sample(names, count)
    return [
        ordered, rotated, interleaved, shuffled,
        [n for i, n in enumerate(rotated) if i % 37],  # refused by its own filters
        rotated[: count // 10],  # a window, wrapping when the start is near the end
        ordered[-5:] + ordered[:5],
        [rotated[0]] * 5 + rotated[:50] + rotated[:50],  # duplicates
        [ordered[0]], [ordered[-1]],
        rotated[::-1],
    ]  # fmt: skip


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_kube_schedulers_lists_resolve_as_the_numpy_path_and_decoding_do(names: list[str]) -> None:
    table = table_of(names)
    rng = random.Random(35)
    for listed in lists_of(names, rng):
        assert same_as_numpy(table, compact(listed)) is not None


def interleave(runs: list[list[str]], rng: random.Random) -> list[str]:
    """The runs merged one name at a time in a random order of the runs (parallel workers)."""
    runs = [list(r) for r in runs if r]
    out: list[str] = []
    while runs:
        run = runs[rng.randrange(len(runs))]
        out.append(run.pop(0))
        if not run:
            runs.remove(run)
    return out


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_a_labels_nodes_every_few_of_the_order_resolve_exactly(names: list[str]) -> None:
    """The resolver learns a list's stride in the order (a label's nodes dealt out every s-th
    node: `tn_resolve`'s stride): lists of every s-th name, in order or in 16 interleaved
    runs, strides that change midway, gaps and repeats, lists that propose a stride and then
    break it: each name resolves to its own row, as the numpy path and decoding say."""
    table = table_of(names)
    ordered = sorted(names, key=str.encode)
    rng = random.Random(4)
    for stride in (2, 3, 4, 7, 16, 31, 32, 33, 40):
        for offset in (0, 1, stride - 1):
            members = ordered[offset::stride]
            chunk = max(1, int(len(members) ** 0.5))
            runs = [members[i : i + chunk] for i in range(0, len(members), chunk)]
            other = ordered[(offset + 1) % stride :: stride + 1]
            for listed in (members, interleave(runs, rng), members[::-1],
                           members[: len(members) // 2] + other,  # the stride changes
                           interleave([members[:300], other[:300], ordered[:300]], rng),
                           [n for i, n in enumerate(members) if i % 5] + members[:40],
                           members[:8] + rng.sample(ordered, 200)):  # fmt: skip
                assert same_as_numpy(table, compact(listed)) is not None, (stride, offset)


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_what_cannot_be_proven_steps_aside_in_both_paths(names: list[str]) -> None:
    table = table_of(names)
    known = sorted(names)[:20]
    strangers = ("ghost", "node-99999", "n9999", "node-0000", "node-000000", "", "x" * 90,
                 known[0][:-1], known[0] + "0", known[3] + "\u00e9", known[5] + "~")  # fmt: skip
    for stranger in set(strangers) - set(names):  # (prefixes and extensions of known names)
        for listed in ([*known, stranger], [stranger, *known], [stranger]):
            assert same_as_numpy(table, compact(listed)) is None
    plain = compact(known).decode()
    for array in (
        json.dumps(known),  # Python's ", " spacing
        plain.replace(f'"{known[1]}"', '"' + known[1][:-1] + "\\u00" + f'{ord(known[1][-1]):02x}"'),
        plain.replace(f'"{known[1]}"', f'"{known[1]}\\n"'),
        plain[:-1] + ',"a\tb"]', plain[:-1] + ',"a\x00"]', plain[:-1] + ",]",
        plain[:-1], plain[1:], plain + "]", "[]", '[""]', '["', "[,]", '[""', plain + " ",
        plain.replace(",", ", ", 1), plain.replace('","', '"",', 1), plain.replace('","', '"', 1),
        plain[:-1] + ",5]", "[" + plain + "]", plain.replace("[", "[ ", 1),
    ):  # fmt: skip
        assert same_as_numpy(table, array.encode()) is None, array[:80]


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_damaged_lists_resolve_exactly_or_step_aside_in_both_paths(names: list[str]) -> None:
    """Random damage (a byte changed, added or dropped: quotes, commas, brackets, backslashes,
    controls, other bytes) to kube-scheduler's lists: both paths agree, and a list either
    path resolves is exactly what decoding it gives."""
    table = table_of(names)
    rng = random.Random(len(names) + 1)
    damage = [b'"', b",", b"]", b"[", b"\\", b"\x00", b"\x1f", b" ", b"a", b"0", b"9",
              "é".encode(), b"\xff"]  # fmt: skip
    resolved = 0
    sources = [compact(listed) for listed in lists_of(names, rng)]
    for _ in range(600):
        source = rng.choice(sources)
        size = rng.choice([1, 2, 3, 40, 400])
        cut = source[: source.find(b",", rng.randrange(len(source) // 2))] + b"]"
        sample = cut if rng.random() < 0.5 else compact(json.loads(source)[:size])
        resolved += same_as_numpy(table, damaged(sample, rng, damage)) is not None
    assert resolved  # (some damage leaves valid lists of known names: e.g. a dropped name)


def test_a_first_name_longer_than_the_rest_still_fits_every_name() -> None:
    """The result's room is sized from the first name's length (names are usually all as
    long); a list of shorter names after a long one gets room for every name."""
    table = table_of(MIXED)
    long_first = ["ip-10-0-3-17.eu-west-1.compute.internal", *["n"] * 500, *["x"] * 500]
    found = same_as_numpy(table, compact(long_first))
    assert found is not None and len(found[0]) == len(long_first)
    assert found[0].flags.c_contiguous and found[1].flags.c_contiguous


def test_the_index_resolves_through_the_native_table_as_decoding_does() -> None:
    index, slots = order_index(UNIFORM)
    rng = random.Random(7)
    listed = lists_of(UNIFORM, rng)[2]  # the parallel filters' order
    _version, table = index.name_table()  # type: ignore[attr-defined]
    assert table.native is not None
    found = index.names_from_bytes(compact(listed))  # type: ignore[attr-defined]
    assert found is not None
    assert list(found[0]) == listed
    assert found[1][1].tolist() == [slots[n] for n in listed]


def test_without_the_library_the_numpy_path_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_names, "library", lambda: None)
    index, slots = order_index(UNIFORM)
    _version, table = index.name_table()  # type: ignore[attr-defined]
    assert table.native is None
    listed = lists_of(UNIFORM, random.Random(8))[2]
    found = index.names_from_bytes(compact(listed))  # type: ignore[attr-defined]
    assert found is not None and list(found[0]) == listed
    assert found[1][1].tolist() == [slots[n] for n in listed]
    assert index.names_from_bytes(compact([*listed[:5], "ghost"])) is None  # type: ignore[attr-defined]


def test_a_table_the_library_cannot_hold_is_refused() -> None:
    slots = np.arange(3, dtype=np.int64)
    assert NativeNames.load([b"a", b"b", b"a"], slots) is None  # a name twice
    assert NativeNames.load([b"a", b"b", b"c"], slots, np.array([0, 0, 2])) is None  # no order
    assert NativeNames.load([b"a", b"b", b"c"], slots, np.array([0, 1, 5])) is None
    assert NativeNames.load([b"a", b"b", b"c"], np.array([0, 1, 1 << 31])) is None
    assert NativeNames.load([b"a", b"b", b"x" * 65536], slots) is None
    huge = NameTable(["a", "b", "x" * 65536], [0, 1, 2])  # (the numpy path holds it)
    assert huge.native is None and huge.rows(b'["b","a"]').tolist() == [1, 0]
    made = NativeNames.load([b"a", b"b", b"c"], slots, np.array([2, 0, 1]))
    assert made is not None
    found = made.resolve(b'["c","a","a","b"]')
    assert found is not None and found[0].tolist() == [2, 0, 0, 1]


def test_the_library_is_looked_for_where_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(native_names.LIBRARY_ENV, str(tmp_path / "lib.so"))
    assert native_names.library_path() == tmp_path / "lib.so"
    monkeypatch.delenv(native_names.LIBRARY_ENV)
    assert native_names.library_path() == NAMES_DIR / "build" / "libtessera_names.so"


@pytest.mark.parametrize("names", [UNIFORM, MIXED], ids=["uniform", "mixed"])
def test_the_rows_or_the_slots_alone_or_neither_are_what_both_give(names: list[str]) -> None:
    """`tn_resolve` writes the rows and the slots only where asked (each may be NULL: its
    loop is built once per combination), as int32 or int64 (`width`): each alone is what both
    give at either width, and asking for neither counts the same names or refuses the same
    arrays; so does `tn_resolve_in` in a body; a width other than 4 or 8 is refused."""
    table = table_of(names)
    native = table.native
    assert native is not None
    rng = random.Random(12)
    arrays = [compact(listed) for listed in lists_of(names, rng)]
    damage = [b'"', b",", b"]", b"\\", b"\x00", b" ", b"0"]
    arrays += [damaged(array, rng, damage) for array in arrays for _ in range(3)]
    resolve = native._resolve
    for array in arrays:
        both = native.resolve(array)
        capacity = len(array) // 4 + 1
        body = b'{"nodenames":' + array + b"}"
        end = np.zeros(1, dtype=np.uint64)
        assert resolve(native._handle, array, len(array), None, None, 2, capacity) == -1
        assert native._resolve_in(native._handle, body, len(body), 13, None, None, 0,
                                  capacity, end.ctypes.data) == -1  # fmt: skip
        for kind in (np.int32, np.int64):
            width = np.dtype(kind).itemsize
            rows = np.full(capacity + 1, -1, dtype=kind)  # (one more: nothing written there)
            slots = np.full(capacity + 1, -1, dtype=kind)
            counts = [
                resolve(native._handle, array, len(array), rows.ctypes.data, None, width,
                        capacity),
                resolve(native._handle, array, len(array), None, slots.ctypes.data, width,
                        capacity),
                resolve(native._handle, array, len(array), None, None, width, capacity),
            ]  # fmt: skip
            if both is None:
                assert counts == [-1, -1, -1], array[:80]
                continue
            assert counts == [len(both[0])] * 3
            assert rows[: counts[0]].tolist() == both[0].tolist() and rows[capacity] == -1
            assert slots[: counts[1]].tolist() == both[1].tolist() and slots[capacity] == -1
            rows[:] = -1
            assert native._resolve_in(native._handle, body, len(body), 13, rows.ctypes.data,
                                      None, width, capacity, end.ctypes.data) == counts[0]
            assert rows[: counts[0]].tolist() == both[0].tolist() and rows[capacity] == -1
            assert int(end[0]) == len(body) - 1


def test_a_full_list_of_20000_names_resolves_to_int32_slots() -> None:
    """A 20,500-name table: every kube-scheduler order of it, read as an array and in place in
    a body, gives the slots exactly, as int32 (4 bytes a name: half the memory the resolver
    writes and the walk in C reads again); a list shorter than C walks (numpy gathers by it:
    an int32 index is cast to int64 at every gather) as int64."""
    names = [f"node-{i:05d}" for i in range(20_500)]
    slots = random.Random(3).sample(range(30_000), len(names))
    table = NameTable(names, slots)
    assert table.native is not None
    slot_of = dict(zip(names, slots, strict=True))
    for listed in lists_of(names, random.Random(20_500))[:6]:
        array = compact(listed)
        expected = [slot_of[n] for n in listed]
        found = same_as_numpy(table, array)
        assert found is not None and found[1].dtype == np.int32
        assert found[1].tolist() == expected
        body = b'{"pod":{},"nodenames":' + array + b',"x":"]"}'
        start = body.index(b"[")
        read = table.slots_in(body, start)
        assert read is not None
        assert read[0].dtype == np.int32 and read[0].nbytes == 4 * len(listed)
        assert read[0].tolist() == expected and read[1] == start + len(array)
    window = compact(lists_of(names, random.Random(5))[2][:500])
    for found in (table.rows_and_slots(window),
                  table.slots_in(b'{"nodenames":' + window + b"}", 13)):  # fmt: skip
        assert found is not None and found[0].dtype == np.int64
    assert table.rows_and_slots(window)[1].dtype == np.int64  # type: ignore[index]
    long_list = compact(lists_of(names, random.Random(5))[2][:NATIVE_FROM])
    assert table.rows_and_slots(long_list)[0].dtype == np.int32  # type: ignore[index]


def test_slots_up_to_the_largest_int32_resolve_exactly_and_no_larger_one_is_taken() -> None:
    """The int32 the resolver writes holds every slot it is given: `tn_build` takes slots up
    to 2^31 - 1 and refuses a table with a larger one (the scheduler then resolves in numpy;
    an index's slots are rows of its arrays, so one that large would need arrays of 2^31
    entries each). Slots at both ends of the range come back exactly, in a body too."""
    top = (1 << 31) - 1
    encoded = [f"node-{i:05d}".encode() for i in range(2_000)]
    slots = np.array([top - i // 2 if i % 2 else i for i in range(len(encoded))],
                     dtype=np.int64)  # fmt: skip
    native = NativeNames.load(encoded, slots)
    assert native is not None
    listed = random.Random(4).sample(range(len(encoded)), len(encoded))
    array = b"[" + b",".join(b'"' + encoded[i] + b'"' for i in listed) + b"]"
    found = native.resolve(array)
    assert found is not None
    assert found[0].tolist() == listed and found[1].tolist() == slots[listed].tolist()
    assert top in found[1].tolist()
    read = native.slots_in(b'{"nodenames":' + array + b"}", 13)
    assert read is not None and read[0].tolist() == slots[listed].tolist()
    assert read[1] == 13 + len(array)
    too_large = slots.copy()
    too_large[7] = top + 1
    assert NativeNames.load(encoded, too_large) is None


def test_a_library_of_another_interface_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A stale build (one that writes int64 slots: no `tn_abi`, or another version) is not
    called with int32 arrays: the scheduler resolves in numpy until it is rebuilt."""
    stubs = ("void *tn_build(void) { return 0; } long tn_resolve(void) { return -1; } "
             "long tn_resolve_in(void) { return -1; } void tn_free(void) {} "
             "long tn_walk_round(void) { return -1; }")  # fmt: skip
    for name, extra in (("old", ""), ("other", "unsigned tn_abi(void) { return 1; }"),
                        ("same", f"unsigned tn_abi(void) {{ return {native_names.ABI}; }}")):
        source = tmp_path / f"{name}.c"
        source.write_text(stubs + extra)
        built_lib = tmp_path / f"lib{name}.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built_lib), str(source)],
                       check=True)  # fmt: skip
        monkeypatch.setattr(native_names, "_library", None)
        monkeypatch.setenv(native_names.LIBRARY_ENV, str(built_lib))
        loaded = native_names.library()
        assert (loaded is not None) == (name == "same"), name
