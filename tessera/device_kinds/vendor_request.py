"""Reading a vendor family's three resources (count, memory, cores) off a container, as HAMi
reads them for every vendor: limits first, else requests; whole numbers; memory as the whole MiB
the user meant. Pure; RequestError with a sentence naming the container and the resource."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera import hami

from .base import ResourceNames


@dataclass(frozen=True, slots=True)
class RawRequest:
    """The values as written (None = not named)."""

    count: int | None
    memory: int | None
    cores: int | None


def _value(container: Mapping[str, Any], name: str) -> object | None:
    if not name:
        return None
    return hami._resources(container, name)  # type: ignore[arg-type]


def read_raw(container: Mapping[str, Any], names: ResourceNames, *, memory_unit: str = "MiB",
             max_cores: int = 10**6) -> RawRequest | None:  # fmt: skip
    """None when the container names none of the three. `memory_unit` 'units' reads the memory
    resource as a plain count (Cambricon's 256 MiB units) instead of MiB."""
    where = f"container {container.get('name', '?')}: "
    raw_count, raw_memory, raw_cores = (_value(container, n)
                                        for n in (names.count, names.memory, names.cores))
    if raw_count is None and raw_memory is None and raw_cores is None:
        return None
    count = None if raw_count is None else hami._as_int(
        raw_count, where + names.count, low=0, high=hami.MAX_GPU_COUNT)
    memory: int | None = None
    if raw_memory is not None:
        if memory_unit == "MiB":
            memory = hami.memory_mib(raw_memory, names.memory, where)
            if memory < 0 or memory > hami.MAX_MEMORY_MIB:
                raise hami.RequestError(f"{where}{names.memory}: {raw_memory!r} is out of range")
        else:
            memory = hami._as_int(raw_memory, where + names.memory, low=0,
                                  high=hami.MAX_MEMORY_MIB)
    cores = None if raw_cores is None else hami._as_int(
        raw_cores, where + names.cores, low=0, high=max_cores)
    return RawRequest(count, memory, cores)
