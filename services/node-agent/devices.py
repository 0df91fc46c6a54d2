"""What GPUs this node has, how they are linked, and whether they are healthy.

Two sources give the same `PhysicalGpu` list: NVML (real GPUs, `nvml.py`) and a static one
(simulated GPUs for the local stack). Everything else here is pure: HAMi's link scores, what a
GPU advertises after scaling, and the health bookkeeping (unhealthy on a critical XID or a
double-bit ECC error, healthy again after `health_recovery_s` without one — HAMi never recovers).
"""

from __future__ import annotations

import math
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Protocol

from tessera import mig
from tessera.models import DeviceInfo, MigCapability
from tessera.settings import TesseraSettings

# NVML topology levels (nvmlGpuTopologyLevel_t) → HAMi's link scores (higher = closer).
TOPOLOGY_INTERNAL = 0  # same board
TOPOLOGY_SINGLE = 10  # one PCIe switch
TOPOLOGY_MULTIPLE = 20  # several PCIe switches
TOPOLOGY_HOSTBRIDGE = 30  # the same host bridge
TOPOLOGY_NODE = 40  # the same CPU (NUMA node)
TOPOLOGY_SYSTEM = 50  # across CPUs
LEVEL_SCORES = {
    TOPOLOGY_SYSTEM: 10,
    TOPOLOGY_NODE: 20,
    TOPOLOGY_HOSTBRIDGE: 30,
    TOPOLOGY_MULTIPLE: 40,
    TOPOLOGY_SINGLE: 50,
    TOPOLOGY_INTERNAL: 60,
}
NVLINK_SCORE = 100

# NVML event types the agent watches.
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID_CRITICAL = 0x8


def link_score(topology_level: int | None, nvlinks: int) -> int:
    """HAMi's score of a GPU pair: 100 per NVLink, else by the PCIe relation."""
    if nvlinks > 0:
        return NVLINK_SCORE * nvlinks
    if topology_level is None:
        return LEVEL_SCORES[TOPOLOGY_SYSTEM]
    return LEVEL_SCORES.get(topology_level, LEVEL_SCORES[TOPOLOGY_SYSTEM])


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
    # Another device family's device (family_source.py): its type and mode as its family
    # names them, and its compute in the family's units. '' = an NVIDIA GPU.
    family: str = ""
    family_type: str = ""
    family_mode: str = ""
    cores: int = 100

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
        target = self.uuid or "all GPUs"
        if self.kind == "xid":
            return f"XID {self.code} on {target}"
        if self.kind == "ecc":
            return f"double-bit ECC error on {target}"
        return f"{target} fell off the bus"


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
    """What the node registers: the GPUs it offers, memory × memory scaling, cores = 100 ×
    core scaling, `split_count` slots each (`config`, else the settings)."""
    config = config or DeviceConfig.of(settings)
    if any(g.family for g in gpus):
        return _advertise_families(gpus, settings, unhealthy, config)
    return [
        DeviceInfo(
            uuid=g.uuid,
            index=g.index,
            type=g.type,
            memory_mib=int(g.memory_mib * config.memory_scaling),
            physical_memory_mib=g.memory_mib,
            cores=int(g.cores * config.core_scaling),
            split_count=config.split_count,
            numa=g.numa,
            healthy=g.uuid not in unhealthy,
            mode=config.mode or g.family_mode or ("mig" if g.mig else "hami-core"),
            links={peer: score for peer, score in g.links.items()},
            mig=dynamic_mig(g, config, settings),
        )
        for g in gpus
        if config.offers(g)
    ]


def dynamic_mig(
    gpu: PhysicalGpu, config: DeviceConfig, settings: TesseraSettings
) -> MigCapability | None:
    """What a GPU advertises for dynamic MIG: under `migstrategy: dynamic`, a GPU in MIG mode
    whose model Tessera knows, with the operator's geometries for that model (none: any layout
    NVIDIA's tables allow)."""
    if config.mig_strategy != mig.STRATEGY_DYNAMIC or not gpu.mig or config.mode not in (
        None, "mig"
    ):
        return None
    model = mig.model_for(gpu.name)
    if model is None:
        return None
    allowed = mig.parse_geometries(settings.mig_geometries).get(model.name, [])
    return MigCapability(model=model.name, geometries=allowed)


def is_critical(event_type: int, xid: int, ignored_xids: frozenset[int]) -> bool:
    """Does this NVML event make a GPU unhealthy? (single-bit ECC errors are corrected)."""
    if event_type & EVENT_XID_CRITICAL:
        return xid not in ignored_xids
    return bool(event_type & EVENT_DOUBLE_BIT_ECC)


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


class StaticSource:
    """Simulated GPUs (local stack): count, model and memory from settings, stable UUIDs."""

    def __init__(self, settings: TesseraSettings, node: str) -> None:
        self._settings = settings
        self._node = node
        self._fault_offset = 0

    def discover(self) -> list[PhysicalGpu]:
        s = self._settings
        count = s.static_gpu_count
        per_numa = max(1, math.ceil(count / s.static_numa_nodes))
        uuids = [
            f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{self._node}/gpu{i}')}"
            for i in range(count)
        ]
        gpus = []
        for i, u in enumerate(uuids):
            numa = i // per_numa
            links = {
                peer: link_score(TOPOLOGY_NODE if (j // per_numa) == numa else TOPOLOGY_SYSTEM, 0)
                for j, peer in enumerate(uuids)
                if j != i
            }
            in_mig = bool(s.static_mig_instances.strip()) or s.mig_strategy == "dynamic"
            gpus.append(PhysicalGpu(u, i, s.static_gpu_model, s.static_gpu_memory_mib, numa,
                                    mig=in_mig, links=links))
        return gpus

    def mig_offers(self) -> list:
        """The simulated MIG instances (static_mig_instances on every GPU), MIG UUIDs stable."""
        from tessera.node_agent.mig_static import simulated_offers

        return simulated_offers(self.discover(), self._settings.static_mig_instances, self._node)

    def mig_backend(self) -> object:
        """Dynamic MIG on the simulated GPUs (mig_sim.py), instances kept in
        `static_mig_state` (in memory when unset)."""
        from tessera.node_agent.mig_sim import SimulatedMig

        return SimulatedMig(self.discover(), self._settings.static_mig_state or None)

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        """Events from `static_fault_file` (one '<GPU index> <XID>' per line), else none."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = self._next_fault()
            if event is not None or time.monotonic() >= deadline:
                return event
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _next_fault(self) -> HealthEvent | None:
        path = self._settings.static_fault_file
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                f.seek(self._fault_offset)
                line = f.readline()
        except FileNotFoundError:
            return None
        if not line.endswith(b"\n"):
            return None  # nothing new, or a line still being written
        self._fault_offset += len(line)
        fields = line.split()
        try:
            index, xid = int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            return None
        if xid in self._settings.ignored_xid_set():
            return None
        gpus = self.discover()
        uuid = gpus[index].uuid if 0 <= index < len(gpus) else None
        return HealthEvent(uuid, "xid", xid)

    def host_usage(self) -> dict[str, tuple[int, int, float]]:
        return {}

    def close(self) -> None:
        return None


def source_from_settings(settings: TesseraSettings, node: str) -> DeviceSource:
    if settings.device_family:  # another vendor's devices, from its family's backend
        from tessera.node_agent.family_source import FamilySource

        return FamilySource.of(settings, node)
    if settings.device_source == "static":
        return StaticSource(settings, node)
    from tessera.node_agent.nvml import NvmlSource

    return NvmlSource(settings)


def _advertise_families(
    gpus: list[PhysicalGpu], settings: TesseraSettings, unhealthy: frozenset[str],
    config: DeviceConfig,
) -> list[DeviceInfo]:
    """Another family's devices are advertised by the family (`NodeFamily.advertise`: an
    Ascend chip's slots are its vNPU count, as HAMi's Ascend device plugin registers); NVIDIA's
    GPUs on the same node (none in practice) as above."""
    from tessera.device_kinds import registry
    from tessera.device_kinds.node import NodeDeviceConfig, PhysicalDevice

    node_config = NodeDeviceConfig(
        split_count=config.split_count, memory_scaling=config.memory_scaling,
        core_scaling=config.core_scaling, mode=config.mode,
        exclude_uuids=config.exclude_uuids, exclude_indices=config.exclude_indices)
    out: list[DeviceInfo] = advertise([g for g in gpus if not g.family], settings, unhealthy,
                                      config)
    for name in dict.fromkeys(g.family for g in gpus if g.family):
        node_family = registry.node_family(name)
        if node_family is None:
            raise ValueError(f"device family {name!r} registers no node side")
        found = [
            PhysicalDevice(uuid=g.uuid, index=g.index, model=g.name, memory_mib=g.memory_mib,
                           cores=g.cores, numa=g.numa, links=dict(g.links))
            for g in gpus if g.family == name
        ]
        out.extend(node_family.advertise(found, node_config, unhealthy))
    return out
