"""The `dcu` family: Hygon DCUs as HAMi names them.

- `hygon.com/dcunum`: DCUs (limits, else requests); missing beside memory/cores: 1.
- `hygon.com/dcumem`: MiB of one vDCU; missing: the DCU's whole memory.
- `hygon.com/dcucores`: % of a DCU's compute units (0 when missing, HAMi's default: no CUs
  reserved, shared).
- Memory or cores make a vDCU, which serves one DCU per container (HAMi: "only one vdcu can be
  acquired per container"); more DCUs are whole DCUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import ResourceNames
from ..shared_card import SharedCardFamily
from ..vendor_request import RawRequest
from . import annotations as ann

if TYPE_CHECKING:
    from tessera.models import DeviceInfo
    from tessera.settings import TesseraSettings

FAMILY = "dcu"


class HygonFamily(SharedCardFamily):
    """The request is read as HAMi reads it (`SharedCardFamily`): dcumem in MiB, dcucores 0
    when missing."""

    name = FAMILY
    vendor = "Hygon"
    device_word = "DCU"
    card, share, compute, default_cores = "DCU", "vDCU", "compute units", 0
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

    def is_share(self, raw: RawRequest, cores: int) -> bool:
        """HAMi's DCU: naming memory or cores at all makes a vDCU (0 % is a share too)."""
        return raw.memory is not None or raw.cores is not None

    def encode_register(self, devices: Sequence[DeviceInfo]) -> str:
        """HAMi's `hami.io/node-dcu-register` (its legacy list form)."""
        return ann.encode_register([ann.RegisteredDcu(d.uuid, d.split_count, d.memory_mib,
                                                      d.cores, d.type, d.numa, d.healthy,
                                                      d.index, d.mode)
                                    for d in devices])


DCU = HygonFamily()
