"""NVIDIA libvgpu slices (HAMi's `hami-core` mode): memory and compute shares of a whole GPU,
enforced inside the container by libvgpu (the sealed limits; the env is HAMi's fallback). The
fit is HAMi's generic one (`DeviceKind`), which the scheduler also runs inlined (`plain`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import (
    NO_SELECTION,
    ContainerEdits,
    DeviceKind,
    DeviceView,
    GrantContext,
    Selection,
    capacity_reason,
)
from .family import NVIDIA

if TYPE_CHECKING:
    from tessera.hami import ContainerRequest
    from tessera.models import DeviceGrant

# Where libvgpu's shared region appears in the container (services/node-agent/containers.py
# mounts it there).
REGION_CONTAINER_PATH = "/run/tessera/region/usage"
MODE = "hami-core"


def slice_env(grants: Sequence[DeviceGrant], ctx: GrantContext) -> dict[str, str]:
    """HAMi's env for libvgpu slices (a fallback: libvgpu obeys the sealed limits file)."""
    settings = ctx.settings
    env = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid for g in grants),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": REGION_CONTAINER_PATH,
        "GPU_CORE_UTILIZATION_POLICY": ctx.core_policy or settings.core_policy,
        "CUDA_TASK_PRIORITY": str(ctx.priority),
    }
    for i, g in enumerate(grants):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{g.memory_mib}m"
        env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(min(g.cores, 100))
    if grants:
        env["CUDA_DEVICE_SM_LIMIT"] = str(min(grants[0].cores, 100))
    if settings.device_memory_scaling > 1:
        env["CUDA_OVERSUBSCRIBE"] = "true"
    return env


class NvidiaSlices(DeviceKind):
    name = "nvidia.hami-core"
    family = NVIDIA
    modes = (MODE,)
    plain = True

    def capacity_refusal(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str | None:
        return capacity_reason(device, request.memory_on(device.memory_mib), request.cores)

    def grant(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> DeviceGrant:
        from tessera.models import DeviceGrant

        return DeviceGrant(uuid=device.uuid, type=device.type,
                           memory_mib=request.memory_on(device.memory_mib), cores=request.cores)

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        return ContainerEdits(env=slice_env(grants, ctx))


SLICES = NvidiaSlices()
