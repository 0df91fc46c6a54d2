"""NVIDIA GPUs through NVML (nvidia-ml-py): discovery, links, MIG mode, XID/ECC events, host usage.

Every call blocks in the driver: the node agent runs them in a thread. `lock` serialises the
calls (the node agent's MIG code takes it too) and `handles` are NVML's, by GPU UUID.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

import pynvml

from tessera.settings import TesseraSettings

from ..node import HealthChange, PhysicalDevice
from .topology import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    describe_fault,
    is_critical,
    link_score,
)

log = logging.getLogger("tessera.node_agent.nvml")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def normalise_bus_id(bus_id: str | bytes) -> tuple[int, int, int, int]:
    """"00000000:17:00.0" and "0000:17:00.0" name the same device."""
    text = _text(bus_id).strip().lower()
    domain, _, rest = text.rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("0", "", domain)
    device, _, function = rest.partition(".")
    return int(domain or "0", 16), int(bus or "0", 16), int(device or "0", 16), int(function or "0")


def bind_nvml_library(path: str) -> None:
    """Make pynvml call the NVML library at `path`, whatever else the process has loaded.

    pynvml opens NVML by its soname, libnvidia-ml.so.1, and the dynamic loader answers that
    with the first library of that soname already in the process, which need not be this file
    (another component may have loaded a different one by path). So pynvml's handle is set to
    this file's, and its cache of entry points is dropped when the handle changes.
    """
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    current = getattr(pynvml, "nvmlLib", None)
    if current is not None and getattr(current, "_handle", None) == lib._handle:
        return
    pynvml.nvmlLib = lib
    cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
    if isinstance(cache, dict):
        cache.clear()


class NvmlBackend:
    """DeviceBackend over NVML (`settings.nvml_library` loaded first when set)."""

    def __init__(self, settings: TesseraSettings) -> None:
        self._ignored = settings.ignored_xid_set()
        if settings.nvml_library:
            bind_nvml_library(settings.nvml_library)
        pynvml.nvmlInit()
        self.lock = threading.Lock()
        self.handles: dict[str, object] = {}
        self._event_set: object | None = None
        self._closed = False

    def discover(self) -> list[PhysicalDevice]:
        with self.lock:
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            self.handles = dict(zip(uuids, handles, strict=True))
            bus_ids = {normalise_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId): u
                       for u, h in self.handles.items()}
            devices = []
            for i, (u, h) in enumerate(self.handles.items()):
                nvlinks = self._nvlink_peers(h, bus_ids)
                links = {}
                for peer, ph in self.handles.items():
                    if peer == u:
                        continue
                    try:
                        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(h, ph)
                    except pynvml.NVMLError:
                        level = None
                    links[peer] = link_score(level, nvlinks.get(peer, 0))
                devices.append(PhysicalDevice(
                    uuid=u, index=self.index_of(h, i), model=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_mib=pynvml.nvmlDeviceGetMemoryInfo(h).total >> 20,
                    numa=self.numa_of(h), links=links,
                    attributes={"mig": "true"} if self.in_mig_mode(h) else {},
                ))  # fmt: skip
            return devices

    @staticmethod
    def index_of(handle: object, default: int) -> int:
        try:
            return int(pynvml.nvmlDeviceGetIndex(handle))
        except pynvml.NVMLError:
            return default

    @staticmethod
    def numa_of(handle: object) -> int:
        try:
            return max(0, int(pynvml.nvmlDeviceGetNumaNodeId(handle)))
        except (pynvml.NVMLError, AttributeError):
            return 0

    @staticmethod
    def in_mig_mode(handle: object) -> bool:
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError:
            return False
        return current == pynvml.NVML_DEVICE_MIG_ENABLE

    @staticmethod
    def _nvlink_peers(handle: object, bus_ids: dict[tuple[int, ...], str]) -> dict[str, int]:
        """peer uuid -> number of active NVLinks to it."""
        peers: dict[str, int] = {}
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                    continue
                remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            except pynvml.NVMLError:
                break  # no more links (or no NVLink at all)
            peer = bus_ids.get(normalise_bus_id(remote.busId))
            if peer:
                peers[peer] = peers.get(peer, 0) + 1
        return peers

    def _ensure_event_set(self) -> object:
        if self._event_set is None:
            event_set = pynvml.nvmlEventSetCreate()
            wanted = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC | EVENT_SINGLE_BIT_ECC
            for u, h in self.handles.items():
                try:
                    supported = pynvml.nvmlDeviceGetSupportedEventTypes(h)
                    pynvml.nvmlDeviceRegisterEvents(h, wanted & supported, event_set)
                except pynvml.NVMLError as exc:
                    log.warning("cannot watch GPU events", extra={"uuid": u, "err": str(exc)})
            self._event_set = event_set
        return self._event_set

    def wait_health(self, timeout_s: float) -> HealthChange | None:
        """The next critical event, or None after `timeout_s` (ignored XIDs are skipped)."""
        event_set = self._ensure_event_set()
        try:
            data = pynvml.nvmlEventSetWait(event_set, max(1, int(timeout_s * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                return HealthChange(None, False, describe_fault(None, "lost", 0), "lost")
            raise
        xid = int(data.eventData)
        if not is_critical(int(data.eventType), xid, self._ignored):
            return None
        uuid = None
        if data.device:
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
            except pynvml.NVMLError:
                uuid = None
        cause = "xid" if data.eventType & EVENT_XID_CRITICAL else "ecc"
        code = xid if cause == "xid" else 0
        return HealthChange(uuid, False, describe_fault(uuid, cause, code), cause, code)

    def usage(self) -> dict[str, tuple[int, int, float]]:
        out: dict[str, tuple[int, int, float]] = {}
        with self.lock:
            for u, h in self.handles.items():
                try:
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                    util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
                except pynvml.NVMLError:
                    continue
                out[u] = (int(mem.used), int(mem.total), float(util))
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._event_set is not None:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(self._event_set)
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
