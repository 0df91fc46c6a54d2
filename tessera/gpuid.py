"""The short form of a GPU's identity, the same wherever a person reads it (the CLI, the
dashboard, event lines): the UUID's kind and its first eight hex digits, `GPU-3fe337b5`, as
`nvidia-smi -L` starts it. Unique in practice within a cluster, and greppable in the full UUID.
"""

from __future__ import annotations

SHORT_HEX = 8


def short_uuid(uuid: str) -> str:
    """`GPU-3fe337b5-1a2b-...` -> `GPU-3fe337b5`; `MIG-...` likewise; anything else unchanged."""
    kind, sep, rest = uuid.partition("-")
    if not sep or kind not in ("GPU", "MIG") or len(rest) <= SHORT_HEX:
        return uuid
    return f"{kind}-{rest[:SHORT_HEX]}"
