"""The per-container files shared by libvgpu and the node agent, mirrored from C.

The layout is defined once, in ``native/libvgpu/include/tessera_region.h``; the ctypes structures
below mirror it field for field and ``tests/native/test_layout.py`` compiles the header and checks
every offset and size. See ``native/libvgpu/README.md`` for the whole contract.

Two files per container:

* the **sealed limits file** ``<limits dir>/limits`` — written only by the node agent (or by
  ``tessera run``) with :func:`seal_limits` (write-temp + fsync + rename inside the directory, so a
  reader never sees half a file). The container mounts the *directory* read-only at
  :data:`SEALED_LIMITS_DIR`. libvgpu notices a new file within 100 ms (dynamic resize, device
  flags).
* the **usage region** — an mmap'ed file libvgpu initialises and updates (charged bytes, OOM
  counts, launch activity, measured SM %). The node agent reads it with :func:`read_region`
  (no lock needed: every counter is an aligned machine word) and creates the empty file with
  :func:`prepare_region_file` before the container starts.

The node agent's loop, per GPU::

    usage = {c: read_region(c.region_path) for c in containers_on_gpu}
    flags = activity_flags([ContainerActivity(c.key, c.priority, last_kernel_ns(usage[c], uuid))
                            for c in containers_on_gpu], now_ns=time.time_ns())
    for c in containers_on_gpu:
        set_device_flags(c.limits_dir, uuid, contended=flags[c.key].contended,
                         yield_=flags[c.key].yield_)   # rewrites only when something changed
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = [
    "CORE_POLICIES",
    "LIMITS_FILE_NAME",
    "LIMITS_MAGIC",
    "LIMITS_VERSION_MINOR",
    "MAX_DEVICES",
    "MAX_PROCS",
    "REGION_MAGIC",
    "SEALED_LIMITS_DIR",
    "VERSION_MAJOR",
    "VERSION_MINOR",
    "ActivityFlags",
    "ContainerActivity",
    "ContainerLimits",
    "DeviceLimit",
    "DeviceUsage",
    "ProcessUsage",
    "RegionFormatError",
    "RegionUsage",
    "activity_flags",
    "decode_device_claims",
    "decode_limits",
    "device_limit",
    "encode_limits",
    "prepare_region_file",
    "read_device_claims",
    "read_limits",
    "read_region",
    "seal_limits",
    "set_device_flags",
    "set_host_pid",
]

LIMITS_MAGIC = 0x4C525354  # "TSRL"
REGION_MAGIC = 0x52525354  # "TSRR"
VERSION_MAJOR = 1
VERSION_MINOR = 2  # the usage region's (1.2: the spill counters)
# The sealed limits file's minor version: 1.2 added the guaranteed/burst fields of each device
# (`sm_burst_pct`, `mem_burst_bytes`, `sm_allow_x100`). A file of minor < 2 reads with them 0:
# hard slices, exactly as before. 1.3 added `spill_bytes` (0 before: no spill).
LIMITS_VERSION_MINOR = 3
SM_ALLOW_FULL = 10000  # sm_allow_x100 of the whole card
MAX_DEVICES = 16
MAX_PROCS = 1024
UUID_LEN = 64
PATH_LEN = 256
SEALED_LIMITS_DIR = "/run/tessera/limits"
LIMITS_FILE_NAME = "limits"
ENV_LIMITS_DIR = "TESSERA_LIMITS_DIR"
ENV_REGION_PATH = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
LIMITS_POLL_MS = 20

POLICY_DEFAULT, POLICY_FORCE, POLICY_DISABLE = 0, 1, 2
CORE_POLICIES = {"default": POLICY_DEFAULT, "force": POLICY_FORCE, "disable": POLICY_DISABLE}
PRIORITY_HIGH, PRIORITY_LOW = 0, 1

LIMITS_SCRUB_ON_FREE = 1 << 0
LIMITS_OVERSUBSCRIBE = 1 << 1
LIMITS_LEASE = 1 << 2  # device memory is leased from the node agent (LEASE_SOCKET_NAME)
LEASE_SOCKET_NAME = "lease.sock"  # in the sealed limits directory, beside the limits file
LEASE_CHUNK = 64 << 20  # what libvgpu leases at least at a time
LEASE_SPILL_NAME = "host-spill"  # the lease name of spill (limits 1.3), in place of a GPU uuid
DEV_CONTENDED = 1 << 0
DEV_YIELD = 1 << 1
SM_UNKNOWN = 0xFFFFFFFF
LOCK_READY = 0x4B434F4C  # tsr_region.lock_ready once libvgpu initialised the lock


# ---- ctypes mirrors (names and order exactly as in tessera_region.h) --------------------------


class LimitsDeviceC(ctypes.Structure):
    _fields_ = [
        ("uuid", ctypes.c_char * UUID_LEN),
        ("mem_limit_bytes", ctypes.c_uint64),
        ("sm_limit_pct", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("yield_sm_pct", ctypes.c_uint32),
        ("sm_burst_pct", ctypes.c_uint32),
        ("mem_burst_bytes", ctypes.c_uint64),
        ("sm_allow_x100", ctypes.c_uint32),
        ("reserved1", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 3),
    ]


class LimitsC(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("major", ctypes.c_uint16),
        ("minor", ctypes.c_uint16),
        ("header_size", ctypes.c_uint32),
        ("num_devices", ctypes.c_uint32),
        ("generation", ctypes.c_uint64),
        ("priority", ctypes.c_int32),
        ("core_policy", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32),
        ("ctx_charge_bytes", ctypes.c_uint64),
        ("region_path", ctypes.c_char * PATH_LEN),
        ("spill_bytes", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 7),
        ("dev", LimitsDeviceC * MAX_DEVICES),
        ("checksum", ctypes.c_uint64),
    ]


class RegionDeviceC(ctypes.Structure):
    _fields_ = [
        ("uuid", ctypes.c_char * UUID_LEN),
        ("used_bytes", ctypes.c_uint64),
        ("peak_bytes", ctypes.c_uint64),
        ("limit_bytes", ctypes.c_uint64),
        ("oom_count", ctypes.c_uint64),
        ("last_kernel_ns", ctypes.c_uint64),
        ("sm_limit_pct", ctypes.c_uint32),
        ("achieved_sm_x100", ctypes.c_uint32),
        ("busy_ns_total", ctypes.c_uint64),
        ("budget_ns", ctypes.c_int64),
        ("budget_ts_ns", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 6),
    ]


class ProcSlotC(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_int32),
        ("host_pid", ctypes.c_int32),
        ("start_time", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("used", ctypes.c_uint64 * MAX_DEVICES),
        ("spilled_bytes", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 3),
    ]


class RegionLockC(ctypes.Union):
    _fields_ = [("raw", ctypes.c_uint8 * 64)]


class RegionC(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("major", ctypes.c_uint16),
        ("minor", ctypes.c_uint16),
        ("size", ctypes.c_uint32),
        ("num_devices", ctypes.c_uint32),
        ("max_procs", ctypes.c_uint32),
        ("priority", ctypes.c_int32),
        ("core_policy", ctypes.c_uint32),
        ("lock_ready", ctypes.c_uint32),
        ("lock", RegionLockC),
        ("created_ns", ctypes.c_uint64),
        ("reclaim_ns", ctypes.c_uint64),
        ("spilled_bytes", ctypes.c_uint64),
        ("spill_limit_bytes", ctypes.c_uint64),
        ("spilled_peak_bytes", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 3),
        ("dev", RegionDeviceC * MAX_DEVICES),
        ("procs", ProcSlotC * MAX_PROCS),
    ]


# ---- errors and plain values -------------------------------------------------------------------


class RegionFormatError(ValueError):
    """A limits file or region that is not ours, of another major version, or damaged."""


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class DeviceLimit:
    """One GPU of a container: a guarantee and (limits 1.2) a burst limit, for memory and compute.

    ``mem_limit_bytes`` / ``sm_limit_pct`` are the **guarantee** (0 = unlimited; SM 0/100 = none).
    ``mem_burst_bytes`` / ``sm_burst_pct`` are how far the container may go beyond it while the
    card has room; 0 (or the guarantee itself) = no burst, a hard slice as before 1.2.
    ``sm_allow_x100`` is set by the node agent at run time: the compute lent to the container now
    (% x 100, within guarantee..burst; 0 = the guarantee). See `device_limit` for building one.
    """

    uuid: str
    mem_limit_bytes: int = 0
    sm_limit_pct: int = 0
    contended: bool = False  # another container is active on this GPU (policy "default")
    yield_: bool = False  # a higher-priority container is active: SM limit := yield_sm_pct
    yield_sm_pct: int = 0
    mem_burst_bytes: int = 0
    sm_burst_pct: int = 0
    sm_allow_x100: int = 0

    @property
    def mem_guarantee_bytes(self) -> int:
        return self.mem_limit_bytes

    @property
    def sm_guarantee_pct(self) -> int:
        return self.sm_limit_pct

    @property
    def mem_burst_limit_bytes(self) -> int:
        """The most memory the container may ever hold on this GPU (0 = unlimited)."""
        if not self.mem_limit_bytes:
            return 0
        return max(self.mem_limit_bytes, self.mem_burst_bytes)

    @property
    def sm_burst_limit_pct(self) -> int:
        """The most compute the container may be lent on this GPU (0 = unlimited)."""
        if not 0 < self.sm_limit_pct < 100:
            return 0
        return max(self.sm_limit_pct, min(self.sm_burst_pct, 100))

    @property
    def mem_elastic(self) -> bool:
        return bool(self.mem_limit_bytes) and self.mem_burst_bytes > self.mem_limit_bytes

    @property
    def sm_elastic(self) -> bool:
        return 0 < self.sm_limit_pct < 100 and self.sm_burst_pct > self.sm_limit_pct


def device_limit(
    uuid: str,
    *,
    mem_guarantee_bytes: int = 0,
    mem_burst_bytes: int | None = None,
    sm_guarantee_pct: int = 0,
    sm_burst_pct: int | None = None,
) -> DeviceLimit:
    """A device's guaranteed and burst limits (None or equal to the guarantee: a hard slice).

    Raises ValueError when a burst is below its guarantee or given without one (0 = unlimited
    has nothing to burst from)."""
    if mem_guarantee_bytes < 0 or not 0 <= sm_guarantee_pct <= 100:
        raise ValueError(f"device {uuid}: guarantee out of range")
    mem_burst = 0
    if mem_burst_bytes is not None and mem_burst_bytes != mem_guarantee_bytes:
        if not mem_guarantee_bytes:
            raise ValueError(f"device {uuid}: a memory burst needs a memory guarantee")
        if mem_burst_bytes < mem_guarantee_bytes:
            raise ValueError(
                f"device {uuid}: memory burst {mem_burst_bytes} below the guarantee "
                f"{mem_guarantee_bytes}"
            )
        mem_burst = mem_burst_bytes
    sm_burst = 0
    if sm_burst_pct is not None and sm_burst_pct != sm_guarantee_pct:
        if not 0 < sm_guarantee_pct < 100:
            raise ValueError(f"device {uuid}: a compute burst needs a compute guarantee of 1-99 %")
        if not sm_guarantee_pct <= sm_burst_pct <= 100:
            raise ValueError(
                f"device {uuid}: compute burst {sm_burst_pct} % outside "
                f"{sm_guarantee_pct}..100 %"
            )
        sm_burst = sm_burst_pct
    return DeviceLimit(
        uuid,
        mem_limit_bytes=mem_guarantee_bytes,
        sm_limit_pct=sm_guarantee_pct,
        mem_burst_bytes=mem_burst,
        sm_burst_pct=sm_burst,
    )


@dataclass(frozen=True)
class ContainerLimits:
    """What the node agent seals for one container."""

    devices: tuple[DeviceLimit, ...]
    priority: int = PRIORITY_LOW
    core_policy: str = "default"
    scrub_on_free: bool = False
    oversubscribe: bool = False
    ctx_charge_bytes: int = 0  # 0 = libvgpu's default per extra context
    region_path: str = ""  # the region the container must use (path as seen in the container)
    lease: bool = False  # libvgpu leases memory from the agent's socket (fails closed without)
    # 1.3: host memory (bytes, all GPUs together) that device allocations which do not fit may
    # spill to through managed memory preferring the CPU (tessera.io/gpumem-spill); 0 = none
    spill_bytes: int = 0
    generation: int = 0  # set by seal_limits

    def device(self, uuid: str) -> DeviceLimit | None:
        return next((d for d in self.devices if d.uuid == uuid), None)


def encode_limits(limits: ContainerLimits, generation: int | None = None) -> bytes:
    """The exact bytes of a limits file (checksum included)."""
    if len(limits.devices) > MAX_DEVICES:
        raise ValueError(f"at most {MAX_DEVICES} devices per container")
    if limits.core_policy not in CORE_POLICIES:
        raise ValueError(f"core_policy must be one of {sorted(CORE_POLICIES)}")
    c = LimitsC()
    c.magic = LIMITS_MAGIC
    c.major, c.minor = VERSION_MAJOR, LIMITS_VERSION_MINOR
    c.header_size = ctypes.sizeof(LimitsC)
    c.num_devices = len(limits.devices)
    c.generation = limits.generation if generation is None else generation
    c.priority = limits.priority
    c.core_policy = CORE_POLICIES[limits.core_policy]
    c.flags = (LIMITS_SCRUB_ON_FREE if limits.scrub_on_free else 0) | (
        LIMITS_OVERSUBSCRIBE if limits.oversubscribe else 0
    ) | (LIMITS_LEASE if limits.lease else 0)
    c.ctx_charge_bytes = limits.ctx_charge_bytes
    if limits.spill_bytes < 0:
        raise ValueError("spill_bytes must not be negative")
    c.spill_bytes = limits.spill_bytes
    c.region_path = _cstr(limits.region_path, PATH_LEN, "region_path")
    for i, d in enumerate(limits.devices):
        if (
            d.mem_limit_bytes < 0
            or not 0 <= d.sm_limit_pct <= 100
            or not 0 <= d.yield_sm_pct <= 100
            or not 0 <= d.sm_burst_pct <= 100
            or d.mem_burst_bytes < 0
            or not 0 <= d.sm_allow_x100 <= SM_ALLOW_FULL
        ):
            raise ValueError(f"device {d.uuid}: limits out of range")
        e = c.dev[i]
        e.uuid = _cstr(d.uuid, UUID_LEN, "uuid")
        e.mem_limit_bytes = d.mem_limit_bytes
        e.sm_limit_pct = d.sm_limit_pct
        e.flags = (DEV_CONTENDED if d.contended else 0) | (DEV_YIELD if d.yield_ else 0)
        e.yield_sm_pct = d.yield_sm_pct
        e.mem_burst_bytes = d.mem_burst_bytes
        e.sm_burst_pct = d.sm_burst_pct
        e.sm_allow_x100 = d.sm_allow_x100
    raw = bytes(c)
    c.checksum = fnv1a64(raw[: LimitsC.checksum.offset])
    return bytes(c)


def decode_limits(data: bytes) -> ContainerLimits:
    if len(data) < ctypes.sizeof(LimitsC):
        raise RegionFormatError("limits file too short")
    c = LimitsC.from_buffer_copy(data[: ctypes.sizeof(LimitsC)])
    if c.magic != LIMITS_MAGIC:
        raise RegionFormatError(f"not a limits file (magic {c.magic:#x})")
    if c.major != VERSION_MAJOR:
        raise RegionFormatError(
            f"limits file version {c.major}.{c.minor}, expected {VERSION_MAJOR}.x"
        )
    if c.checksum != fnv1a64(data[: LimitsC.checksum.offset]):
        raise RegionFormatError("limits file checksum mismatch")
    if c.num_devices > MAX_DEVICES:
        raise RegionFormatError("limits file: too many devices")
    policy = {v: k for k, v in CORE_POLICIES.items()}.get(c.core_policy, "default")
    elastic = c.minor >= 2  # before 1.2 these bytes were reserved: hard slices
    devices = tuple(
        DeviceLimit(
            uuid=c.dev[i].uuid.decode(),
            mem_limit_bytes=c.dev[i].mem_limit_bytes,
            sm_limit_pct=c.dev[i].sm_limit_pct,
            contended=bool(c.dev[i].flags & DEV_CONTENDED),
            yield_=bool(c.dev[i].flags & DEV_YIELD),
            yield_sm_pct=c.dev[i].yield_sm_pct,
            mem_burst_bytes=c.dev[i].mem_burst_bytes if elastic else 0,
            sm_burst_pct=c.dev[i].sm_burst_pct if elastic else 0,
            sm_allow_x100=c.dev[i].sm_allow_x100 if elastic else 0,
        )
        for i in range(c.num_devices)
    )
    return ContainerLimits(
        devices=devices,
        priority=c.priority,
        core_policy=policy,
        scrub_on_free=bool(c.flags & LIMITS_SCRUB_ON_FREE),
        oversubscribe=bool(c.flags & LIMITS_OVERSUBSCRIBE),
        lease=bool(c.flags & LIMITS_LEASE),
        ctx_charge_bytes=c.ctx_charge_bytes,
        region_path=c.region_path.decode(),
        spill_bytes=c.spill_bytes if c.minor >= 3 else 0,  # reserved before 1.3
        generation=c.generation,
    )


def read_limits(directory: str | os.PathLike[str]) -> ContainerLimits | None:
    """The limits sealed in ``directory``, or None when there is no limits file."""
    try:
        data = (Path(directory) / LIMITS_FILE_NAME).read_bytes()
    except FileNotFoundError:
        return None
    return decode_limits(data)


# set_device_flags reads, changes and rewrites the file: the node agent calls it from several
# loops (contention flags, resize, compute lending, PreStart's seal), which must not lose each
# other's changes. One lock per process (rewrites are rare and short).
_REWRITE_LOCK = threading.RLock()


def seal_limits(directory: str | os.PathLike[str], limits: ContainerLimits) -> ContainerLimits:
    """Atomically (re)write the limits file in ``directory``; returns what was written.

    The generation is the previous file's + 1. The file is made read-only (0444); the directory
    itself must be mounted read-only into the container so that the tenant cannot replace it.
    """
    with _REWRITE_LOCK:
        return _seal_limits(Path(directory), limits)


def _seal_limits(d: Path, limits: ContainerLimits) -> ContainerLimits:
    d.mkdir(parents=True, exist_ok=True)
    try:
        previous = read_limits(d)
    except RegionFormatError:
        previous = None
    gen = (previous.generation if previous else 0) + 1
    sealed = replace(limits, generation=gen)
    data = encode_limits(sealed)
    fd, tmp = tempfile.mkstemp(prefix=".limits.", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o444)
        os.rename(tmp, d / LIMITS_FILE_NAME)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return sealed


def set_device_flags(
    directory: str | os.PathLike[str],
    uuid: str,
    *,
    contended: bool | None = None,
    yield_: bool | None = None,
    yield_sm_pct: int | None = None,
    mem_limit_bytes: int | None = None,
    sm_limit_pct: int | None = None,
    mem_burst_bytes: int | None = None,
    sm_burst_pct: int | None = None,
    sm_allow_x100: int | None = None,
) -> bool:
    """Change one device's run-time flags or limits; rewrites the file only if something changed.

    Returns True when the file was rewritten. Raises FileNotFoundError without a limits file and
    KeyError when the container has no such device.
    """
    with _REWRITE_LOCK:
        return _set_device_flags(
            directory, uuid, contended=contended, yield_=yield_, yield_sm_pct=yield_sm_pct,
            mem_limit_bytes=mem_limit_bytes, sm_limit_pct=sm_limit_pct,
            mem_burst_bytes=mem_burst_bytes, sm_burst_pct=sm_burst_pct,
            sm_allow_x100=sm_allow_x100,
        )


def _set_device_flags(directory: str | os.PathLike[str], uuid: str, **fields: int | bool | None
                      ) -> bool:
    current = read_limits(directory)
    if current is None:
        raise FileNotFoundError(Path(directory) / LIMITS_FILE_NAME)
    dev = current.device(uuid)
    if dev is None:
        raise KeyError(uuid)
    changes = {k: v for k, v in fields.items() if v is not None}
    new = replace(dev, **changes)
    if new == dev:
        return False
    devices = tuple(new if d.uuid == uuid else d for d in current.devices)
    seal_limits(directory, replace(current, devices=devices))
    return True


# ---- the usage region --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceUsage:
    index: int
    uuid: str
    used_bytes: int
    peak_bytes: int
    limit_bytes: int
    oom_count: int
    last_kernel_ns: int  # CLOCK_REALTIME ns (time.time_ns()); 0 = no launch seen
    sm_limit_pct: int  # SM % in force now: 100 = not limited, 0 = paused
    achieved_sm_pct: float | None  # None: libvgpu does not time this device (unthrottled)
    busy_ns_total: int
    launches: int


@dataclass(frozen=True)
class ProcessUsage:
    slot: int
    pid: int
    host_pid: int
    start_time: int
    launches: int
    used: tuple[int, ...]  # bytes per device slot (same indexes as RegionUsage.devices)
    spilled_bytes: int = 0  # region 1.2: host memory this process spilled


@dataclass(frozen=True)
class RegionUsage:
    major: int
    minor: int
    priority: int
    core_policy: int
    created_ns: int
    devices: tuple[DeviceUsage, ...]
    processes: tuple[ProcessUsage, ...] = field(default_factory=tuple)
    # region 1.2: host memory the container's device allocations spilled to (all GPUs), and the
    # spill limit libvgpu has in force (0: none)
    spilled_bytes: int = 0
    spill_limit_bytes: int = 0
    spilled_peak_bytes: int = 0

    def device(self, uuid: str) -> DeviceUsage | None:
        return next((d for d in self.devices if d.uuid == uuid), None)


REGION_SIZE = ctypes.sizeof(RegionC)


def prepare_region_file(path: str | os.PathLike[str], mode: int = 0o666) -> None:
    """Create the container's region with a valid header (libvgpu initialises its lock on first
    use). libvgpu under sealed limits refuses to charge against a region without one, so a tenant
    that truncates or zeroes the file cannot hand new processes a fresh budget. Keeps a region
    that already has a valid header; otherwise writes a new one atomically (temp + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(p, "rb") as f:
            head = RegionC.from_buffer_copy(f.read(REGION_SIZE).ljust(REGION_SIZE, b"\0"))
        if (
            os.stat(p).st_size == REGION_SIZE
            and head.magic == REGION_MAGIC
            and head.major == VERSION_MAJOR
            and head.size == REGION_SIZE
        ):
            os.chmod(p, mode)
            return
    except (FileNotFoundError, ValueError):
        pass
    c = RegionC()
    c.magic, c.major, c.minor, c.size = REGION_MAGIC, VERSION_MAJOR, VERSION_MINOR, REGION_SIZE
    c.max_procs = MAX_PROCS
    c.created_ns = time.time_ns()
    for d in c.dev:
        d.sm_limit_pct, d.achieved_sm_x100 = 100, SM_UNKNOWN
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(c))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_region(path: str | os.PathLike[str]) -> RegionUsage | None:
    """A snapshot of a container's usage region; None when absent or not yet initialised."""
    try:
        with open(path, "rb") as f:
            data = f.read(REGION_SIZE)
    except FileNotFoundError:
        return None
    if len(data) < 8:
        return None
    magic = int.from_bytes(data[:4], "little")
    if magic == 0:
        return None
    if magic != REGION_MAGIC:
        raise RegionFormatError(f"not a usage region (magic {magic:#x})")
    if len(data) < REGION_SIZE:
        raise RegionFormatError("usage region too short")
    r = RegionC.from_buffer_copy(data)
    if r.major != VERSION_MAJOR:
        raise RegionFormatError(f"region version {r.major}.{r.minor}, expected {VERSION_MAJOR}.x")
    devices = tuple(
        DeviceUsage(
            index=i,
            uuid=d.uuid.decode(errors="replace"),
            used_bytes=d.used_bytes,
            peak_bytes=d.peak_bytes,
            limit_bytes=d.limit_bytes,
            oom_count=d.oom_count,
            last_kernel_ns=d.last_kernel_ns,
            sm_limit_pct=d.sm_limit_pct,
            achieved_sm_pct=None if d.achieved_sm_x100 == SM_UNKNOWN else d.achieved_sm_x100 / 100,
            busy_ns_total=d.busy_ns_total,
            launches=d.launches,
        )
        for i, d in enumerate(r.dev[: min(r.num_devices, MAX_DEVICES)])
    )
    procs = tuple(
        ProcessUsage(
            slot=i,
            pid=s.pid,
            host_pid=s.host_pid,
            start_time=s.start_time,
            launches=s.launches,
            used=tuple(s.used[: len(devices)]),
            spilled_bytes=s.spilled_bytes if r.minor >= 2 else 0,
        )
        for i, s in enumerate(r.procs)
        if s.pid != 0
    )
    return RegionUsage(
        major=r.major,
        minor=r.minor,
        priority=r.priority,
        core_policy=r.core_policy,
        created_ns=r.created_ns,
        devices=devices,
        processes=procs,
        spilled_bytes=r.spilled_bytes if r.minor >= 2 else 0,
        spill_limit_bytes=r.spill_limit_bytes if r.minor >= 2 else 0,
        spilled_peak_bytes=r.spilled_peak_bytes if r.minor >= 2 else 0,
    )


CLAIMS_SIZE = RegionC.procs.offset  # the header and the device table, not the process slots
_DEV0 = RegionC.dev.offset
_DEV_SIZE = ctypes.sizeof(RegionDeviceC)
_HEAD = struct.Struct(f"<IH{RegionC.num_devices.offset - 6}xI")  # magic, major, num_devices
_OFF_USED, _OFF_SM = RegionDeviceC.used_bytes.offset, RegionDeviceC.achieved_sm_x100.offset
_CLAIM = struct.Struct(  # uuid, used_bytes, achieved_sm_x100 of one device entry
    f"<{UUID_LEN}s{_OFF_USED - UUID_LEN}xQ{_OFF_SM - _OFF_USED - 8}xI"
)


def decode_device_claims(data: bytes) -> dict[str, tuple[int, float | None]] | None:
    """uuid -> (used bytes, achieved SM % or None) as a region claims, from its first
    `CLAIMS_SIZE` bytes; None when not initialised, of another major version, or cut short.
    Cheap enough for the node agent's watchdog to call for every busy container each poll."""
    if len(data) < CLAIMS_SIZE:
        return None
    magic, major, num = _HEAD.unpack_from(data, 0)
    if magic != REGION_MAGIC or major != VERSION_MAJOR:
        return None
    out: dict[str, tuple[int, float | None]] = {}
    for i in range(min(num, MAX_DEVICES)):
        uuid, used, sm = _CLAIM.unpack_from(data, _DEV0 + i * _DEV_SIZE)
        out[uuid.split(b"\0", 1)[0].decode(errors="replace")] = (
            used, None if sm == SM_UNKNOWN else sm / 100)
    return out


def read_device_claims(path: str | os.PathLike[str]) -> dict[str, tuple[int, float | None]] | None:
    """`decode_device_claims` of a region file; None when absent or unreadable."""
    try:
        with open(path, "rb") as f:
            return decode_device_claims(f.read(CLAIMS_SIZE))
    except OSError:
        return None


def set_host_pid(path: str | os.PathLike[str], slot: int, host_pid: int) -> None:
    """Record the host pid of a process slot (the only region field the node agent writes)."""
    if not 0 <= slot < MAX_PROCS:
        raise IndexError(slot)
    off = RegionC.procs.offset + slot * ctypes.sizeof(ProcSlotC) + ProcSlotC.host_pid.offset
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(int(host_pid).to_bytes(4, "little", signed=True))


# ---- the contention / priority policy the node agent applies per GPU ---------------------------


@dataclass(frozen=True)
class ContainerActivity:
    key: str  # any id the caller uses for the container
    priority: int  # PRIORITY_HIGH (0) or PRIORITY_LOW (1)
    last_kernel_ns: int  # from DeviceUsage.last_kernel_ns for this GPU (0 = never)


@dataclass(frozen=True)
class ActivityFlags:
    contended: bool  # another container launched on this GPU within the window
    yield_: bool  # a container of higher priority did


def activity_flags(
    containers: Iterable[ContainerActivity], now_ns: int, window_ns: int = 1_000_000_000
) -> dict[str, ActivityFlags]:
    """Which flags each container on one GPU should carry (pure; no I/O)."""
    items: Sequence[ContainerActivity] = list(containers)
    active = [c for c in items if c.last_kernel_ns and now_ns - c.last_kernel_ns <= window_ns]
    out = {}
    for c in items:
        others = [a for a in active if a.key != c.key]
        out[c.key] = ActivityFlags(
            contended=bool(others),
            yield_=any(a.priority < c.priority for a in others),
        )
    return out


def _cstr(value: str, size: int, what: str) -> bytes:
    b = value.encode()
    if len(b) >= size:
        raise ValueError(f"{what} longer than {size - 1} bytes")
    return b
