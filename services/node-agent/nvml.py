"""GPUs through NVML (nvidia-ml-py): discovery, links, MIG mode, XID/ECC events, host usage.

Every call here blocks in the driver: the agent runs them in a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

import pynvml
from tessera.node_agent.devices import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    HealthEvent,
    PhysicalGpu,
    is_critical,
    link_score,
)

from tessera.settings import TesseraSettings

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


class NvmlSource:
    def __init__(self, settings: TesseraSettings) -> None:
        self._ignored = settings.ignored_xid_set()
        if settings.nvml_library:
            # Load the named library first; its soname (libnvidia-ml.so.1) then satisfies
            # pynvml's own dlopen, and pynvml uses it.
            ctypes.CDLL(settings.nvml_library, mode=ctypes.RTLD_GLOBAL)
        pynvml.nvmlInit()
        self._lock = threading.Lock()
        self._handles: dict[str, object] = {}
        self._event_set: object | None = None
        self._closed = False

    def discover(self) -> list[PhysicalGpu]:
        with self._lock:
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            self._handles = dict(zip(uuids, handles, strict=True))
            bus_ids = {normalise_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId): u
                       for u, h in self._handles.items()}
            gpus = []
            for i, (u, h) in enumerate(self._handles.items()):
                nvlinks = self._nvlink_peers(h, bus_ids)
                links = {}
                for peer, ph in self._handles.items():
                    if peer == u:
                        continue
                    try:
                        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(h, ph)
                    except pynvml.NVMLError:
                        level = None
                    links[peer] = link_score(level, nvlinks.get(peer, 0))
                gpus.append(PhysicalGpu(
                    uuid=u,
                    index=self._index(h, i),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_mib=pynvml.nvmlDeviceGetMemoryInfo(h).total >> 20,
                    numa=self._numa(h),
                    mig=self._mig(h),
                    links=links,
                ))
            return gpus

    @staticmethod
    def _index(handle: object, default: int) -> int:
        try:
            return int(pynvml.nvmlDeviceGetIndex(handle))
        except pynvml.NVMLError:
            return default

    @staticmethod
    def _numa(handle: object) -> int:
        try:
            return max(0, int(pynvml.nvmlDeviceGetNumaNodeId(handle)))
        except (pynvml.NVMLError, AttributeError):
            return 0

    @staticmethod
    def _mig(handle: object) -> bool:
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
            for u, h in self._handles.items():
                try:
                    supported = pynvml.nvmlDeviceGetSupportedEventTypes(h)
                    pynvml.nvmlDeviceRegisterEvents(h, wanted & supported, event_set)
                except pynvml.NVMLError as exc:
                    log.warning("cannot watch GPU events", extra={"uuid": u, "err": str(exc)})
            self._event_set = event_set
        return self._event_set

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        """The next critical event, or None after `timeout_s` (ignored XIDs are skipped)."""
        event_set = self._ensure_event_set()
        try:
            data = pynvml.nvmlEventSetWait(event_set, max(1, int(timeout_s * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                return HealthEvent(None, "lost")
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
        kind = "xid" if data.eventType & EVENT_XID_CRITICAL else "ecc"
        return HealthEvent(uuid, kind, xid if kind == "xid" else 0)

    def host_usage(self) -> dict[str, tuple[int, int, float]]:
        out: dict[str, tuple[int, int, float]] = {}
        with self._lock:
            for u, h in self._handles.items():
                try:
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                    util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
                except pynvml.NVMLError:
                    continue
                out[u] = (int(mem.used), int(mem.total), float(util))
        return out

    def mig_offers(self) -> list:
        """The MIG instances that exist on the GPUs (nvml_mig.py), as static offers."""
        from tessera.node_agent import nvml_mig
        from tessera.node_agent.mig_static import MigOffer

        out = []
        with self._lock:
            for index, (u, h) in enumerate(self._handles.items()):
                for d in nvml_mig.list_devices(h, self._index(h, index)):
                    out.append(MigOffer(uuid=d.uuid, parent_uuid=u, parent_index=d.parent_index,
                                        profile=d.profile, start=d.start, gi_id=d.gi_id,
                                        numa=self._numa(h)))
        return out

    def mig_backend(self) -> object:
        """Dynamic MIG through NVML (nvml_mig.py) on the GPUs in MIG mode, under this source's
        NVML lock (mig_dynamic.MigReconciler's three calls and `handles`)."""
        from tessera.node_agent import nvml_mig

        with self._lock:
            handles = {u: (h, self._index(h, i)) for i, (u, h) in enumerate(self._handles.items())
                       if self._mig(h) and nvml_mig.model_of(h) is not None}  # fmt: skip
        return nvml_mig.LockedNvmlMig(handles, self._lock)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._event_set is not None:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(self._event_set)
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
