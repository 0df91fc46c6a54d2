"""MIG through NVML (nvidia-ml-py): discover, create and destroy GPU + compute instances.

A MIG *device* (what a container gets, what `nvidia-smi -L` lists as `MIG-<uuid>`) is one
compute instance inside one GPU instance. Tessera creates one compute instance spanning the whole
GPU instance (as `nvidia-smi mig -cgi <profile> -C` does), so device = GPU instance here.
Every call blocks in the driver: run them in a thread, under the caller's NVML lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from dataclasses import dataclass

import pynvml

from tessera import mig

log = logging.getLogger("tessera.node_agent.nvml_mig")


class MigNvmlError(RuntimeError):
    """An NVML MIG call failed; `code` is NVML's return code, the message says what was tried."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

    @property
    def in_use(self) -> bool:
        return self.code == pynvml.NVML_ERROR_IN_USE

    @property
    def no_room(self) -> bool:
        return self.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device as NVML reports it."""

    parent_uuid: str
    parent_index: int
    uuid: str  # "MIG-…"
    profile: str  # "1g.10gb"
    gi_id: int
    ci_id: int
    start: int  # the GPU instance's first memory slice
    memory_mib: int

    @property
    def instance(self) -> mig.Instance:
        return mig.Instance(self.profile, self.start)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def model_of(handle: object) -> mig.MigModel | None:
    return mig.model_for(_text(pynvml.nvmlDeviceGetName(handle)))


def _profile_names(handle: object, model: mig.MigModel) -> dict[int, str]:
    """NVML profile id → profile name, for the profiles `model` has and the driver offers."""
    names: dict[int, str] = {}
    for profile in model.profiles:
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
                handle, mig.nvml_profile_index(model, profile), version=1)
        except pynvml.NVMLError:
            continue  # a profile this driver or card does not offer
        names[int(info.id)] = profile.name
    return names


def list_devices(handle: object, parent_index: int) -> list[MigDevice]:
    """The MIG devices that exist on the GPU `handle` (empty when MIG is off or not supported)."""
    model = model_of(handle)
    if model is None:
        return []
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError:
        return []
    parent = _text(pynvml.nvmlDeviceGetUUID(handle))
    names = _profile_names(handle, model)
    out: list[MigDevice] = []
    for index in range(count):
        try:
            dev = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue  # no device at this index
            raise
        gi_id = pynvml.nvmlDeviceGetGpuInstanceId(dev)
        ci_id = pynvml.nvmlDeviceGetComputeInstanceId(dev)
        gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
        name = names.get(int(info.profileId))
        if name is None:
            log.warning("MIG instance of an unknown profile ignored",
                        extra={"gpu": parent, "profile_id": int(info.profileId)})
            continue
        out.append(MigDevice(
            parent_uuid=parent,
            parent_index=parent_index,
            uuid=_text(pynvml.nvmlDeviceGetUUID(dev)),
            profile=name,
            gi_id=int(gi_id),
            ci_id=int(ci_id),
            start=int(info.placement.start),
            memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(dev).total) >> 20,
        ))
    return out


def create(handle: object, parent_index: int, profile_name: str, start: int) -> MigDevice:
    """Create a GPU instance of `profile_name` at memory slice `start` and one compute instance
    spanning it; MigNvmlError (nothing left behind) when NVML refuses."""
    model = model_of(handle)
    if model is None:
        raise MigNvmlError("this GPU model has no MIG profiles Tessera knows",
                           pynvml.NVML_ERROR_NOT_SUPPORTED)
    profile = model.profile(profile_name)
    try:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
            handle, mig.nvml_profile_index(model, profile), version=1)
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.memory_slices)
        # pynvml hands `placement` to the C function as is: NVML takes a pointer
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id,
                                                             ctypes.byref(placement))
    except pynvml.NVMLError as exc:
        raise MigNvmlError(f"creating GPU instance {profile_name} at slice {start}: {exc}",
                           exc.value) from exc
    try:
        ci_index = mig.NVML_CI_PROFILE_BY_COMPUTE[profile.compute_slices]
        ci_info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_index, 0, version=1)
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    except pynvml.NVMLError as exc:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlGpuInstanceDestroy(gi)
        raise MigNvmlError(f"creating the compute instance of {profile_name}: {exc}",
                           exc.value) from exc
    gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
    for device in list_devices(handle, parent_index):
        if device.gi_id == gi_id:
            return device
    raise MigNvmlError(f"GPU instance {gi_id} created but NVML lists no MIG device for it",
                       pynvml.NVML_ERROR_UNKNOWN)


def destroy(handle: object, gi_id: int) -> None:
    """Destroy GPU instance `gi_id` and its compute instances. MigNvmlError with `in_use` when a
    process still runs in it (NVML_ERROR_IN_USE): nothing of a busy instance is destroyed."""
    try:
        gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
            return  # already gone
        raise MigNvmlError(f"finding GPU instance {gi_id}: {exc}", exc.value) from exc
    for ci_index in sorted(set(mig.NVML_CI_PROFILE_BY_COMPUTE.values())):
        count = ctypes.c_uint(0)
        try:
            pynvml.nvmlGpuInstanceGetComputeInstances(gi, ci_index, None, ctypes.byref(count))
        except pynvml.NVMLError:
            continue  # a compute profile this GPU instance does not have
        if not count.value:
            continue
        cis = (pynvml.c_nvmlComputeInstance_t * count.value)()
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, ci_index, cis, ctypes.byref(count))
        for ci in cis[: count.value]:
            try:
                pynvml.nvmlComputeInstanceDestroy(ci)
            except pynvml.NVMLError as exc:
                raise MigNvmlError(f"destroying a compute instance of GPU instance {gi_id}: "
                                   f"{exc}", exc.value) from exc
    try:
        pynvml.nvmlGpuInstanceDestroy(gi)
    except pynvml.NVMLError as exc:
        raise MigNvmlError(f"destroying GPU instance {gi_id}: {exc}", exc.value) from exc


class LockedNvmlMig:
    """`list_devices`, `create`, `destroy` under the device source's NVML lock, and the GPUs in
    MIG mode (`handles`: uuid -> (NVML handle, index)): what mig_dynamic.MigReconciler calls."""

    def __init__(self, handles: dict[str, tuple[object, int]], lock: threading.Lock) -> None:
        self.handles = handles
        self._lock = lock

    def list_devices(self, handle: object, parent_index: int) -> list[MigDevice]:
        with self._lock:
            return list_devices(handle, parent_index)

    def create(self, handle: object, parent_index: int, profile_name: str, start: int
               ) -> MigDevice:
        with self._lock:
            return create(handle, parent_index, profile_name, start)

    def destroy(self, handle: object, gi_id: int) -> None:
        with self._lock:
            destroy(handle, gi_id)
