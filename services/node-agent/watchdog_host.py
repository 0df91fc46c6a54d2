"""What the watchdog reads and does on the host, cheaply enough to repeat twice a second for
every busy container: pid → pod (the host's /proc), sealed limits, region claims; and ending a
process. Each cache checks its file's identity (stat) at most every `revalidate_s` seconds of
the caller's clock, so a change on disk is seen within that time; a region's contents are read
on every poll."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from pathlib import Path

from tessera.region import (
    CLAIMS_SIZE,
    LIMITS_FILE_NAME,
    ContainerLimits,
    RegionFormatError,
    decode_device_claims,
    read_limits,
)

from .watchdog_rules import pod_uid_from_cgroup

Claims = dict[str, tuple[int, float | None]]  # uuid -> (used bytes, achieved SM %)


def read_pod_of(proc_root: Path, pid: int) -> str | None:
    """The pod uid of host pid `pid` from <proc root>/<pid>/cgroup; None when not a pod's."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as f:
            text = f.read(65536).decode(errors="replace")
    except OSError:
        return None
    return pod_uid_from_cgroup(text)


def end_process(proc_root: Path, pid: int, pod_uid: str) -> bool:
    """SIGKILL `pid` if it still is a process of `pod_uid` (a pidfd pins the process between
    the check and the signal, so a recycled pid is never hit)."""
    if pid <= 1 or pid == os.getpid():
        return False
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False  # gone already
    try:
        if read_pod_of(proc_root, pid) != pod_uid:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class PodOfPid:
    """pid → pod uid, re-read when /proc/<pid> is another process (its inode and ctime, the
    process's start, change when a pid is recycled)."""

    def __init__(self, proc_root: Path, revalidate_s: float = 1.0) -> None:
        self.proc_root = proc_root
        self.revalidate_s = revalidate_s
        self._cache: dict[int, tuple[float, tuple[int, int], str | None]] = {}

    def lookup(self, pid: int, now: float) -> str | None:
        cached = self._cache.get(pid)
        if cached is not None and now - cached[0] < self.revalidate_s:
            return cached[2]
        try:
            st = os.stat(f"{self.proc_root}/{pid}")
        except OSError:
            self._cache.pop(pid, None)
            return None
        stamp = (st.st_ino, st.st_ctime_ns)
        pod = cached[2] if cached is not None and cached[1] == stamp else read_pod_of(
            self.proc_root, pid)
        self._cache[pid] = (now, stamp, pod)
        return pod

    def keep_only(self, pids: set[int]) -> None:
        for pid in [p for p in self._cache if p not in pids]:
            del self._cache[pid]


class LimitsCache:
    """Sealed limits files, decoded again only when the file changes (stat is cheap)."""

    def __init__(self, revalidate_s: float = 1.0) -> None:
        self.revalidate_s = revalidate_s
        self._cache: dict[str, tuple[float, tuple[int, int, int], ContainerLimits | None]] = {}

    def read(self, directory: str, now: float) -> ContainerLimits | None:
        cached = self._cache.get(directory)
        if cached is not None and now - cached[0] < self.revalidate_s:
            return cached[2]
        try:
            st = os.stat(f"{directory}/{LIMITS_FILE_NAME}")
        except OSError:
            self._cache.pop(directory, None)
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if cached is not None and cached[1] == stamp:
            limits = cached[2]
        else:
            try:
                limits = read_limits(directory)
            except (RegionFormatError, OSError):
                limits = None  # the agent wrote it: damaged means mid-replace, try again
        self._cache[directory] = (now, stamp, limits)
        return limits

    def keep_only(self, directories: set[str]) -> None:
        for key in [k for k in self._cache if k not in directories]:
            del self._cache[key]


def _open_regular(path: str) -> int | None:
    """A read-only descriptor on `path` if it is a plain file. The region directory is the
    tenant's: a symlink, a FIFO (whose open would block) or a device is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


class RegionClaims:
    """What usage regions claim, through descriptors kept open (one pread per poll). A region
    replaced on disk is reopened; a truncated one reads short and claims nothing."""

    def __init__(self, revalidate_s: float = 1.0, fresh_s: float = 0.0) -> None:
        self.revalidate_s = revalidate_s
        self.fresh_s = fresh_s  # a claim read this recently is not read again
        self._fds: dict[str, tuple[int, tuple[int, int], float]] = {}  # fd, identity, checked
        self._last: dict[str, tuple[bytes, Claims | None]] = {}  # raw bytes, decoded
        self._read_at: dict[str, float] = {}

    def read(self, key: str, now: float) -> Claims | None:
        if self.fresh_s and now - self._read_at.get(key, -1e18) < self.fresh_s:
            last = self._last.get(key)
            if last is not None:
                return last[1]
        entry = self._fds.get(key)
        if entry is None or now - entry[2] >= self.revalidate_s:
            try:
                st = os.stat(key)
            except OSError:
                self._close(key)
                return None
            identity = (st.st_dev, st.st_ino)
            if entry is None or entry[1] != identity:
                self._close(key)  # replaced (the region dir is the tenant's): read the new one
                fd = _open_regular(key)
                if fd is None:
                    return None
                entry = (fd, identity, now)
            else:
                entry = (entry[0], identity, now)
            self._fds[key] = entry
        try:
            data = os.pread(entry[0], CLAIMS_SIZE, 0)
        except OSError:
            return None
        self._read_at[key] = now
        last = self._last.get(key)
        if last is not None and last[0] == data:
            return last[1]  # unchanged since the last poll: no need to decode again
        claims = decode_device_claims(data)
        self._last[key] = (data, claims)
        return claims

    def keep_only(self, paths: set[str]) -> None:
        for key in [k for k in self._fds if k not in paths]:
            self._close(key)

    def _close(self, key: str) -> None:
        entry = self._fds.pop(key, None)
        self._last.pop(key, None)
        self._read_at.pop(key, None)
        if entry is not None:
            with contextlib.suppress(OSError):
                os.close(entry[0])

    def close(self) -> None:
        for key in list(self._fds):
            self._close(key)
