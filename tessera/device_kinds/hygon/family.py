"""The `dcu` family: Hygon DCUs as HAMi names them.

- `hygon.com/dcunum`: DCUs (limits, else requests); missing beside memory/cores: 1.
- `hygon.com/dcumem`: MiB of one vDCU; missing: the DCU's whole memory.
- `hygon.com/dcucores`: % of a DCU's compute units (0 when missing, HAMi's default: no CUs
  reserved, shared).
- Memory or cores make a vDCU, which serves one DCU per container (HAMi: "only one vdcu can be
  acquired per container"); more DCUs are whole DCUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tessera.hami import ContainerRequest, RequestError

from ..base import DeviceFamily, ResourceNames
from ..vendor_request import read_raw
from . import annotations as ann

if TYPE_CHECKING:
    from tessera.models import DeviceInfo
    from tessera.settings import TesseraSettings

FAMILY = "dcu"


class HygonFamily(DeviceFamily):
    name = FAMILY
    vendor = "Hygon"
    register_annotation = ann.NODE_REGISTER
    to_allocate_annotation = ann.TO_ALLOCATE
    allocated_annotation = ann.ALLOCATED
    use_type_annotation = ann.USE_TYPE
    nouse_type_annotation = ann.NOUSE_TYPE
    use_uuid_annotation = ann.USE_UUID
    nouse_uuid_annotation = ann.NOUSE_UUID
    handshake_annotation = ann.NODE_HANDSHAKE
    type_prefixes = (ann.TYPE_PREFIX,)  # DCU-<model>

    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        return ResourceNames(count=ann.DEFAULT_COUNT, memory=ann.DEFAULT_MEMORY,
                             cores=ann.DEFAULT_CORES)

    def read_request(
        self, container: Mapping[str, Any], settings: TesseraSettings
    ) -> ContainerRequest | None:
        names = self.resource_names(settings)
        raw = read_raw(container, names, max_cores=10**6)
        if raw is None:
            return None
        where = f"container {container.get('name', '?')}: "
        count = raw.count or 1
        cores = raw.cores or 0
        if cores > 100:
            raise RequestError(f"{where}{names.cores}: {cores}: a share of one DCU's compute "
                               "units is at most 100 (%)")
        if raw.memory is not None and raw.memory < 1:
            raise RequestError(f"{where}{names.memory}: must be at least 1 MiB (leave it out "
                               "for the whole memory)")
        if count > 1 and (raw.memory is not None or raw.cores is not None):
            raise RequestError(f"{where}{names.count}: {count} with {names.memory}/"
                               f"{names.cores}: a vDCU serves one DCU per container; ask "
                               f"{names.count}: 1 with a share, or whole DCUs without one")
        return ContainerRequest(count=count, memory_mib=raw.memory or 0,
                                memory_percentage=100 if raw.memory is None else None,
                                cores=cores, family=self.name)

    def encode_register(self, devices: Sequence[DeviceInfo]) -> str:
        """HAMi's `hami.io/node-dcu-register` (its legacy list form)."""
        return ann.encode_register([ann.RegisteredDcu(d.uuid, d.split_count, d.memory_mib,
                                                      d.cores, d.type, d.numa, d.healthy,
                                                      d.index, d.mode)
                                    for d in devices])


DCU = HygonFamily()
