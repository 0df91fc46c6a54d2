"""Edits admission makes to a container, for every family (pure; on a writable copy)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tessera.hami import RequestError


def raw_resource(container: dict[str, Any], key: str) -> object | None:
    """The value as written, limits before requests (shapes were checked by the parser)."""
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if key in values:
            return values[key]
    return None


def set_resource(container: dict[str, Any], family_names: Iterable[str], key: str,
                 value: str) -> None:
    """Add a device resource to limits (where extended resources live), and to requests too
    when the container lists any of its family's resources (`family_names`) there, so that the
    two stay equal."""
    resources = container.get("resources")
    if not isinstance(resources, dict):
        resources = container["resources"] = {}
    if not isinstance(resources.get("limits"), dict):
        resources["limits"] = {}
    resources["limits"][key] = value
    requests = resources.get("requests")
    if isinstance(requests, dict) and any(name in requests for name in family_names):
        requests[key] = value


def ensure_env(container: dict[str, Any], name: str, value: str) -> bool:
    """Make `name` appear exactly once with `value`; False when it already did (reinvocation)."""
    env = container.get("env")
    if env is None:
        env = container["env"] = []
    if not isinstance(env, list):
        raise RequestError(f"container {container.get('name', '?')}: env must be a list")
    positions = [i for i, e in enumerate(env) if isinstance(e, dict) and e.get("name") == name]
    wanted = {"name": name, "value": value}
    if len(positions) == 1 and env[positions[0]] == wanted:
        return False
    if not positions:
        env.append(wanted)
        return True
    # The resource is the source of truth: the first entry takes our value, later ones go (in
    # Kubernetes the last duplicate would win).
    env[positions[0]] = wanted
    for i in reversed(positions[1:]):
        del env[i]
    return True
