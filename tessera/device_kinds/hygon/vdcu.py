"""The `dcu` kind: DCUs shared as vDCUs (memory and a share of the compute units, enforced by
Hygon's driver inside the container from the vdev config file) or given whole. Fit is HAMi's
generic one (memory, % compute, a whole DCU only when idle).

What the container gets, as HAMi's DCU device plugin gives it: `/dev/kfd`, `/dev/mkfd`, and per
DCU `/dev/dri/card<N>` and `/dev/dri/renderD<128+N>`; for a vDCU the node agent writes its
`vdev<id>.conf` (CU mask, memory) and mounts it at `/etc/vdev/docker/` beside the driver
(`node.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import ContainerEdits, DeviceKind, DeviceNode, GrantContext
from . import annotations as ann
from .family import DCU

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo

MODE = "vdcu"


def is_vdcu(grant: DeviceGrant, device: DeviceInfo) -> bool:
    return grant.cores > 0 or grant.memory_mib < device.memory_mib


class HygonVdcu(DeviceKind):
    name = "dcu.vdcu"
    family = DCU
    modes = (MODE,)

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        devices = [DeviceNode("/dev/kfd", "/dev/kfd", "rwm"),
                   DeviceNode("/dev/mkfd", "/dev/mkfd", "rwm")]
        for g in grants:
            device = ctx.devices.get(g.uuid)
            if device is None:
                raise ValueError(f"grant on {g.uuid}: not a device of this node")
            for path in (f"/dev/dri/card{device.index}",
                         f"/dev/dri/renderD{ann.RENDER_MINOR_BASE + device.index}"):
                devices.append(DeviceNode(path, path))
        return ContainerEdits(devices=devices)


VDCU = HygonVdcu()
