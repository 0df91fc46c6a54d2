"""CDI specs for prepared claims: what the container runtime adds to a container.

NodePrepareResources answers kubelet with fully qualified CDI device IDs
(`tessera.io/gpu=<name>`); the runtime (containerd/CRI-O with CDI enabled, or kube-sim's
kubelet) finds the device in the spec files of its CDI directory and applies its
`containerEdits`. One spec file per prepared claim, `tessera.io-gpu_<claim uid>.json`, written
atomically (temp + rename), removed at unprepare. Its edits are exactly what the device plugin's
Allocate answers (`handshake.container_env` / `container_mounts`): libvgpu, `/etc/ld.so.preload`,
the region (directory read-only, file read-write) and the sealed limits directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from tessera import dra_names as names

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


def device_id(name: str) -> str:
    """The fully qualified CDI device name kubelet hands the runtime."""
    return f"{names.CDI_KIND}={name}"


def spec_path(cdi_dir: str | os.PathLike[str], claim_uid: str) -> Path:
    vendor, cls = names.CDI_KIND.split("/")
    return Path(cdi_dir) / f"{vendor}-{cls}_{claim_uid}.json"


def build_spec(
    device_name: str, env: dict[str, str], mounts: list[tuple[str, str, bool]]
) -> dict[str, Any]:
    """A CDI spec with one device: `env` as `KEY=VALUE`, `mounts` (container path, host path,
    read-only) as bind mounts in the order given (parents before what they hold)."""
    if not _NAME.match(device_name):
        raise ValueError(f"{device_name!r} cannot name a CDI device")
    return {
        "cdiVersion": names.CDI_VERSION,
        "kind": names.CDI_KIND,
        "devices": [{
            "name": device_name,
            "containerEdits": {
                "env": [f"{k}={v}" for k, v in sorted(env.items())],
                "mounts": [
                    {"hostPath": host, "containerPath": path,
                     "options": ["ro" if ro else "rw", "nosuid", "nodev", "bind"]}
                    for path, host, ro in mounts
                ],
            },
        }],
    }  # fmt: skip


def write_spec(cdi_dir: str | os.PathLike[str], claim_uid: str, spec: dict[str, Any]) -> Path:
    """Write the claim's spec atomically (a runtime never reads half a file)."""
    path = spec_path(cdi_dir, claim_uid)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tessera-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def remove_spec(cdi_dir: str | os.PathLike[str], claim_uid: str) -> bool:
    try:
        spec_path(cdi_dir, claim_uid).unlink()
    except FileNotFoundError:
        return False
    return True


def read_spec(cdi_dir: str | os.PathLike[str], claim_uid: str) -> dict[str, Any] | None:
    try:
        spec: dict[str, Any] = json.loads(spec_path(cdi_dir, claim_uid).read_text())
    except (OSError, ValueError):
        return None
    return spec


def prepared_claims(cdi_dir: str | os.PathLike[str]) -> list[str]:
    """The claim uids whose specs this driver wrote (what a restarted driver still holds)."""
    vendor, cls = names.CDI_KIND.split("/")
    prefix = f"{vendor}-{cls}_"
    root = Path(cdi_dir)
    if not root.is_dir():
        return []
    return sorted(p.name[len(prefix) : -len(".json")] for p in root.glob(f"{prefix}*.json"))
