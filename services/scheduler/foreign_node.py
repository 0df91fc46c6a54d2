"""What the scheduler knows of one node HAMi also serves while a cluster migrates to Tessera
(services/scheduler/foreign.py keeps it current): HAMi's pods there and what they hold, the
registrations HAMi's device plugins wrote, whether the node is in DRA mode; why Tessera must place
nothing there (`ForeignNode.blocking`) and what a refusal of the node says about it
(`ForeignNode.note`). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera import hami
from tessera.device_kinds import pod_grants, registry
from tessera.device_kinds.types import HamiRegistration
from tessera.models import Allocation, DeviceInfo, NodeRegistration

from .cards import allocation_usage

HAMI_CAPACITY_UNKNOWN = "HAMiCapacityUnknown"
NODE_IN_DRA_MODE = "NodeInDRAMode"
_SHOWN = 4  # items listed in a refusal before "and N more"


@dataclass(frozen=True)
class ForeignPod:
    """One pod HAMi placed: what it holds on `node` (None when its annotations are unreadable:
    `problem` says why)."""

    uid: str
    namespace: str
    name: str
    node: str
    allocation: Allocation | None
    problem: str = ""
    resource_version: str = ""
    seen_at: float = 0.0

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    def same_as(self, other: ForeignPod | None) -> bool:
        if other is None or (self.node, self.problem) != (other.node, other.problem):
            return False
        mine, theirs = self.allocation, other.allocation
        if mine is None or theirs is None:
            return mine is theirs
        return (mine.containers, mine.init_done) == (theirs.containers, theirs.init_done)


@dataclass(frozen=True)
class ForeignNode:
    """What the index needs to know of one node: HAMi's pods there and HAMi's registration."""

    pods: tuple[ForeignPod, ...] = ()
    devices: tuple[DeviceInfo, ...] | None = None
    register_problem: str = ""
    # The node is in DRA mode (annotation tessera.io/allocation-mode: dra, written by its node
    # agent): kube-scheduler's DRA allocator places GPU pods there, the extender never does.
    dra: bool = False
    # Other families' devices registered on the node as HAMi's scheduler reads them
    # (`hami.io/node-register-<commonWord>`, `hami.io/node-dcu-register`, an MLU capacity).
    vendors: tuple[HamiRegistration, ...] = ()
    allocations: tuple[Allocation, ...] = field(default=(), init=False)
    # (the registration's devices list, `allocations` as those devices hold them): `held`
    _held: list[Any] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        held = tuple(p.allocation for p in self.pods if p.allocation is not None)
        object.__setattr__(self, "allocations", held)

    def held(self, registration: Any) -> tuple[Allocation, ...]:
        """`allocations` as the node's registered devices hold them: HAMi lists each NPU of a
        910C module, Tessera's registration the module (`pod_grants.onto_devices`). Kept per
        devices list (a heartbeat keeps it)."""
        if registration is None or not self.allocations:
            return self.allocations
        devices = registration.devices
        memo = self._held
        if memo and memo[0] is devices:
            return memo[1]  # type: ignore[no-any-return]
        parts = pod_grants.part_map(devices)
        held = self.allocations if not parts else tuple(
            a.model_copy(update={"containers": pod_grants.onto_devices(a.containers, parts)})
            for a in self.allocations)  # fmt: skip
        memo[:] = [devices, held]
        return held

    def blocking(self, registration: NodeRegistration | None) -> str:
        """Why Tessera must place nothing on this registered node ('' = it may, counting the
        allocations): a HAMi pod there whose holdings are unknown."""
        if self.dra:
            return (f"{NODE_IN_DRA_MODE}: this node's GPUs are allocated through DRA "
                    "(ResourceClaims, kube-scheduler's allocator); extender pods go to nodes "
                    "in extender mode")  # fmt: skip
        if registration is None or not self.pods:
            return ""
        known = {d.uuid for d in registration.devices}
        parts = pod_grants.part_map(registration.devices)  # (a 910C module's NPUs)
        problems: list[str] = []
        for pod in self.pods:
            if pod.allocation is None:
                problems.append(f"HAMi pod {pod.ref}: {pod.problem}")
                continue
            unknown = sorted({parts.get(g.uuid, g.uuid) for c in pod.allocation.containers
                              for g in c} - known)  # fmt: skip
            if unknown:
                problems.append(f"HAMi pod {pod.ref} holds {', '.join(unknown[:3])}, which this "
                                "node's Tessera registration does not list")  # fmt: skip
        if not problems:
            return ""
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return (f"{HAMI_CAPACITY_UNKNOWN}: {problems[0]}{more}; Tessera cannot tell which GPUs "
                "HAMi's pods hold here, so it places nothing on this node until they are fixed "
                "or gone")  # fmt: skip

    def note(self, registration: NodeRegistration | None) -> str:
        """What a refusal adds about this node: HAMi's registrations (every family's, when
        Tessera's agent has none; those of families Tessera's agent does not serve here, when
        it has one) and every device a HAMi pod holds ('' when there is nothing to say)."""
        parts: list[str] = []
        if registration is None:
            parts.extend(self._carried())
        else:
            parts.extend(self._beside(registration))
        for pod in self.pods:
            if pod.allocation is None:
                parts.append(f"HAMi pod {pod.ref} is quarantined: {pod.problem}")
                continue
            for uuid, used in sorted(allocation_usage(pod.allocation).items()):
                parts.append(f"{uuid}: {used.memory_mib} MiB and {used.cores} cores used by "
                             f"HAMi pod {pod.ref}")  # fmt: skip
        if not parts:
            return ""
        more = f" | and {len(parts) - _SHOWN} more" if len(parts) > _SHOWN else ""
        return " [" + " | ".join(parts[:_SHOWN]) + more + "]"

    def _carried(self) -> list[str]:
        """A node no Tessera agent registered: what HAMi's device plugins registered there (an
        empty NVIDIA list is named only when no other family has devices)."""
        vendors = [v for v in self.vendors if v.devices]
        carried = [v.shown() for v in vendors]
        if self.devices is not None and (self.devices or not vendors):
            carried.insert(0, f"{hami.ANN_NODE_REGISTER} ({len(self.devices)} GPUs)")
        parts = []
        if carried:
            parts.append(f"it carries {', '.join(carried)}: read-only to Tessera, which places "
                         "pods only where its own node agent enforces them")  # fmt: skip
        if self.devices is None and self.register_problem:
            parts.append(f"its {hami.ANN_NODE_REGISTER} is unreadable and quarantined: "
                         f"{self.register_problem}")  # fmt: skip
        parts.extend(f"its {v.source} is unreadable: {v.problem}"
                     for v in self.vendors if v.devices is None)  # fmt: skip
        return parts

    def special(self, registration: Any) -> bool:
        """Whether the decision must word this node on its own (`ClusterIndex.foreign`): HAMi's
        pods there, DRA, an unreadable registration, or another family's devices HAMi's plugin
        registered beside Tessera's agent (a note). A node with nothing but a register
        annotation Tessera's own agent wrote (every node: it writes HAMi's
        `hami.io/node-nvidia-register`) says nothing and blocks nothing: it is not special,
        and its refusals are remembered like any node's (bench/hami_register_nodes.py); while
        no Tessera agent registered it, it is an unknown name, noted through
        `ClusterIndex.hami_registered`."""
        if self.pods or self.dra or self.register_problem:
            return True
        if registration is None:
            return False
        return any(v.devices != 0 for v in self._not_served(registration))

    def _not_served(self, registration: Any) -> list[HamiRegistration]:
        """The vendor registrations of families Tessera's agent does not serve here (it writes
        the register annotation of those it serves itself)."""
        if not self.vendors:
            return []
        served = set()
        for d in registration.devices:
            mode = getattr(d, "mode", "")
            served.add((registry.family_of_mode(mode) if isinstance(mode, str) else "")
                       or registry.DEFAULT_FAMILY)  # fmt: skip
        return [v for v in self.vendors if v.family not in served]

    def _beside(self, registration: NodeRegistration) -> list[str]:
        """A node Tessera's agent registered: the devices of families it does not serve here
        that HAMi's (or the vendor's) device plugin registered."""
        parts = []
        for v in self._not_served(registration):
            if v.devices:
                parts.append(f"it also carries {v.shown()} from {v.plugin}: read-only to "
                             "Tessera, whose node agent here does not serve them")  # fmt: skip
            elif v.devices is None:
                parts.append(f"its {v.source} is unreadable: {v.problem}")
        return parts
