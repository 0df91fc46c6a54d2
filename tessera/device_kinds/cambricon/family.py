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

from tessera.hami import ContainerRequest, RequestError

from ..base import DeviceFamily, ResourceNames
from ..vendor_request import read_raw
from . import annotations as ann

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings

FAMILY = "mlu"


class CambriconFamily(DeviceFamily):
    name = FAMILY
    vendor = "Cambricon"
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

    def read_request(
        self, container: Mapping[str, Any], settings: TesseraSettings
    ) -> ContainerRequest | None:
        names = self.resource_names(settings)
        raw = read_raw(container, names, memory_unit="units", max_cores=10**6)
        if raw is None:
            return None
        where = f"container {container.get('name', '?')}: "
        count = raw.count or 1
        vcore = 100 if raw.cores is None else raw.cores
        if vcore > 100:
            raise RequestError(f"{where}{names.cores}: {vcore}: a share of one MLU's compute is "
                               "at most 100 (%)")
        if raw.memory is not None and raw.memory < 1:
            raise RequestError(f"{where}{names.memory}: must be at least 1 (× 256 MiB); leave "
                               "it out for the whole memory")
        shared = raw.memory is not None or vcore < 100
        if count > 1 and shared:
            raise RequestError(f"{where}{names.count}: {count} with a share: an sMLU serves one "
                               f"MLU per container; ask {names.count}: 1 with {names.memory}/"
                               f"{names.cores}, or whole MLUs without them")
        memory = 0 if raw.memory is None else raw.memory * ann.MEMORY_UNIT_MIB
        return ContainerRequest(count=count, memory_mib=memory,
                                memory_percentage=100 if raw.memory is None else None,
                                cores=vcore, family=self.name)


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
