"""What the driver prepared, one JSON file per claim under `<region dir>/.dra/` (so a restarted
agent knows what it holds, and kubelet's repeated prepare is answered from it)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from .claims import PreparedClaim

RECORDS_DIR = ".dra"  # under the region dir: a dot-directory is never a pod's (ContainerStore)


class PrepareError(Exception):
    """Preparing or unpreparing failed; the message goes back to kubelet."""


class ClaimRecords:
    """What the driver prepared, one JSON file per claim (survives a restart)."""

    def __init__(self, root: Path) -> None:
        self.root = root / RECORDS_DIR

    def _path(self, claim_uid: str) -> Path:
        if not claim_uid or "/" in claim_uid or claim_uid.startswith("."):
            raise PrepareError(f"claim uid {claim_uid!r} cannot name a record")
        return self.root / f"{claim_uid}.json"

    def get(self, claim_uid: str) -> PreparedClaim | None:
        try:
            return PreparedClaim.model_validate_json(self._path(claim_uid).read_bytes())
        except (OSError, ValueError):
            return None

    def put(self, record: PreparedClaim) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._path(record.claim_uid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json())
        tmp.replace(path)

    def drop(self, claim_uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(claim_uid).unlink()

    def all(self) -> list[PreparedClaim]:
        out = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                out.append(PreparedClaim.model_validate_json(path.read_bytes()))
            except (OSError, ValueError):
                continue
        return out

    def of_pod(self, pod_uid: str) -> list[PreparedClaim]:
        return [r for r in self.all() if r.pod_uid == pod_uid]
