"""The per-container directories on the host: what was prepared for whom, and their files.

    <region_host_dir>/<pod uid>/<index>-<container>/
        prepared.json   who the directory was prepared for at Allocate (pod, container, device IDs)
        limits/limits   the sealed limits (tessera.region.seal_limits); mounted read-only
        region/usage    the usage region libvgpu writes; mounted read-write
    <region_host_dir>/ld.so.preload   one line: the libvgpu path inside the container

`prepared.json` is what makes PreStartContainer exact after a crash: it records, on disk, which
pod an Allocate answer was meant for, keyed by the replica IDs kubelet handed over.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from tessera.models import DeviceGrant, now
from tessera.region import DeviceLimit, device_limit

# Where things appear inside the container.
LIBVGPU_CONTAINER_PATH = "/usr/local/vgpu/libvgpu.so"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
REGION_CONTAINER_DIR = "/run/tessera/region"
REGION_FILE_NAME = "usage"
REGION_CONTAINER_PATH = f"{REGION_CONTAINER_DIR}/{REGION_FILE_NAME}"

PREPARED_FILE = "prepared.json"
PRELOAD_FILE = "ld.so.preload"
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class PreparedContainer(BaseModel):
    """Who a container directory was prepared for (written at Allocate)."""

    pod_uid: str
    namespace: str
    pod: str
    container: str
    index: int = Field(ge=0, description="position in Allocation.containers (init first)")
    device_ids: list[str]
    grants: list[DeviceGrant]
    prepared_at: float = Field(default_factory=now)
    # elastic memory (issue 33; the lease service reads them): what happens to this container's
    # memory beyond its guarantee when a neighbour's guarantee needs it, and how long an
    # allocation that does not fit waits for memory instead of failing at once (0: never)
    memory_reclaim: Literal["fail", "evict"] = "fail"
    memory_wait_s: float = Field(0.0, ge=0, le=3600)


@dataclass(frozen=True)
class ContainerDir:
    path: Path
    prepared: PreparedContainer

    @property
    def limits_dir(self) -> Path:
        return self.path / "limits"

    @property
    def region_dir(self) -> Path:
        return self.path / "region"

    @property
    def region_file(self) -> Path:
        return self.region_dir / REGION_FILE_NAME

    @property
    def key(self) -> str:
        return f"{self.prepared.pod_uid}/{self.prepared.index}"


def sealed_device_limit(
    uuid: str,
    *,
    memory_mib: int,
    cores: int,
    memory_burst_mib: int | None = None,
    cores_burst: int | None = None,
) -> DeviceLimit:
    """What the sealed limits file says for one GPU of a container: the guarantee (the grant's
    memory and cores, HAMi's `gpumem`/`gpucores`) and the burst limits (None, or equal to the
    guarantee: a hard slice, sealed exactly as before limits 1.2). Cores above 100 mean the whole
    card. Raises ValueError for a burst below its guarantee or without one."""
    mem = memory_mib << 20
    return device_limit(
        uuid,
        mem_guarantee_bytes=mem,
        mem_burst_bytes=None if memory_burst_mib is None else memory_burst_mib << 20,
        sm_guarantee_pct=min(cores, 100),
        sm_burst_pct=None if cores_burst is None else min(cores_burst, 100),
    )


def _safe(name: str, what: str) -> str:
    if not _SAFE.match(name) or name in (".", ".."):
        raise ValueError(f"{what} {name!r} cannot name a directory")
    return name


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class ContainerStore:
    """The directory tree above, nothing else (no ledger, no gRPC).

    The agent is the only writer of the tree, so it is scanned once and then kept in memory.
    Garbage collection judges a pod gone from facts read a moment earlier (the ledger, kubelet's
    list), while kubelet may be allocating for it: every preparation is numbered (`changes`), and
    a pod prepared since the facts were read is never removed on them (`remove_pod_unless`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._index: dict[Path, PreparedContainer] | None = None
        # Preparing and removing run in worker threads (asyncio.to_thread): one at a time.
        self._lock = threading.RLock()
        self._changes = 0
        # Every preparation, relabel and removal, counted once it is complete: a reader (the
        # lease service's sync, in the event loop) that sees the new number sees the new tree.
        self._version = 0
        self._touched: dict[str, int] = {}  # pod uid -> the change that last prepared for it

    @property
    def changes(self) -> int:
        """How many preparations and relabels this store has made (read before judging)."""
        return self._changes

    @property
    def version(self) -> int:
        """Moves whenever a directory is prepared, relabelled or removed (cheap to poll)."""
        return self._version

    def _touch(self, pod_uid: str) -> None:
        self._changes += 1
        self._touched[pod_uid] = self._changes

    def ensure_root(self) -> Path:
        """Create the root and the ld.so.preload file every container mounts."""
        self.root.mkdir(parents=True, exist_ok=True)
        preload = self.root / PRELOAD_FILE
        content = (LIBVGPU_CONTAINER_PATH + "\n").encode()
        if not preload.is_file() or preload.read_bytes() != content:
            _write_atomic(preload, content, 0o444)
        return preload

    @property
    def preload_file(self) -> Path:
        return self.root / PRELOAD_FILE

    def path_for(self, pod_uid: str, index: int, container: str) -> Path:
        name = f"{index}-{_safe(container, 'container')}" if container else str(index)
        return self.root / _safe(pod_uid, "pod uid") / name

    def prepare(self, prepared: PreparedContainer) -> ContainerDir:
        """Create (or re-create) the container's directory, empty limits, an empty region."""
        with self._lock:
            self._touch(prepared.pod_uid)
            cdir = self._prepare(prepared)
            self._version += 1
            return cdir

    def _prepare(self, prepared: PreparedContainer) -> ContainerDir:
        from tessera.region import prepare_region_file

        path = self.path_for(prepared.pod_uid, prepared.index, prepared.container)
        owner = self._scan().get(path)
        if owner is not None and owner.pod_uid != prepared.pod_uid:
            # A relabel gave this directory to another pod, whose container mounts it: never
            # reuse it; this preparation gets a directory of its own.
            n = 2
            while (path.with_name(f"{path.name}~{n}")) in self._scan() or path.with_name(
                f"{path.name}~{n}"
            ).exists():
                n += 1
            path = path.with_name(f"{path.name}~{n}")
        cdir = ContainerDir(path, prepared)
        cdir.limits_dir.mkdir(parents=True, exist_ok=True)
        # The region is the container's alone: its directories are the agent's (root's), so no
        # other container or host user reaches them; the container sees only what it mounts.
        for private in (path.parent, path):
            os.chmod(private, 0o700)
        # A stale limits file of an earlier attempt must not survive: PreStart seals anew.
        with contextlib.suppress(FileNotFoundError):
            (cdir.limits_dir / "limits").unlink()
        prepare_region_file(cdir.region_file)
        _write_atomic(path / PREPARED_FILE, prepared.model_dump_json().encode())
        self._scan()[path] = prepared
        return cdir

    def _scan(self) -> dict[Path, PreparedContainer]:
        if self._index is None:
            index: dict[Path, PreparedContainer] = {}
            if self.root.is_dir():
                for meta in self.root.glob(f"*/*/{PREPARED_FILE}"):
                    try:
                        index[meta.parent] = PreparedContainer.model_validate_json(
                            meta.read_bytes()
                        )
                    except (OSError, ValueError):
                        continue  # half-removed or foreign: garbage collection deals with it
            self._index = index
        return self._index

    def all(self) -> list[ContainerDir]:
        # One C-level copy first: a worker thread may be preparing meanwhile, and iterating the
        # live index while it grows raises.
        return [ContainerDir(path, prepared) for path, prepared in list(self._scan().items())]

    def for_pod(self, pod_uid: str) -> list[ContainerDir]:
        return [c for c in self.all() if c.prepared.pod_uid == pod_uid]

    def by_devices(self, device_ids: list[str]) -> list[ContainerDir]:
        """Directories prepared for exactly these replica IDs, newest first."""
        wanted = sorted(device_ids)
        found = [c for c in self.all() if sorted(c.prepared.device_ids) == wanted]
        return sorted(found, key=lambda c: c.prepared.prepared_at, reverse=True)

    def relabel(self, cdir: ContainerDir, prepared: PreparedContainer) -> ContainerDir:
        """PreStart proved the directory serves another pod than the one it was prepared for
        (two interchangeable pods crossed): record its true owner. The path stays (kubelet
        already holds the mounts), so ownership is always read from `prepared.json`."""
        with self._lock:
            self._touch(prepared.pod_uid)
            _write_atomic(cdir.path / PREPARED_FILE, prepared.model_dump_json().encode())
            self._scan()[cdir.path] = prepared
            self._version += 1
            return ContainerDir(cdir.path, prepared)

    def pod_uids(self) -> list[str]:
        """Every pod that owns a directory (by its label), and pod directories holding none."""
        owners = {c.prepared.pod_uid for c in self.all()}
        if self.root.is_dir():
            held = {p.parent.name for p in list(self._scan())}
            # Dot-directories are the agent's own (`.mps`: MPS daemons), never a pod's.
            owners |= {p.name for p in self.root.iterdir()
                       if p.is_dir() and p.name not in held and not p.name.startswith(".")}
        return sorted(owners)

    def remove_container(self, cdir: ContainerDir) -> None:
        with self._lock:
            self._scan().pop(cdir.path, None)
            shutil.rmtree(cdir.path, ignore_errors=True)
            with contextlib.suppress(OSError):
                cdir.path.parent.rmdir()  # the pod's directory, when it was its only container
            self._version += 1

    def remove_pod(self, pod_uid: str) -> None:
        """Remove the directories the pod owns (wherever a relabel left them)."""
        with self._lock:
            for cdir in self.for_pod(pod_uid):
                # The limits files are read-only; rmtree needs write permission on the dirs only.
                self.remove_container(cdir)
            target = self.root / _safe(pod_uid, "pod uid")
            if target.is_dir() and not any(p.parent == target for p in self._scan()):
                shutil.rmtree(target, ignore_errors=True)
            self._touched.pop(pod_uid, None)

    def remove_pod_unless(self, pod_uid: str, prepared_after: int) -> bool:
        """`remove_pod`, unless something was prepared for the pod after change number
        `prepared_after` (`changes` as read before the facts that judged it gone)."""
        with self._lock:
            if self._touched.get(pod_uid, 0) > prepared_after:
                return False
            self.remove_pod(pod_uid)
            return True
