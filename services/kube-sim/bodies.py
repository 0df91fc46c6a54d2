"""Request bodies read as kube-apiserver bounds them: never a 500, never the event loop stalled.

- size: 3 MiB (kube-apiserver's `--max-request-bytes` default for a request body): 413;
- nesting: JSON or YAML nested deeper than `MAX_DEPTH` is refused with 400 BadRequest, as
  kube-apiserver's decoder refuses one past its depth limit ("exceeded max depth"), before any
  recursive code (a deep copy, a merge) could run out of stack;
- YAML is parsed in a worker thread (a large server-side apply body must not stall every other
  request), and aliases are refused past `MAX_ALIASES` (a "billion laughs" document expands
  exponentially; go-yaml, which kube-apiserver uses, refuses "excessive aliasing"), and so is a
  document of more than `MAX_NODES` values once its aliases are expanded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import yaml

from .store import StoreError

MAX_BODY_BYTES = 3 * 1024 * 1024
MAX_DEPTH = 200
MAX_ALIASES = 100
MAX_NODES = 1_000_000


def too_large(raw: bytes) -> StoreError:
    return StoreError(413, "RequestEntityTooLarge", "request entity too large: limit is 3145728")


def _shape_problem(value: Any) -> str:
    """Why `value` is out of bounds: nested deeper than MAX_DEPTH, or more than MAX_NODES
    values once YAML aliases are expanded (each use counts: what serialising it would cost).
    Iterative: no recursion to exhaust, and it stops at the first bound crossed."""
    stack = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH:
            return f"exceeded max depth of {MAX_DEPTH}"
        if seen > MAX_NODES:
            return f"more than {MAX_NODES} values (aliases expanded)"
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return ""


def check_depth(value: Any, what: str = "JSON") -> Any:
    problem = _shape_problem(value)
    if problem:
        raise StoreError(400, "BadRequest", f"error decoding {what}: {problem}")
    return value


def parse_json(raw: bytes, **options: Any) -> Any:
    """json.loads with the depth bound (Python's own recursion gives out near 1,000)."""
    try:
        return check_depth(json.loads(raw, **options))
    except RecursionError:
        raise StoreError(400, "BadRequest",
                         f"invalid JSON body: exceeded max depth of {MAX_DEPTH}") from None


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts alias uses: past MAX_ALIASES the document is refused."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"document contains excessive aliasing "
                                     f"(more than {MAX_ALIASES} aliases)")  # fmt: skip
        return super().compose_node(parent, index)


def _load_yaml(raw: bytes) -> Any:
    try:
        return check_depth(yaml.load(raw, Loader=_BoundedLoader), "YAML")
    except RecursionError:
        raise StoreError(400, "BadRequest",
                         f"error decoding YAML: exceeded max depth of {MAX_DEPTH}") from None
    except yaml.YAMLError as exc:
        raise StoreError(400, "BadRequest", f"error decoding YAML: {exc}") from exc


async def parse_yaml(raw: bytes) -> Any:
    """A YAML (or JSON) body, bounded, parsed off the event loop."""
    if len(raw) > MAX_BODY_BYTES:
        raise too_large(raw)
    if not raw:
        return None
    return await asyncio.to_thread(_load_yaml, raw)
