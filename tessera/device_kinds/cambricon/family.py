"""The `mlu` family: Cambricon MLUs (370, 590) as HAMi names them.

- `cambricon.com/vmlu`: MLUs (limits, else requests); missing beside the shares: 1.
- `cambricon.com/mlu.smlu.vmemory`: device memory in units of 256 MiB (HAMi multiplies by 256);
  missing: the MLU's whole memory.
- `cambricon.com/mlu.smlu.vcore`: % of an MLU's compute, 100 when missing (HAMi's default).
- Shares (an sMLU: vmemory, or vcore below 100) serve one MLU per container (HAMi writes one
  `CAMBRICON_DSMLU_PROFILE` per pod); more MLUs are whole MLUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..base import HamiRegistration, ResourceNames
from ..shared_card import SharedCardFamily
from . import annotations as ann

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings

FAMILY = "mlu"


class CambriconFamily(SharedCardFamily):
    """The request is read as HAMi reads it (`SharedCardFamily`): vmemory in 256 MiB units,
    vcore 100 when missing."""

    name = FAMILY
    vendor = "Cambricon"
    device_word = "MLU"
    card, share, memory_unit_mib, default_cores = "MLU", "sMLU", ann.MEMORY_UNIT_MIB, 100
    memory_hint = "× 256 MiB"
    # HAMi reads an MLU node's capacity, not an annotation: this one is Tessera's own (the
    # node's MLUs for `tessera get nodes`, in HAMi's JSON device list form)
    register_annotation = ann.NODE_REGISTER
    to_allocate_annotation = ann.TO_ALLOCATE
    allocated_annotation = ann.ALLOCATED
    use_type_annotation = ann.USE_TYPE
    nouse_type_annotation = ann.NOUSE_TYPE
    use_uuid_annotation = ann.USE_UUID
    nouse_uuid_annotation = ann.NOUSE_UUID
    type_prefixes = ("MLU",)  # the card's name: MLU370-X4, MLU590...
    extra_annotations = (*ann.SCHEDULER_OWNED, *ann.AGENT_OWNED)

    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        return ResourceNames(count=ann.DEFAULT_COUNT, memory=ann.DEFAULT_MEMORY,
                             cores=ann.DEFAULT_CORES)

    def hami_registration(
        self, annotations: Mapping[str, Any], capacity: Mapping[str, Any],
        settings: TesseraSettings,
    ) -> HamiRegistration | None:
        """HAMi reads an MLU node from its capacity as Cambricon's device plugin advertises
        it: one MLU per 100 of the `vcore` resource (Tessera's node agent advertises only the
        count resource to kubelet, so this capacity is never Tessera's)."""
        cores = self.resource_names(settings).cores
        value = capacity.get(cores) if cores else None
        if value is None:
            return None
        source = f"capacity {cores}={str(value)[:20]}"
        try:
            total = int(str(value))
        except ValueError:
            return HamiRegistration(self.name, source, self.device_word, None,
                                    "not a whole number")  # fmt: skip
        if total <= 0:
            return None
        return HamiRegistration(self.name, source, self.device_word, -(-total // 100),
                                plugin="Cambricon's device plugin")  # fmt: skip

    def pod_annotations(
        self, containers: Sequence[Sequence[DeviceGrant]], devices: Mapping[str, DeviceInfo]
    ) -> dict[str, str]:
        """HAMi's `CAMBRICON_DSMLU_PROFILE` of the pod's sMLU (`<slot>_<vcore>_<vmemory>`), and
        `CAMBRICON_DSMLU_ASSIGNED`: true once written here (the node agent made it)."""
        for grants in containers:
            for g in grants:
                device = devices.get(g.uuid)
                if device is not None and (g.cores < 100 or g.memory_mib < device.memory_mib):
                    profile = ann.DsmluProfile(device.index, min(g.cores, 100),
                                               ann.vmemory_units(g.memory_mib))
                    return {ann.DSMLU_PROFILE: profile.encode(), ann.DSMLU_ASSIGNED: "true"}
        return {}


MLU = CambriconFamily()
