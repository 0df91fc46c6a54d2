"""The node agent's half of a device kind: discovery from a backend, advertising, the Allocate
answer, health. The backend does the I/O (the vendor's management library, real or fake); the
rest is pure so it can be tested without one.

A node agent runs one `NodeFamily` per family present on its node: it asks each for a backend,
discovers, advertises the devices into `NodeRegistration.devices` (with the family's node
annotation), and at Allocate asks the kind serving each granted device for the container's
edits (`DeviceKind.container_edits`) plus what only the node knows (`node_edits`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from .base import ContainerEdits, DeviceFamily

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings


@dataclass(frozen=True, slots=True)
class PhysicalDevice:
    """One device as the backend reports it, before the node's scaling and splitting."""

    uuid: str
    index: int
    model: str  # the vendor's product name, e.g. "NVIDIA H200", "Ascend910B3", "MLU370-X8"
    memory_mib: int
    cores: int = 100  # the device's compute in the family's units (NVIDIA: percent)
    numa: int = 0
    healthy: bool = True
    links: Mapping[str, int] = field(default_factory=dict)  # peer uuid -> HAMi link score
    attributes: Mapping[str, str] = field(default_factory=dict)  # vendor facts (chip, board...)


@dataclass(frozen=True, slots=True)
class HealthChange:
    """A device turned unhealthy (or healthy again); `uuid` None = every device of the node.
    `cause` and `code` class the fault where the vendor's library does (NVML: `xid` with the
    XID, `ecc`; '' = the device fell off the bus or the library says no more)."""

    uuid: str | None
    healthy: bool
    why: str
    cause: str = ""
    code: int = 0


class DeviceBackend(Protocol):
    """The vendor's management interface (NVML, DCMI/npu-smi, CNDev/cnmon, hy-smi...): the
    only part that touches devices. `wait_health` blocks (run it in a thread)."""

    def discover(self) -> list[PhysicalDevice]: ...

    def wait_health(self, timeout_s: float) -> HealthChange | None: ...

    def usage(self) -> dict[str, tuple[int, int, float]]:
        """uuid -> (used bytes, total bytes, utilization %); empty when unknown."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class NodeDeviceConfig:
    """How this node offers a family's devices (HAMi's per-node device-plugin settings)."""

    split_count: int = 10
    memory_scaling: float = 1.0
    core_scaling: float = 1.0
    mode: str | None = None  # None: the family's default for the hardware
    exclude_uuids: frozenset[str] = frozenset()
    exclude_indices: frozenset[int] = frozenset()
    # HAMi's `migstrategy` and the operator's MIG geometries (families with partitions the
    # node can remake: NVIDIA's dynamic MIG); ignored by the others
    mig_strategy: str = "none"
    mig_geometries: str = ""

    def offers(self, device: PhysicalDevice) -> bool:
        return device.uuid not in self.exclude_uuids and device.index not in self.exclude_indices


def holder_name(owner: str, uuid: str) -> str:
    """The name a node side makes a container's instance under: its owner (`<pod uid>/
    <container>`) and the device."""
    return f"{owner}@{uuid}"


def held_by(holder: str, owner: str) -> bool:
    """Whether an instance held as `holder` is `owner`'s (a pod uid owns its containers')."""
    return holder.startswith((f"{owner}@", f"{owner}/"))


def owner_gone(holder: str, live_owners: set[str]) -> bool:
    """Whether an instance's owner is none of `live_owners` (pod uids, or their containers)."""
    owner = holder.partition("@")[0]
    return bool(owner) and not any(owner == o or owner.startswith(f"{o}/") for o in live_owners)


class NodeFamily(ABC):
    """A family's node-agent side. Subclass per family; register with `registry.register_node`."""

    family: ClassVar[DeviceFamily]

    @abstractmethod
    def backend(self, settings: TesseraSettings, node: str) -> DeviceBackend:
        """The backend for this node: the real library where present, else the family's fake
        (the local stack's simulated devices), as the settings say."""

    def advertise(
        self, found: Sequence[PhysicalDevice], config: NodeDeviceConfig,
        unhealthy: frozenset[str] = frozenset(),
    ) -> list[DeviceInfo]:
        """What the node registers for these devices: memory × memory scaling, cores × core
        scaling, `split_count` slots, the mode the config or the family picks."""
        from tessera.models import DeviceInfo

        return [
            DeviceInfo(
                uuid=d.uuid, index=d.index, type=self.device_type(d),
                memory_mib=int(d.memory_mib * config.memory_scaling),
                physical_memory_mib=d.memory_mib, cores=int(d.cores * config.core_scaling),
                split_count=config.split_count, numa=d.numa,
                healthy=d.healthy and d.uuid not in unhealthy,
                mode=config.mode or self.default_mode(d), links=dict(d.links),
            )
            for d in found
            if config.offers(d)
        ]

    def device_type(self, device: PhysicalDevice) -> str:
        """DeviceInfo.type: what use/no-use type selection matches (HAMi's device type)."""
        return device.model

    @abstractmethod
    def default_mode(self, device: PhysicalDevice) -> str:
        """The DeviceInfo.mode (so the kind) a device is offered in without configuration."""

    def node_edits(
        self, grants: Sequence[DeviceGrant], devices: Mapping[str, DeviceInfo], owner: str = "",
    ) -> ContainerEdits:
        """What only the node adds to a container's Allocate answer besides the kind's edits
        (host paths of device nodes, a daemon's pipe, a vendor instance made for it...).
        `owner` is `<pod uid>/<container>`: what the node makes is made once per owner and
        held in its name. Default: nothing."""
        return ContainerEdits()

    def reconcile(self, live_pods: Iterable[str]) -> None:
        """Undo what `node_edits` made for pods no longer on the node (`live_pods`: the uids of
        the pods the node still holds containers of). Called every usage interval; blocking
        (run in a thread). Default: nothing was made."""
        return None
