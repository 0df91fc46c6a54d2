"""The device-kind interface: what every vendor and sharing mode tells the services. Pure.

Two levels, as HAMi's vendors are built (one device type per vendor, sharing modes inside it):

- A **family** is what a pod names: its resources (`nvidia.com/gpu`, `huawei.com/Ascend910B3`,
  `cambricon.com/vmlu`...), how a container's request is read and checked at admission, the
  pod's selection annotations (use/no-use type and UUID), the node and pod annotations HAMi's
  tooling reads, and what a grant charges against the namespace quota.
- A **kind** is one way a family's devices are shared: NVIDIA's libvgpu slices, MIG and MPS are
  three kinds of the `nvidia` family. A device (`DeviceInfo`) belongs to the kind that serves its
  `mode`; the kind decides whether a request fits the device, what a container's grant charges
  on it, its HAMi score, what the container gets (env, mounts, device nodes, annotations), the
  device's health and its metric labels.

A request of family F only ever goes on a device of a kind of family F (the scheduler refuses
other devices with `CardTypeMismatch` before asking any kind). Nothing here does I/O; the node
agent's half (discovery from a backend, the Allocate answer) is `tessera.device_kinds.node`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from tessera.hami import ContainerRequest, RequestError

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
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


# --- the family -----------------------------------------------------------------------------------


class DeviceFamily(ABC):
    """What pods name. Subclass, set the class attributes, implement `default_names` and
    `read_request`; the rest has HAMi-like defaults."""

    name: ClassVar[str]  # registry key and ContainerRequest.family, e.g. "nvidia", "ascend910b3"
    vendor: ClassVar[str]  # for people and metric labels: "NVIDIA", "Huawei"...
    # HAMi's node annotation listing the node's devices of this family (hami.io/node-…-register)
    # and the pod annotations carrying its grants (…-devices-to-allocate / …-allocated).
    register_annotation: ClassVar[str]
    to_allocate_annotation: ClassVar[str]
    allocated_annotation: ClassVar[str]
    # the selection annotations: use/no-use type and UUID (comma lists); '' = not offered
    use_type_annotation: ClassVar[str] = ""
    nouse_type_annotation: ClassVar[str] = ""
    use_uuid_annotation: ClassVar[str] = ""
    nouse_uuid_annotation: ClassVar[str] = ""
    mode_annotation: ClassVar[str] = ""  # the sharing mode the pod asks for ('' = not offered)
    # DeviceInfo.type / DeviceGrant.type of the family's devices start with one of these (HAMi
    # routes a device by its type the same way): how a grant's family is told.
    type_prefixes: ClassVar[tuple[str, ...]] = ()
    # Whether the family's grants count against Tessera's namespace quota (memory/cores/GPUs,
    # HAMi's quota on nvidia.com/gpumem and gpucores). Other families' counts are quota'd by
    # Kubernetes' own ResourceQuota on their extended resources.
    counts_in_quota: ClassVar[bool] = False

    @abstractmethod
    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        """HAMi's default resource names of this family."""

    def resource_names(self, settings: TesseraSettings) -> ResourceNames:
        """The names in effect: the defaults with the operator's overrides."""
        overrides = getattr(settings, "device_resource_names", {}) or {}
        return self.default_names(settings).configured(overrides.get(self.name))

    @abstractmethod
    def read_request(
        self, container: Mapping[str, Any], settings: TesseraSettings
    ) -> ContainerRequest | None:
        """The container's request of this family (its `family` set), None when it names none
        of the family's resources. RequestError with a sentence for a malformed or impossible
        one (the webhook denies it; the scheduler refuses it)."""

    @property
    def reader(self) -> Any:
        """`read_request` as a plain function where the family has one (the scheduler reads
        every pod it decides with it while the family is the only one)."""
        return self.read_request

    def admit_container(
        self, container: dict[str, Any], label: str, settings: TesseraSettings,
        notes: AdmissionNotes,
    ) -> ContainerRequest | None:
        """Admission: apply the family's defaults to `container` in place (a missing count set,
        env the vendor runtime needs...), saying what changed and warning about what is odd, and
        return the request as normalised (equal to `read_request` of the changed container).
        RequestError denies the pod with its sentence. Default: read only, change nothing."""
        return self.read_request(container, settings)

    def selection_annotations(self) -> tuple[str, ...]:
        """The annotation keys `selection` reads."""
        return tuple(k for k in (self.use_type_annotation, self.nouse_type_annotation,
                                 self.use_uuid_annotation, self.nouse_uuid_annotation,
                                 self.mode_annotation) if k)  # fmt: skip

    def selection(self, annotations: Mapping[str, Any]) -> Selection:
        """The pod's selection annotations of this family (RequestError when malformed)."""
        def items(key: str) -> list[str]:
            value = annotations.get(key) if key else None
            if value is None:
                return []
            if not isinstance(value, str):
                raise RequestError(f"annotation {key} must be a string")
            return [p.strip() for p in value.split(",") if p.strip()]

        return Selection(
            use_types=tuple(t.lower() for t in items(self.use_type_annotation)),
            nouse_types=tuple(t.lower() for t in items(self.nouse_type_annotation)),
            use_uuids=frozenset(items(self.use_uuid_annotation)),
            nouse_uuids=frozenset(items(self.nouse_uuid_annotation)),
            modes=",".join(m.lower() for m in items(self.mode_annotation)),
        )

    def encode_register(self, devices: Sequence[DeviceInfo]) -> str:
        """The node annotation's value (`register_annotation`) for the family's devices: HAMi's
        JSON list (id, index, count, devmem, devcore, type, numa, mode, health)."""
        return json.dumps([
            {"id": d.uuid, "index": d.index, "count": d.split_count, "devmem": d.memory_mib,
             "devcore": d.cores, "type": d.type, "numa": d.numa, "mode": d.mode,
             "health": d.healthy}
            for d in devices
        ], separators=(",", ":"))  # fmt: skip

    def encode_grants(self, containers: Sequence[Sequence[DeviceGrant]]) -> str:
        """The pod annotation's value (`to_allocate_annotation`): containers in order, each
        ended by ';', devices `UUID,TYPE,MEM,CORES:` (HAMi's form for every vendor)."""
        from tessera.hami import encode_pod_devices

        return encode_pod_devices([list(c) for c in containers])

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        """What a container holding `grants` (devices of this family) gets: the edits of each
        kind among its devices, in order of first appearance (a family whose kinds mix in one
        container composes them itself: NVIDIA's)."""
        from .registry import kind_of

        edits = ContainerEdits()
        seen: list[DeviceKind] = []
        for g in grants:
            device = ctx.devices.get(g.uuid)
            kind = kind_of(device) if device is not None else None
            if kind is not None and kind not in seen:
                seen.append(kind)
        for kind in seen:
            edits = edits.merge(kind.container_edits(grants, ctx))
        return edits

    def quota_charge(self, grants: Sequence[DeviceGrant]) -> QuotaCharge:
        """What these grants (one container's) hold against the namespace quota (nothing when
        the family does not count in it)."""
        if not self.counts_in_quota:
            return QuotaCharge()
        return QuotaCharge(sum(g.memory_mib for g in grants), sum(g.cores for g in grants),
                           len(grants))  # fmt: skip


# --- the kind -------------------------------------------------------------------------------------


class DeviceKind(ABC):
    """One way a family's devices are shared. The default fit is HAMi's generic per-device one
    (health, cordon, selection, mode, slots, then memory, cores, exclusive use and compute left);
    override `capacity_refusal` and `take` (and `grant`) for partitioned devices (templates,
    instances)."""

    name: ClassVar[str]  # "nvidia.hami-core", "nvidia.mig", "ascend910b3.vnpu"...
    family: ClassVar[DeviceFamily]
    modes: ClassVar[tuple[str, ...]]  # the DeviceInfo.mode values this kind serves (lower case)
    # At most this many of the kind's devices per container (0 = no limit; MPS: 1).
    max_devices_per_container: ClassVar[int] = 0
    # True when `capacity_refusal` and `take` are the generic ones on the request's own amounts:
    # the scheduler then clears such devices with its inlined copy of these checks.
    plain: ClassVar[bool] = False
    # True when `explain` has a sentence for a refusal (shown after the reason counts).
    explains: ClassVar[bool] = False

    # --- scheduler ---
    def refusal(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str | None:
        """HAMi's reason the request may not go on this device, or None: it fits. The checks
        that depend on the set of devices picked (NUMA, too few) and the scheduler's own (quota,
        the `mutex` policy) are the scheduler's; it runs the same steps in HAMi's order with its
        own between them (services/scheduler/rules.py). The device is one of this kind's."""
        if not device.healthy:
            return CARD_NOT_HEALTH
        if device.cordoned:
            return CARD_CORDONED
        chosen = self.selection_refusal(device, request, selection)
        if chosen is not None:
            return chosen
        chosen = selection.uuid_refusal(device)
        if chosen is not None:
            return chosen
        if device.used_slots >= device.split_count:
            return CARD_TIME_SLICING_EXHAUSTED
        return self.capacity_refusal(device, request, selection)

    def selection_refusal(
        self, device: DeviceView, request: ContainerRequest, selection: Selection
    ) -> str | None:
        """HAMi's check 3: the device's type and mode against the pod's selection, and the
        kind's limit on devices per container."""
        chosen = selection.type_refusal(device)
        if chosen is not None:
            return chosen
        if selection.modes and not any(m in selection.modes for m in self.served_modes(device)):
            return CARD_TYPE_MISMATCH
        limit = self.max_devices_per_container
        if limit and request.count > limit:
            return CARD_TYPE_MISMATCH
        return None

    def served_modes(self, device: DeviceView) -> tuple[str, ...]:
        """The modes a pod may ask for to get this device (`Selection.modes`)."""
        return (device.mode.lower(),)

    def capacity_refusal(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str | None:
        """Whether the device has the room for what `take` would charge (HAMi's checks 11-14):
        memory, cores, a whole device (100 cores) only when idle, a request of no cores only
        while the device still computes."""
        take = self.take(device, request, selection)
        return capacity_reason(device, take.memory_mib, take.cores)

    def explain(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str:
        """A sentence saying why `capacity_refusal` refused ('' = the reason says it all)."""
        return ""

    def take(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> Take:
        """What the container's grant charges on the device (only asked once it fits)."""
        return Take(request.memory_on(device.memory_mib), request.cores)

    def grant(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> DeviceGrant:
        """The grant the container gets on the device (only asked once it fits): `take`'s
        amounts on the device; a kind with partitions adds its own (MIG: the instance)."""
        from tessera.models import DeviceGrant

        take = self.take(device, request, selection)
        return DeviceGrant(uuid=device.uuid, type=device.type, memory_mib=take.memory_mib,
                           cores=take.cores)  # fmt: skip

    def score(
        self, device: DeviceView, request: ContainerRequest, weights: tuple[int, int, int],
        selection: Selection = NO_SELECTION,
    ) -> float:
        """HAMi's device score: 10 × (wSlot·(1+used)/count + wCore·(req+used)/total +
        wMem·(req+used)/total); binpack prefers high, spread low."""
        w_slot, w_core, w_mem = weights
        take = self.take(device, request, selection)
        score = 0.0
        if device.split_count:
            score += w_slot * (1 + device.used_slots) / device.split_count
        if device.cores:
            score += w_core * (take.cores + device.used_cores) / device.cores
        if device.memory_mib:
            score += w_mem * (take.memory_mib + device.used_mem) / device.memory_mib
        return 10.0 * score

    # --- the container ---
    @abstractmethod
    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        """What a container holding `grants` (this kind's, in the container's order) gets for
        the vendor's runtime to enforce: env, mounts, device nodes, annotations. Pure; the node
        agent adds what needs I/O (`NodeFamily.node_edits`, host paths it owns)."""

    # --- health and metrics ---
    def healthy(self, device: DeviceInfo) -> bool:
        return device.healthy

    def metric_labels(self, device: DeviceInfo) -> dict[str, str]:
        """Labels every per-device metric of this kind carries (HAMi's names where it has
        them: deviceuuid, deviceidx, devicetype) plus vendor and kind."""
        return {"deviceuuid": device.uuid, "deviceidx": str(device.index),
                "devicetype": device.type, "vendor": self.family.vendor, "kind": self.name}
