"""The values the device-kind interface passes around (base.py's DeviceFamily and DeviceKind
take and return them): resource names, what the scheduler shows a kind of a device, the pod's
selection, a grant's charge, what a container gets, admission notes, a quota charge. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tessera.models import DeviceInfo
    from tessera.settings import TesseraSettings

# HAMi's per-device refusal reasons a kind may answer with (the scheduler counts them as
# `N/M Reason` in the pod's FailedScheduling message).
CARD_NOT_HEALTH = "CardNotHealth"
CARD_CORDONED = "CardCordoned"
CARD_TYPE_MISMATCH = "CardTypeMismatch"
CARD_UUID_MISMATCH = "CardUuidMismatch"
CARD_TIME_SLICING_EXHAUSTED = "CardTimeSlicingExhausted"
CARD_INSUFFICIENT_MEMORY = "CardInsufficientMemory"
CARD_INSUFFICIENT_CORE = "CardInsufficientCore"
EXCLUSIVE_CONFLICT = "ExclusiveDeviceAllocateConflict"
CARD_COMPUTE_UNITS_EXHAUSTED = "CardComputeUnitsExhausted"


# --- names ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResourceNames:
    """A family's extended resources, HAMi's `resourceCountName` / `resourceMemoryName` /
    `resourceCoreName` (+ NVIDIA's percentage and priority). '' = the family has no such
    resource. Configurable per family: `TesseraSettings.device_resource_names`."""

    count: str
    memory: str = ""
    memory_percentage: str = ""
    cores: str = ""
    priority: str = ""

    def all(self) -> tuple[str, ...]:
        """Every name set, count first (what a container may name in limits/requests)."""
        return tuple(n for n in (self.count, self.memory, self.memory_percentage, self.cores,
                                 self.priority) if n)  # fmt: skip

    def configured(self, overrides: Mapping[str, str] | None) -> ResourceNames:
        """These names with an operator's overrides ({"count": ..., "memory": ..., ...})."""
        if not overrides:
            return self
        unknown = set(overrides) - {"count", "memory", "memory_percentage", "cores", "priority"}
        if unknown:
            raise ValueError(f"unknown resource name key(s) {sorted(unknown)} (count, memory, "
                             "memory_percentage, cores, priority)")  # fmt: skip
        values = {k: getattr(self, k) for k in ("count", "memory", "memory_percentage", "cores",
                                                 "priority")}  # fmt: skip
        values.update({k: str(v) for k, v in overrides.items()})
        return ResourceNames(**values)


# --- what the scheduler shows a kind of one device ----------------------------------------------


class DeviceView(Protocol):
    """One device as the scheduler sees it: the registration's static facts and what the
    counting allocations use of it (services/scheduler/cards.py `Card` is one)."""

    uuid: str
    index: int
    type: str
    mode: str
    numa: int
    healthy: bool
    cordoned: bool
    memory_mib: int
    cores: int
    split_count: int
    used_mem: int
    used_cores: int
    used_slots: int


@dataclass(frozen=True, slots=True)
class Selection:
    """A pod's device selection for one family, from that family's annotations (HAMi's
    `use-<type>` / `nouse-<type>` / `use-<uuid>` / `nouse-<uuid>`): types match as
    case-insensitive substrings of the device type, UUIDs exactly."""

    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: frozenset[str] = frozenset()
    nouse_uuids: frozenset[str] = frozenset()
    # the sharing modes the pod accepts (NVIDIA's `nvidia.com/vgpu-mode`: a substring match of
    # the device's modes, `DeviceKind.served_modes`); empty = any
    modes: str = ""

    @property
    def any(self) -> bool:
        """Whether the pod selects anything at all (else every device passes)."""
        return bool(self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids
                    or self.modes)  # fmt: skip

    def type_refusal(self, device: DeviceView) -> str | None:
        if self.use_types or self.nouse_types:
            kind = device.type.lower()
            if self.use_types and not any(t in kind for t in self.use_types):
                return CARD_TYPE_MISMATCH
            if any(t in kind for t in self.nouse_types):
                return CARD_TYPE_MISMATCH
        return None

    def uuid_refusal(self, device: DeviceView) -> str | None:
        if self.use_uuids and device.uuid not in self.use_uuids:
            return CARD_UUID_MISMATCH
        if device.uuid in self.nouse_uuids:
            return CARD_UUID_MISMATCH
        return None


NO_SELECTION = Selection()


@dataclass(frozen=True, slots=True)
class Take:
    """What one container's grant charges on one device: memory MiB and cores (in the
    device's own units, as registered), and the named partition serving it ('' = none: an
    Ascend vNPU template name, a MIG profile...)."""

    memory_mib: int
    cores: int
    partition: str = ""


def capacity_reason(device: DeviceView, memory_mib: int, cores: int) -> str | None:
    """HAMi's checks 11-14 for `memory_mib` and `cores` on the device: memory, cores, a whole
    device (100 cores) only when idle, a request of no cores only while the device computes."""
    if memory_mib > device.memory_mib - device.used_mem:
        return CARD_INSUFFICIENT_MEMORY
    if cores > device.cores - device.used_cores:
        return CARD_INSUFFICIENT_CORE
    if cores >= 100 and device.used_slots:
        return EXCLUSIVE_CONFLICT
    if cores == 0 and device.cores > 0 and device.used_cores >= device.cores:
        return CARD_COMPUTE_UNITS_EXHAUSTED
    return None


# --- what a container gets ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node the container gets (the device plugin's DeviceSpec)."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass
class ContainerEdits:
    """What a grant gives the container, as a device plugin's ContainerAllocateResponse (or a
    CDI spec) carries it. Kinds fill it; the node agent's gRPC layer writes it out."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    devices: list[DeviceNode] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)

    def merge(self, other: ContainerEdits) -> ContainerEdits:
        """These edits with `other`'s added (its env and annotations win on a clash)."""
        return ContainerEdits({**self.env, **other.env}, [*self.mounts, *other.mounts],
                              [*self.devices, *other.devices],
                              {**self.annotations, **other.annotations})  # fmt: skip


@dataclass(frozen=True)
class GrantContext:
    """What a kind may read when it describes a container's grant besides the grants: the
    node's registered devices by UUID, the pod's knobs, the settings."""

    devices: Mapping[str, DeviceInfo]
    settings: TesseraSettings
    priority: int = 1
    core_policy: str = "default"


@dataclass
class AdmissionNotes:
    """What admission did to a container and wants the user to read (sentences)."""

    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class QuotaCharge:
    """What a family's grants hold against the namespace quota (HAMi: memory and cores of
    NVIDIA only; other families count devices under their own resource names)."""

    memory_mib: int = 0
    cores: int = 0
    devices: int = 0


# --- a node HAMi's device plugin registered ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HamiRegistration:
    """A family's devices on a node as HAMi's scheduler reads them there, written by HAMi's (or
    the vendor's) device plugin: `source` names where (`hami.io/node-register-Ascend910B3`, a
    capacity), `devices` how many (None: unreadable, `problem` says why)."""

    family: str
    source: str
    word: str  # what one device is called: "NPU", "MLU", "DCU"
    devices: int | None
    problem: str = ""
    plugin: str = "HAMi's device plugin"  # who writes it

    def shown(self) -> str:
        """`hami.io/node-register-Ascend910B3 (4 NPUs)`."""
        n = self.devices or 0
        return f"{self.source} ({n} {self.word}{'' if n == 1 else 's'})"
