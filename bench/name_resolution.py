"""Resolving a `nodenames` array from its bytes, two versions of `name_table.py` side by side.

What `ClusterIndex.names_from_bytes` does with a new list: a version's `NameOrder` (a run of
the node order; `runs` where the version has it: the order with nodes left out) and then its
`NameTable.rows` (any list), both versions alternating on the same lists in one process, CPU
ms of this thread per list, p50 / p99; "cold": after 32 MB of other memory was written, as a
decision between two calls does. Lists from `kube_lists.py` (kube-scheduler's parallel order,
its window) and its node order with some nodes left out at random (its own filters refused
them). Every list is checked to resolve to the same rows in both versions.

    python bench/name_resolution.py [REV_BEFORE]   (default HEAD; the worktree is "after")

`BENCH_NODES` (20000). Printed, not recorded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from kube_lists import COMPACT, KubeLists  # noqa: E402


def module(label: str, text: str) -> ModuleType:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"name_table_{label}", f.name)
    assert spec is not None and spec.loader is not None
    made = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(made)
    os.unlink(f.name)
    return made


def resolver(table: object):
    order = table.order  # type: ignore[attr-defined]
    read = getattr(order, "runs", order.run)

    def resolve(array: bytes):
        found = read(array)
        return found[0] if found is not None else table.rows(array)  # type: ignore[attr-defined]

    return resolve


def main() -> None:
    before_rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    path = "services/scheduler/name_table.py"
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{before_rev}:{path}"],
                          check=True, capture_output=True, text=True).stdout  # fmt: skip
    from tessera.scheduler import name_table as after  # (with its native resolver, if built)

    # (an older name_table.py imports no sibling: loaded alone; a newer one is the package's)
    before = module("before", text) if "from ." not in text else None
    if before is None:
        tree = Path(tempfile.mkdtemp())
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", before_rev,
                                  "services/scheduler"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        spec = importlib.util.spec_from_file_location(
            "name_table_before_pkg", tree / "services/scheduler/__init__.py",
            submodule_search_locations=[str(tree / "services/scheduler")])
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = package
        spec.loader.exec_module(package)
        before = importlib.import_module("name_table_before_pkg.name_table")
    versions = {"before": before, "after": after}
    count = int(os.environ.get("BENCH_NODES", "20000"))
    rng = random.Random(35)
    plain = [f"node-{i:05d}" for i in range(count)]
    mixed = [f"ip-10-{i // 250}-{i % 250}-{i % 7}.eu-west-1.compute.internal" for i in range(count)]

    def left_out(names: list[str], k: int) -> list[str]:
        start = rng.randrange(len(names))
        gone = set(rng.sample(range(len(names)), k))
        return [n for i, n in enumerate(names[start:] + names[:start]) if i not in gone]

    full, window = KubeLists(plain, "full", order="parallel"), KubeLists(
        plain, "window", order="parallel", find=1000)
    cases = [
        ("full list, parallel order", plain, [full.next() for _ in range(20)]),
        ("1,000-name window, parallel order", plain, [window.next() for _ in range(20)]),
        ("mixed-length names, full, parallel", mixed,
         [KubeLists(mixed, "full", order="parallel", seed=s).next() for s in range(10)]),
        # (kube-scheduler's node order is its informer's listing, by name: the order the
        # native resolver's cursors follow; the case above is registration order)
        ("mixed-length, by name, full, parallel", mixed,
         [KubeLists(sorted(mixed), "full", order="parallel", seed=s).next() for s in range(10)]),
    ] + [(f"node order, {k} nodes left out", plain, [left_out(plain, k) for _ in range(20)])
         for k in (1, 10, 20, 40)]  # fmt: skip
    junk = bytearray(32 << 20)
    print(f"{count} names; before {before_rev}, after the worktree; CPU ms p50 / p99; "
          f"load {os.getloadavg()[0]:.2f}")
    for label, names, lists in cases:
        tables = {v: m.NameTable(names, list(range(len(names)))) for v, m in versions.items()}
        read = {v: resolver(t) for v, t in tables.items()}
        arrays = [json.dumps(listed, separators=COMPACT).encode() for listed in lists]
        for cold in (False, True):
            times: dict[str, list[float]] = {"before": [], "after": []}
            for rep in range(6):
                for array in arrays:
                    got = {}
                    for v in ("before", "after") if rep % 2 else ("after", "before"):
                        if cold:
                            junk[::64] = b"\x01" * len(junk[::64])
                        start = time.thread_time_ns()
                        got[v] = read[v](array)
                        times[v].append((time.thread_time_ns() - start) / 1e6)
                    assert got["before"] is not None and got["after"] is not None
                    assert got["before"].tolist() == got["after"].tolist()

            def q(xs: list[float]) -> str:
                xs.sort()
                return f"{xs[len(xs) // 2]:.3f} / {xs[int(len(xs) * 0.99)]:.3f}"

            print(f"{label:38s} {'cold' if cold else 'warm'}  before {q(times['before'])}  "
                  f"after {q(times['after'])}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
