"""A family of cards shared one share per container (Cambricon's sMLU, Hygon's vDCU). Pure.

HAMi reads both vendors' requests the same way (`GenerateResourceRequests` in its
`pkg/device/cambricon` and `pkg/device/hygon`): a count (limits, else requests; 1 when only the
share is named), a memory amount (the whole card's memory when missing) and a % of the card's
compute (a per-vendor default when missing). A share (memory, or compute below the whole card)
is one card per container: the vendor's driver makes one sMLU/vDCU per container; more cards are
whole cards. What differs per vendor is a handful of facts, set as class attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from tessera.hami import ContainerRequest, RequestError

from .base import DeviceFamily
from .vendor_request import RawRequest, read_raw

if TYPE_CHECKING:
    from tessera.settings import TesseraSettings


class SharedCardFamily(DeviceFamily):
    """Set `card` ("MLU"), `share` ("sMLU"), `compute` (what the % is of), `memory_unit_mib`
    (the memory resource's unit: Cambricon counts 256 MiB units), `default_cores` (HAMi's
    default % when the resource is missing) and `memory_hint` (how the memory is written)."""

    card: ClassVar[str]
    share: ClassVar[str]
    compute: ClassVar[str] = "compute"
    memory_unit_mib: ClassVar[int] = 1
    default_cores: ClassVar[int] = 0
    memory_hint: ClassVar[str] = "MiB"

    def is_share(self, raw: RawRequest, cores: int) -> bool:
        """Whether the request asks a share of one card (not whole cards)."""
        return raw.memory is not None or cores < 100

    def read_request(
        self, container: Mapping[str, Any], settings: TesseraSettings
    ) -> ContainerRequest | None:
        names = self.resource_names(settings)
        raw = read_raw(container, names, memory_unit="MiB" if self.memory_unit_mib == 1
                       else "units", max_cores=10**6)  # fmt: skip
        if raw is None:
            return None
        where = f"container {container.get('name', '?')}: "
        count = raw.count or 1
        cores = self.default_cores if raw.cores is None else raw.cores
        if cores > 100:
            raise RequestError(f"{where}{names.cores}: {cores}: a share of one {self.card}'s "
                               f"{self.compute} is at most 100 (%)")  # fmt: skip
        if raw.memory is not None and raw.memory < 1:
            raise RequestError(f"{where}{names.memory}: must be at least 1 ({self.memory_hint});"
                               " leave it out for the whole memory")  # fmt: skip
        if count > 1 and self.is_share(raw, cores):
            raise RequestError(f"{where}{names.count}: {count} with a share: a {self.share} "
                               f"serves one {self.card} per container; ask {names.count}: 1 with "
                               f"{names.memory}/{names.cores}, or whole {self.card}s without "
                               "them")  # fmt: skip
        return ContainerRequest(
            count=count,
            memory_mib=0 if raw.memory is None else raw.memory * self.memory_unit_mib,
            memory_percentage=100 if raw.memory is None else None, cores=cores,
            family=self.name)  # fmt: skip
