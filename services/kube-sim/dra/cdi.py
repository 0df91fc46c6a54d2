"""Container Device Interface spec files, read as a CDI-enabled runtime (containerd, CRI-O)
reads them for the CDI device IDs kubelet passes on.

A spec file (`*.json`, `*.yaml` in the spec directories; a later directory overrides an
earlier one, as `/var/run/cdi` overrides `/etc/cdi`) has `cdiVersion`, `kind`
(`vendor/class`), `devices[]` (`name`, `containerEdits`) and optional spec-wide
`containerEdits`. A fully qualified device ID is `vendor/class=name`. Container edits: `env`
(`KEY=VALUE` strings), `mounts` (`hostPath`, `containerPath`, `options`: `ro` read-only),
`deviceNodes` (`path`, `hostPath` (default `path`), `permissions`), `hooks` (not run here).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("tessera.kube_sim.dra.cdi")

DEVICE_ID = re.compile(r"^([a-zA-Z0-9][a-zA-Z0-9.-]*)/([a-zA-Z0-9][a-zA-Z0-9_.-]*)="
                       r"([a-zA-Z0-9][a-zA-Z0-9_.:-]*)$")
MAX_SPEC_BYTES = 1024 * 1024


class CdiError(ValueError):
    pass


@dataclass
class Edits:
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # container, host, ro
    device_nodes: list[tuple[str, str, str]] = field(default_factory=list)  # path, host, perms

    def add(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        for entry in raw.get("env") or []:
            key, sep, value = str(entry).partition("=")
            if sep and key:
                self.env[key] = value
        for mount in raw.get("mounts") or []:
            if isinstance(mount, dict) and mount.get("containerPath"):
                options = [str(o) for o in mount.get("options") or []]
                self.mounts.append((str(mount["containerPath"]),
                                    str(mount.get("hostPath", "")), "ro" in options))
        for node in raw.get("deviceNodes") or []:
            if isinstance(node, dict) and node.get("path"):
                self.device_nodes.append((str(node["path"]),
                                          str(node.get("hostPath") or node["path"]),
                                          str(node.get("permissions") or "rwm")))


def _load(path: Path) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise CdiError("spec file too large")
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError, CdiError) as exc:
        log.warning("unreadable CDI spec", extra={"path": str(path), "error": str(exc)})
        return None
    return data if isinstance(data, dict) else None


def registry(spec_dirs: list[Path]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """device ID → (the spec, the device): every spec file, later directories winning."""
    found: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for directory in spec_dirs:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix not in (".json", ".yaml", ".yml") or not path.is_file():
                continue
            spec = _load(path)
            if spec is None or "/" not in str(spec.get("kind", "")):
                continue
            for device in spec.get("devices") or []:
                if isinstance(device, dict) and device.get("name"):
                    found[f"{spec['kind']}={device['name']}"] = (spec, device)
    return found


def resolve(device_ids: list[str], spec_dirs: list[Path]) -> Edits:
    """The container edits the devices bring (spec-wide edits once per spec); CdiError names
    the IDs no spec defines (a runtime refuses to create the container then)."""
    known = registry(spec_dirs)
    edits = Edits()
    missing = [d for d in device_ids if d not in known or not DEVICE_ID.match(d)]
    if missing:
        raise CdiError(f"unresolvable CDI devices {', '.join(missing)}")
    applied_specs: set[int] = set()
    for device_id in device_ids:
        spec, device = known[device_id]
        if id(spec) not in applied_specs:
            applied_specs.add(id(spec))
            edits.add(spec.get("containerEdits"))
        edits.add(device.get("containerEdits"))
    return edits
