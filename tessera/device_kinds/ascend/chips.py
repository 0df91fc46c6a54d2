"""Ascend chips as HAMi's device ConfigMap describes them (`vnpus`): names, capacity, templates.

Facts from HAMi's chart (`charts/hami/templates/scheduler/device-configmap.yaml`, the `vnpus`
section) and `docs/ascend910b-support.md`; the code is ours. Each chip type has a `commonWord`
(the device type, e.g. `Ascend910B3`) that names its resources (`huawei.com/Ascend910B3`,
`…-memory`, `…-core`) and its annotations, its memory (`memoryAllocatable` of
`memoryCapacity`, MiB), its AI cores and AI CPUs, and the vNPU **templates** the Ascend driver
can cut a chip into (name, memory MiB, AI cores, AI CPUs).

The configuration is the operator's (TESSERA_ASCEND_VNPU_CONFIG: HAMi's YAML, either the list
or `{configs: [...]}`); `DEFAULT_CHIPS` is HAMi's built-in table. Pure: parsing and lookups.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

ASCEND_910C = "Ascend910C"
RESOURCE_PREFIX = "huawei.com/"


class VnpuTemplate(BaseModel):
    """One way the driver cuts a chip: what a vNPU of this template holds."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9_.-]+$")
    memory: int = Field(gt=0, description="MiB")
    ai_core: int = Field(0, ge=0, alias="aiCore")
    ai_cpu: int = Field(0, ge=0, alias="aiCPU")


class AscendChip(BaseModel):
    """One chip type of HAMi's `vnpus` list."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    chip_name: str = Field(alias="chipName", min_length=1)
    common_word: str = Field(alias="commonWord", min_length=1, max_length=40,
                             pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    resource_name: str = Field(alias="resourceName", min_length=1)
    resource_memory_name: str = Field(alias="resourceMemoryName", min_length=1)
    resource_core_name: str = Field("", alias="resourceCoreName")
    memory_allocatable: int = Field(alias="memoryAllocatable", gt=0)
    memory_capacity: int = Field(alias="memoryCapacity", gt=0)
    memory_factor: int = Field(1, alias="memoryFactor", ge=1)
    ai_core: int = Field(alias="aiCore", gt=0)
    ai_cpu: int = Field(0, alias="aiCPU", ge=0)
    super_pod: bool = Field(False, alias="superPod")
    templates: tuple[VnpuTemplate, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> AscendChip:
        if self.memory_allocatable > self.memory_capacity:
            raise ValueError(f"{self.common_word}: memoryAllocatable above memoryCapacity")
        names = [t.name for t in self.templates]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.common_word}: template names repeat: {names}")
        for t in self.templates:
            if t.memory > self.memory_allocatable or t.ai_core > self.ai_core or (
                self.ai_cpu and t.ai_cpu > self.ai_cpu
            ):
                raise ValueError(f"{self.common_word}: template {t.name} is larger than the chip")
        # smallest first: the order a request is rounded up in (HAMi sorts by memory)
        ordered = tuple(sorted(self.templates, key=lambda t: (t.memory, t.ai_core, t.ai_cpu)))
        object.__setattr__(self, "templates", ordered)
        return self

    @property
    def module_pairs(self) -> bool:
        """910C: two NPUs (dies) per module, allocated in whole modules."""
        return self.common_word == ASCEND_910C

    def template(self, name: str) -> VnpuTemplate | None:
        return next((t for t in self.templates if t.name == name), None)


def _chip(chip_name: str, common_word: str, allocatable: int, capacity: int, ai_core: int,
          ai_cpu: int, templates: list[tuple[str, int, int, int]],
          super_pod: bool = False) -> AscendChip:  # fmt: skip
    return AscendChip(
        chipName=chip_name, commonWord=common_word,
        resourceName=f"{RESOURCE_PREFIX}{common_word}",
        resourceMemoryName=f"{RESOURCE_PREFIX}{common_word}-memory",
        resourceCoreName=f"{RESOURCE_PREFIX}{common_word}-core",
        memoryAllocatable=allocatable, memoryCapacity=capacity, aiCore=ai_core, aiCPU=ai_cpu,
        superPod=super_pod,
        templates=tuple(VnpuTemplate(name=n, memory=m, aiCore=c, aiCPU=p)
                        for n, m, c, p in templates),
    )


# HAMi's built-in `vnpus` table (the chart's device ConfigMap).
DEFAULT_CHIPS: tuple[AscendChip, ...] = (
    _chip("910A", "Ascend910A", 32768, 32768, 30, 0,
          [("vir02", 2184, 2, 0), ("vir04", 4369, 4, 0), ("vir08", 8738, 8, 0),
           ("vir16", 17476, 16, 0)]),
    _chip("910B2", "Ascend910B2", 65536, 65536, 24, 6,
          [("vir03_1c_8g", 8192, 3, 1), ("vir06_1c_16g", 16384, 6, 1),
           ("vir12_3c_32g", 32768, 12, 3)]),
    _chip("910B3", "Ascend910B3", 65536, 65536, 20, 7,
          [("vir05_1c_16g", 16384, 5, 1), ("vir10_3c_32g", 32768, 10, 3)]),
    _chip("910B4-1", "Ascend910B4-1", 65536, 65536, 20, 7,
          [("vir05_1c_16g", 16384, 5, 1), ("vir10_3c_32g", 32768, 10, 3)]),
    _chip("910B4", "Ascend910B4", 32768, 32768, 20, 7,
          [("vir05_1c_8g", 8192, 5, 1), ("vir10_3c_16g", 16384, 10, 3)]),
    _chip("310P3", "Ascend310P", 21527, 24576, 8, 7,
          [("vir01", 3072, 1, 1), ("vir02", 6144, 2, 2), ("vir04", 12288, 4, 4)]),
    _chip("Ascend910", ASCEND_910C, 65536, 65536, 20, 7,
          [("vir05_1c_16g", 16384, 5, 1), ("vir10_3c_32g", 32768, 10, 3)], super_pod=True),
)


def parse_chips(data: Any) -> tuple[AscendChip, ...]:
    """HAMi's `vnpus` value: a list of chips, or `{configs: [...]}` (newer charts), or a whole
    device-config document holding `vnpus`. ValueError with the reason when malformed."""
    if isinstance(data, dict) and "vnpus" in data:
        data = data["vnpus"]
    if isinstance(data, dict):
        data = data.get("configs")
    if not isinstance(data, list) or not data:
        raise ValueError("vnpus: expected a non-empty list of chips (or {configs: [...]})")
    chips = tuple(AscendChip.model_validate(item) for item in data)
    words = [c.common_word for c in chips]
    if len(set(words)) != len(words):
        raise ValueError(f"vnpus: commonWord repeats: {words}")
    return chips


def load_chips(path: str) -> tuple[AscendChip, ...]:
    """The operator's table from a YAML/JSON file; HAMi's built-in one when `path` is ''."""
    if not path:
        return DEFAULT_CHIPS
    return parse_chips(yaml.safe_load(Path(path).read_text()))


def chip_for_resource(chips: tuple[AscendChip, ...], resource: str) -> AscendChip | None:
    return next((c for c in chips if resource in (
        c.resource_name, c.resource_memory_name, c.resource_core_name)), None)


def chip_for_type(chips: tuple[AscendChip, ...], device_type: str) -> AscendChip | None:
    """The chip a device of that type is (`Ascend910B3`), by commonWord."""
    return next((c for c in chips if c.common_word == device_type), None)


def chip_for_name(chips: tuple[AscendChip, ...], chip_name: str) -> AscendChip | None:
    """The chip the driver names (`npu-smi info`'s Name column / DCMI's chip_name: `910B3`)."""
    return next((c for c in chips if c.chip_name == chip_name), None)


# The table in effect in this process: HAMi's, or the operator's file named by this variable
# (each service reads it the same way, so admission, the scheduler and the node agent agree).
CONFIG_ENV = "TESSERA_ASCEND_VNPU_CONFIG"
_loaded: dict[str, tuple[AscendChip, ...]] = {}


def active_chips() -> tuple[AscendChip, ...]:
    path = os.environ.get(CONFIG_ENV, "")
    if path not in _loaded:
        _loaded[path] = load_chips(path)
    return _loaded[path]


def active_chip(common_word: str) -> AscendChip:
    """The chip of that type in effect (the operator's entry, else HAMi's)."""
    found = chip_for_type(active_chips(), common_word) or chip_for_type(DEFAULT_CHIPS,
                                                                        common_word)
    if found is None:
        raise KeyError(f"no Ascend chip type {common_word!r}")
    return found
