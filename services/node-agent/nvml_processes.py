"""Which processes hold each GPU, and how busy they keep it, straight from NVML (ctypes).

The watchdog's only driver I/O. Structures are NVIDIA's `nvml.h` (nvmlProcessInfo_v1_t,
nvmlProcessInfo_v2_t — also what the `_v3` entry point fills — and
nvmlProcessUtilizationSample_t). Drivers differ in what they export: the process list tries
`nvmlDeviceGetComputeRunningProcesses_v3`, then `_v2`, then the unversioned v1; utilisation comes
from `nvmlDeviceGetProcessUtilization`. A missing entry point is logged once, counted in
`errors`, and the watchdog goes on with what is left (no utilisation: no compute judgement);
every call blocks in the driver, so the caller runs `poll` in a thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from typing import Any, NamedTuple, Protocol

NVML_SUCCESS = 0
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
UUID_BUFFER = 96
INITIAL_ENTRIES = 64  # result arrays start this big and grow when NVML asks for more
PROCESS_LIST_ENTRY_POINTS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
UTILIZATION_ENTRY_POINT = "nvmlDeviceGetProcessUtilization"


class ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class ProcessInfoV2(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class ProcessUtilizationSample(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


_STRUCTS = {
    "nvmlDeviceGetComputeRunningProcesses_v3": ProcessInfoV2,
    "nvmlDeviceGetComputeRunningProcesses_v2": ProcessInfoV2,
    "nvmlDeviceGetComputeRunningProcesses": ProcessInfoV1,
}


class GpuProcess(NamedTuple):  # a tuple: one per process, every poll
    uuid: str
    pid: int
    used_bytes: int | None  # None: the driver does not say (NVML_VALUE_NOT_AVAILABLE)
    sm_pct: float | None  # None: utilisation unavailable on this driver


class ProcessProbe(Protocol):
    """Where the watchdog learns what GPUs really hold (NVML, or a test's stand-in)."""

    errors: Counter[str]

    def poll(self, utilization: bool = True) -> list[GpuProcess]: ...

    def close(self) -> None: ...


class NvmlError(RuntimeError):
    pass


class NvmlProcessProbe:
    """NVML through ctypes. `library` None = the system's libnvidia-ml.so.1."""

    def __init__(self, library: str | None = None, log: logging.Logger | None = None) -> None:
        self.log = log or logging.getLogger("tessera.node_agent.watchdog")
        self.errors: Counter[str] = Counter()
        self._lib = ctypes.CDLL(library or "libnvidia-ml.so.1")
        self._missing: set[str] = set()
        self._fns: dict[str, Any] = {}
        init = self._fn("nvmlInit_v2")
        if init is None or init() != NVML_SUCCESS:
            raise NvmlError("nvmlInit_v2 failed: NVML unusable for the watchdog")
        self._open = True
        self._handles: dict[str, ctypes.c_void_p] = {}
        self._last_seen_us: dict[str, int] = {}
        self._buffers: dict[str, ctypes.Array] = {}  # one per entry point (polls are serial)
        self._list_fn: str | None = next(
            (n for n in PROCESS_LIST_ENTRY_POINTS if self._fn(n) is not None), None)
        if self._list_fn is None:
            self._degraded("no nvmlDeviceGetComputeRunningProcesses* entry point",
                           "process_list")
        if self._fn(UTILIZATION_ENTRY_POINT) is None:
            self._degraded("no nvmlDeviceGetProcessUtilization: compute is not judged",
                           "process_utilization")
        self._discover()

    # ---- entry points --------------------------------------------------------------------------

    def _fn(self, name: str) -> Any | None:
        """The resolved entry point, or None when this driver lacks it (remembered)."""
        if name in self._fns:
            return self._fns[name]
        if name in self._missing:
            return None
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            self._missing.add(name)
            return None
        fn.restype = ctypes.c_int
        self._fns[name] = fn
        return fn

    def _degraded(self, what: str, counter: str) -> None:
        self.errors[f"missing:{counter}"] += 1
        self.log.error("watchdog degraded", extra={"err": what})

    @property
    def list_entry_point(self) -> str | None:
        return self._list_fn

    @property
    def gpus(self) -> list[str]:
        """UUIDs of the GPUs NVML lists."""
        return list(self._handles)

    @property
    def has_utilization(self) -> bool:
        return self._fn(UTILIZATION_ENTRY_POINT) is not None

    def _discover(self) -> None:
        count_fn, by_index, get_uuid = (self._fn("nvmlDeviceGetCount_v2"),
                                        self._fn("nvmlDeviceGetHandleByIndex_v2"),
                                        self._fn("nvmlDeviceGetUUID"))
        if count_fn is None or by_index is None or get_uuid is None:
            self._degraded("cannot enumerate GPUs (count/handle/UUID entry point missing)",
                           "enumerate")
            return
        count = ctypes.c_uint(0)
        if count_fn(ctypes.byref(count)) != NVML_SUCCESS:
            self.errors["enumerate"] += 1
            return
        handles = {}
        for i in range(count.value):
            handle = ctypes.c_void_p()
            buf = ctypes.create_string_buffer(UUID_BUFFER)
            if by_index(ctypes.c_uint(i), ctypes.byref(handle)) != NVML_SUCCESS:
                continue
            if get_uuid(handle, buf, ctypes.c_uint(UUID_BUFFER)) != NVML_SUCCESS:
                continue
            handles[buf.value.decode(errors="replace")] = handle
        self._handles = handles

    # ---- the poll ------------------------------------------------------------------------------

    def poll(self, utilization: bool = True) -> list[GpuProcess]:
        """Every compute process on every GPU, with its memory and SM % (None without
        `utilization`: the next poll that asks covers the time since the last that did)."""
        if not self._open:
            return []
        if not self._handles:
            self._discover()
        out: list[GpuProcess] = []
        for uuid, handle in self._handles.items():
            procs = self._processes(uuid, handle)
            if not procs:
                continue  # nothing runs there (or the list failed): no utilisation to ask
            util = self._utilization(uuid, handle) if utilization else None
            for pid, used in procs:
                sm = None if util is None else float(util.get(pid, 0))
                out.append(GpuProcess(uuid, pid, used, sm))
        return out

    def _buffer(self, kind: str, struct: type[ctypes.Structure], size: int) -> ctypes.Array:
        """A reused result array of at least `size` entries (grown by doubling)."""
        buf = self._buffers.get(kind)
        if buf is None or len(buf) < size:
            buf = (struct * max(size, 2 * len(buf) if buf is not None else INITIAL_ENTRIES))()
            self._buffers[kind] = buf
        return buf

    def _processes(self, uuid: str, handle: ctypes.c_void_p) -> list[tuple[int, int | None]] | None:
        """One call with a buffer that is usually big enough; on INSUFFICIENT_SIZE (the count
        is then the size needed) a bigger one, as nvml.h documents."""
        if self._list_fn is None:
            return None
        fn = self._fns[self._list_fn]
        struct = _STRUCTS[self._list_fn]
        needed = 0
        for _attempt in range(4):  # the list may grow between the calls
            buf = self._buffer(self._list_fn, struct, needed)
            count = ctypes.c_uint(len(buf))
            rc = fn(handle, ctypes.byref(count), buf)
            if rc == NVML_SUCCESS:
                out = []
                for entry in buf[: min(count.value, len(buf))]:
                    used = entry.usedGpuMemory
                    out.append((entry.pid, None if used == NVML_VALUE_NOT_AVAILABLE else used))
                return out
            if rc != NVML_ERROR_INSUFFICIENT_SIZE:
                break
            needed = count.value + 4
        self.errors[f"{self._list_fn}:{rc}"] += 1
        self.log.warning("NVML process list failed", extra={"uuid": uuid, "rc": rc})
        return None

    def _utilization(self, uuid: str, handle: ctypes.c_void_p) -> dict[int, float] | None:
        """pid -> SM % over the samples since the last poll (absent pid: idle); None: unknown."""
        fn = self._fn(UTILIZATION_ENTRY_POINT)
        if fn is None:
            return None
        last = ctypes.c_ulonglong(self._last_seen_us.get(uuid, 0))
        needed = 0
        for _attempt in range(4):
            buf = self._buffer(UTILIZATION_ENTRY_POINT, ProcessUtilizationSample, needed)
            count = ctypes.c_uint(len(buf))
            rc = fn(handle, buf, ctypes.byref(count), last)
            if rc == NVML_ERROR_NOT_FOUND:
                return {}  # no sample since the last poll: nobody ran
            if rc == NVML_SUCCESS:
                per_pid: dict[int, list[int]] = {}
                newest = last.value
                for sample in buf[: min(count.value, len(buf))]:
                    per_pid.setdefault(int(sample.pid), []).append(min(int(sample.smUtil), 100))
                    newest = max(newest, int(sample.timeStamp))
                self._last_seen_us[uuid] = newest
                return {pid: sum(v) / len(v) for pid, v in per_pid.items()}
            if rc != NVML_ERROR_INSUFFICIENT_SIZE:
                break
            needed = count.value + 4
        self.errors[f"{UTILIZATION_ENTRY_POINT}:{rc}"] += 1
        return None

    def close(self) -> None:
        if self._open:
            self._open = False
            shutdown = self._fn("nvmlShutdown")
            if shutdown is not None:
                shutdown()
