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
from typing import TYPE_CHECKING, Any, ClassVar

from tessera.hami import ContainerRequest, RequestError

from .types import (  # noqa: F401  (re-exported: the interface in one import)
    CARD_COMPUTE_UNITS_EXHAUSTED,
    CARD_CORDONED,
    CARD_INSUFFICIENT_CORE,
    CARD_INSUFFICIENT_MEMORY,
    CARD_NOT_HEALTH,
    CARD_TIME_SLICING_EXHAUSTED,
    CARD_TYPE_MISMATCH,
    CARD_UUID_MISMATCH,
    EXCLUSIVE_CONFLICT,
    NO_SELECTION,
    AdmissionNotes,
    ContainerEdits,
    DeviceNode,
    DeviceView,
    GrantContext,
    HamiRegistration,
    Mount,
    QuotaCharge,
    ResourceNames,
    Selection,
    Take,
    capacity_reason,
)

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings

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
    # What people call one device of the family (the dashboard's label: "NPU 0 · Ascend910B3").
    device_word: ClassVar[str] = "GPU"
    # How many of kubelet's device IDs one device of the family (one grant unit) spans: the
    # count resource counts these (a 910C module is two NPUs to kubelet, one device here).
    ids_per_device: ClassVar[int] = 1

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

    def hami_registration(
        self, annotations: Mapping[str, Any], capacity: Mapping[str, Any],
        settings: TesseraSettings,
    ) -> HamiRegistration | None:
        """The family's devices on a node as HAMi's scheduler reads them (None: none
        registered): its `register_annotation` as HAMi's device plugin writes it (HAMi's JSON
        list or the legacy `:`-joined form, checked as NVIDIA's). Tessera's own node agent
        writes the same annotation: whose it is, is the caller's question (the node's Tessera
        registration). A family HAMi reads elsewhere (Cambricon: the node's capacity)
        overrides this."""
        from tessera import hami

        key = self.register_annotation
        text = annotations.get(key) if key.startswith("hami.io/") else None
        if text is None:
            return None
        try:
            devices = len(hami.read_node_register(text, key))
        except ValueError as exc:
            return HamiRegistration(self.name, key, self.device_word, None, str(exc)[:300])
        return HamiRegistration(self.name, key, self.device_word, devices)

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
    # True when the kind's fit needs which partitions the grants on a device hold, not only
    # their amounts (an Ascend chip's AI CPUs, by template): the scheduler then keeps on each
    # of its cards the `partition_of` every grant there (`partitions`, a tuple of names).
    holds_partitions: ClassVar[bool] = False

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

    def partition_of(self, device: DeviceView, grant: DeviceGrant) -> str:
        """The partition a grant on the device holds (`holds_partitions` kinds)."""
        return ""

    def partitions_problem(self, device: DeviceView) -> str | None:
        """What the partitions held on the device (`partitions`) overrun, or None (the ledger's
        capacity checks ask it beside memory, cores and slots)."""
        return None

    def take(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> Take:
        """What the container's grant charges on the device (only asked once it fits)."""
        return Take(request.memory_on(device.memory_mib), request.cores)

    def rounded_take(self, request: ContainerRequest) -> Take | None:
        """What a grant of `request` holds on any of the kind's devices when the kind rounds a
        request up to a fixed cut whatever the device's use (an Ascend vNPU template); None:
        the grant holds the request's own amounts. A grant checked against its pod's request
        (the ledger's rebuild, the node agent before it seals) may hold up to this."""
        return None

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
