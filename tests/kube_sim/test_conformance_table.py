"""services/kube-sim/README.md's conformance table names, for every row, an upstream reference
and at least one test, and every test it names exists: a claim never outlives its test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = re.compile(r"`((?:kube_sim|e2e)/[\w/]+\.py)::(\w+)`")


def rows() -> list[list[str]]:
    text = (ROOT / "services" / "kube-sim" / "README.md").read_text()
    table = text[text.index("## Conformance"):]
    table = table[:table.find("\n## ", 1) if "\n## " in table[1:] else None]
    found = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("behaviour", "---"):
            found.append(cells)
    return found


def test_every_row_has_a_reference_and_an_existing_test() -> None:
    table = rows()
    assert len(table) >= 10
    for behaviour, reference, tests in table:
        assert reference, behaviour
        named = TEST.findall(tests)
        assert named, f"no test for: {behaviour}"
        for path, name in named:
            source = ROOT / "tests" / path
            functions = {n.name for n in ast.walk(ast.parse(source.read_text()))
                         if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            assert name in functions, f"{path}::{name} (row: {behaviour[:60]})"
