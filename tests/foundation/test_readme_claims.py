"""Every compatibility claim in README.md's "For HAMi operators" section names the tests that back
it (`path::test_name`), and every test it names exists: a claim never outlives its test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"`(tests/[\w/.-]+\.py)::(\w+)`")


def hami_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## For HAMi operators")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def claim_rows() -> list[str]:
    rows = []
    for line in hami_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or set("".join(cells)) <= set("-: "):
            continue  # not a row, or the separator line
        if cells[-1] in ("tests", "test"):
            continue  # a header
        rows.append(line)
    return rows


def test_every_claim_names_a_test() -> None:
    rows = claim_rows()
    assert len(rows) >= 15
    for row in rows:
        assert REFERENCE.search(row), f"a claim without a test: {row[:120]}"


def test_every_named_test_exists() -> None:
    defined: dict[str, set[str]] = {}
    for row in claim_rows():
        for path, name in REFERENCE.findall(row):
            if path not in defined:
                source = ROOT / path
                assert source.is_file(), f"README names {path}, which does not exist"
                tree = ast.parse(source.read_text())
                defined[path] = {
                    node.name for node in tree.body
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                }  # fmt: skip
            assert name in defined[path], f"README names {path}::{name}, which does not exist"
