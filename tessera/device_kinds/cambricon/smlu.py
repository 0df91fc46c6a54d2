"""The `mlu` kind: MLUs shared as sMLUs (Cambricon's driver-enforced compute/memory shares) or
given whole. Fit is HAMi's generic one (memory, % compute, a whole MLU only when idle).

What the container gets, as Cambricon's device plugin gives it in dynamic-smlu mode:
`/dev/cambricon_ctl`, and per MLU `/dev/cambricon_dev<slot>` and `/dev/cambricon_ipcm<slot>`;
for an sMLU the node agent creates the instance through CNDev (`node.py`) and adds its
`/dev/cambricon-caps/cap_dev<slot>_mi<n>`. The pod carries HAMi's `CAMBRICON_DSMLU_PROFILE`
(`<slot>_<vcore>_<vmemory units>`) for Cambricon's own tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import ContainerEdits, DeviceKind, DeviceNode, GrantContext
from . import annotations as ann
from .family import MLU

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo

MODE = "smlu"
CTL = "/dev/cambricon_ctl"


def is_share(grant: DeviceGrant, device: DeviceInfo) -> bool:
    """An sMLU (a share), not a whole MLU."""
    return grant.cores < 100 or grant.memory_mib < device.memory_mib


def profile_of(grant: DeviceGrant, device: DeviceInfo) -> ann.DsmluProfile:
    return ann.DsmluProfile(device.index, min(grant.cores, 100), ann.vmemory_units(
        grant.memory_mib))


class CambriconSmlu(DeviceKind):
    name = "mlu.smlu"
    family = MLU
    modes = (MODE,)

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        devices = [DeviceNode(CTL, CTL)]
        annotations: dict[str, str] = {}
        for g in grants:
            device = ctx.devices.get(g.uuid)
            if device is None:
                raise ValueError(f"grant on {g.uuid}: not a device of this node")
            slot = device.index
            for path in (f"/dev/cambricon_dev{slot}", f"/dev/cambricon_ipcm{slot}"):
                devices.append(DeviceNode(path, path))
            if is_share(g, device):
                annotations[ann.DSMLU_PROFILE] = profile_of(g, device).encode()
        return ContainerEdits(devices=devices, annotations=annotations)


SMLU = CambriconSmlu()
