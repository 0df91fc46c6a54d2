"""NVIDIA MPS (HAMi's `mps` mode): a libvgpu slice whose compute share the card's MPS daemon
enforces (a per-container control daemon; services/node-agent/mps.py runs them). One card per
container: an MPS client reaches one card's daemon."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import ContainerEdits, GrantContext
from .family import NVIDIA
from .slices import NvidiaSlices, slice_env

if TYPE_CHECKING:
    from tessera.models import DeviceGrant

MODE = "mps"
# Where the container's own control daemon's pipe directory appears.
PIPE_CONTAINER_DIR = "/run/tessera/mps"


def mps_env(grants: Sequence[DeviceGrant], mps_cards: set[str]) -> dict[str, str]:
    """What a container holding an MPS card adds to its env: its daemon's pipe directory, and
    libvgpu's compute limiter off on those cards (the daemon enforces the share)."""
    if not any(g.uuid in mps_cards for g in grants):
        return {}
    env = {"CUDA_MPS_PIPE_DIRECTORY": PIPE_CONTAINER_DIR, "CUDA_DEVICE_SM_LIMIT": "100"}
    for i, g in enumerate(grants):
        if g.uuid in mps_cards:
            env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = "100"
    return env


class NvidiaMps(NvidiaSlices):
    """A slice as far as fitting goes; one card per container (an MPS client reaches one
    card's daemon)."""

    name = "nvidia.mps"
    family = NVIDIA
    modes = (MODE,)
    max_devices_per_container = 1

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        """The slice's env with MPS's on top; the pipe directory's mount is the node agent's
        (it owns the daemon's host directory)."""
        cards = {g.uuid for g in grants if (d := ctx.devices.get(g.uuid)) and d.mode == MODE}
        return ContainerEdits(env={**slice_env(grants, ctx), **mps_env(grants, cards)})


MPS = NvidiaMps()
