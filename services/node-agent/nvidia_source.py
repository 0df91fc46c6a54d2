"""NVIDIA's GPUs as the node agent's device source: the family's backend (NVML, or the
simulated GPUs: tessera.device_kinds.nvidia's node side) read like any family's
(family_source.py), with what only NVIDIA's node side has on top: the MIG instances that exist
on the GPUs (static MIG) and the MIG backend that makes and removes them (dynamic MIG)."""

from __future__ import annotations

from tessera.node_agent.family_source import FamilySource

from tessera.device_kinds.node import DeviceBackend
from tessera.device_kinds.nvidia.node import NODE
from tessera.device_kinds.nvidia.static_gpus import SimulatedGpus
from tessera.settings import TesseraSettings


class NvidiaSource(FamilySource):
    node_side = NODE

    def __init__(self, backend: DeviceBackend, settings: TesseraSettings, node: str) -> None:
        super().__init__(NODE, backend)
        self.settings = settings
        self.node = node

    @classmethod
    def of(cls, settings: TesseraSettings, node: str) -> NvidiaSource:
        """On the backend NVIDIA's node side opens (NVML, or the simulated GPUs)."""
        return cls(NODE.backend(settings, node), settings, node)

    def mig_offers(self) -> list:
        """The MIG instances on the GPUs: NVML's (nvml.py), or the simulated ones
        (`static_mig_instances` on every GPU, MIG UUIDs stable)."""
        if isinstance(self.backend, SimulatedGpus):
            from tessera.node_agent.mig_static import simulated_offers

            return simulated_offers(self.discover(), self.settings.static_mig_instances,
                                    self.node)  # fmt: skip
        from tessera.node_agent.nvml import nvml_offers

        return nvml_offers(self.backend)  # type: ignore[arg-type]

    def mig_backend(self) -> object:
        """Dynamic MIG: through NVML (nvml.py), or on the simulated GPUs (mig_sim.py, instances
        kept in `static_mig_state`; in memory when unset)."""
        if isinstance(self.backend, SimulatedGpus):
            from tessera.node_agent.mig_sim import SimulatedMig

            return SimulatedMig(self.discover(), self.settings.static_mig_state or None)
        from tessera.node_agent.nvml import nvml_mig_backend

        return nvml_mig_backend(self.backend)  # type: ignore[arg-type]


class StaticSource(NvidiaSource):
    """Simulated GPUs (local stack): count, model and memory from settings, stable UUIDs."""

    def __init__(self, settings: TesseraSettings, node: str) -> None:
        super().__init__(SimulatedGpus(settings, node), settings, node)
