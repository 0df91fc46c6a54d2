"""What GPUs this node has, how they are linked, and whether they are healthy.

Every family's devices come through its node side (tessera.device_kinds: NVIDIA's NVML or
simulated GPUs, the other vendors' libraries) as the same `PhysicalGpu` list (family_source.py,
nvidia_source.py). Everything else here is pure: what the devices advertise (each family's
`NodeFamily.advertise`), and the health bookkeeping (unhealthy on a critical XID or a
double-bit ECC error, healthy again after `health_recovery_s` without one — HAMi never recovers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tessera.device_kinds.nvidia.topology import (  # noqa: F401  (NVIDIA's facts, re-exported)
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    LEVEL_SCORES,
    NVLINK_SCORE,
    TOPOLOGY_HOSTBRIDGE,
    TOPOLOGY_INTERNAL,
    TOPOLOGY_MULTIPLE,
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    TOPOLOGY_SYSTEM,
    describe_fault,
    is_critical,
    link_score,
)
from tessera.models import DeviceInfo
from tessera.settings import TesseraSettings


@dataclass(frozen=True)
class PhysicalGpu:
    """One GPU as discovered, before scaling."""

    uuid: str
    index: int
    name: str  # the NVML name, e.g. "NVIDIA H200"
    memory_mib: int
    numa: int = 0
    mig: bool = False
    links: dict[str, int] = field(default_factory=dict)  # peer uuid -> link score
    # The device's family (family_source.py; '' = NVIDIA's): its type and mode as its family
    # names them, its compute in the family's units, the vendor's facts (NVIDIA: "mig").
    family: str = ""
    family_type: str = ""
    family_mode: str = ""
    cores: int = 100
    attributes: Mapping[str, str] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return self.family_type or f"NVIDIA-{self.name}"


@dataclass(frozen=True)
class HealthEvent:
    """A critical event from the driver. `uuid` None = every GPU of the node."""

    uuid: str | None
    kind: str  # "xid", "ecc", "lost"
    code: int = 0

    def describe(self) -> str:
        return describe_fault(self.uuid, self.kind, self.code)


class DeviceSource(Protocol):
    """Where GPUs come from. `wait_event` blocks (run it in a thread) up to `timeout_s`."""

    def discover(self) -> list[PhysicalGpu]: ...

    def wait_event(self, timeout_s: float) -> HealthEvent | None: ...

    def host_usage(self) -> dict[str, tuple[int, int, float]]:
        """uuid -> (used bytes, total bytes, utilization %); empty when unknown."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DeviceConfig:
    """How this node offers its GPUs (HAMi's per-node device-plugin settings), resolved."""

    split_count: int = 10
    memory_scaling: float = 1.0
    core_scaling: float = 1.0
    mode: str | None = None  # None: from the hardware (MIG enabled or not)
    mig_strategy: str = "none"  # tessera.mig.STRATEGIES
    exclude_uuids: frozenset[str] = frozenset()
    exclude_indices: frozenset[int] = frozenset()
    memory_reclaim: str = "evict"  # the node's enforcement of memory guarantees (leases.py)

    @classmethod
    def of(cls, settings: TesseraSettings) -> DeviceConfig:
        return cls(settings.device_split_count, settings.device_memory_scaling,
                   settings.device_core_scaling, mig_strategy=settings.mig_strategy,
                   memory_reclaim=settings.memory_reclaim_enforcement)

    def offers(self, gpu: PhysicalGpu) -> bool:
        return gpu.uuid not in self.exclude_uuids and gpu.index not in self.exclude_indices


def advertise(
    gpus: list[PhysicalGpu],
    settings: TesseraSettings,
    unhealthy: frozenset[str] = frozenset(),
    config: DeviceConfig | None = None,
) -> list[DeviceInfo]:
    """What the node registers: each family's devices as its node side advertises them
    (`NodeFamily.advertise`, tessera.device_kinds: memory × memory scaling, cores × core
    scaling, `split_count` slots, the configured mode or the hardware's; NVIDIA's dynamic MIG
    geometries, an Ascend chip's vNPU count as slots), under `config` (else the settings)."""
    from tessera.device_kinds import registry
    from tessera.device_kinds.node import NodeDeviceConfig, PhysicalDevice

    config = config or DeviceConfig.of(settings)
    node_config = NodeDeviceConfig(
        split_count=config.split_count, memory_scaling=config.memory_scaling,
        core_scaling=config.core_scaling, mode=config.mode,
        exclude_uuids=config.exclude_uuids, exclude_indices=config.exclude_indices,
        mig_strategy=config.mig_strategy, mig_geometries=settings.mig_geometries)
    out: list[DeviceInfo] = []
    for name in dict.fromkeys(g.family or registry.DEFAULT_FAMILY for g in gpus):
        node_family = registry.node_family(name)
        if node_family is None:
            raise ValueError(f"device family {name!r} registers no node side")
        found = [
            PhysicalDevice(uuid=g.uuid, index=g.index, model=g.name, memory_mib=g.memory_mib,
                           cores=g.cores, numa=g.numa, links=dict(g.links),
                           attributes={**g.attributes, **({"mig": "true"} if g.mig else {})})
            for g in gpus if (g.family or registry.DEFAULT_FAMILY) == name
        ]
        out.extend(node_family.advertise(found, node_config, unhealthy))
    return out


class HealthTracker:
    """Which GPUs are unhealthy now. Pure bookkeeping: the caller passes the clock."""

    def __init__(self, uuids: list[str], recovery_s: float) -> None:
        self._uuids = list(uuids)
        self._recovery_s = recovery_s
        self._last_bad: dict[str, float] = {}

    @property
    def unhealthy(self) -> frozenset[str]:
        return frozenset(self._last_bad)

    def record(self, event: HealthEvent, now: float) -> list[str]:
        """Mark the event's GPUs unhealthy; returns those that were healthy until now."""
        targets = [event.uuid] if event.uuid else self._uuids
        newly = [u for u in targets if u in self._uuids and u not in self._last_bad]
        for u in targets:
            if u in self._uuids:
                self._last_bad[u] = now
        return newly

    def recover(self, now: float) -> list[str]:
        """GPUs with no critical event for `recovery_s`: healthy again (returned)."""
        back = [u for u, t in self._last_bad.items() if now - t >= self._recovery_s]
        for u in back:
            del self._last_bad[u]
        return back


def source_from_settings(settings: TesseraSettings, node: str) -> DeviceSource:
    """The node's devices through its family's node side (`TESSERA_DEVICE_FAMILY`, NVIDIA's
    when unset): NVIDIA's with its MIG on top (nvidia_source.py)."""
    from tessera.node_agent.family_source import FamilySource
    from tessera.node_agent.nvidia_source import NvidiaSource

    node_family = FamilySource.node_family_of(settings)
    if node_family is NvidiaSource.node_side:
        return NvidiaSource.of(settings, node)
    return FamilySource(node_family, node_family.backend(settings, node))
