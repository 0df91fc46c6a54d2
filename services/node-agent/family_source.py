"""Devices of another vendor's family, read through its backend (tessera.device_kinds: the
vendor's management library, or its fake on the local stack), as the node agent's device
source: discovery, health and host usage the same way NVML's are, so registration, health,
usage and the device plugin run unchanged on the family's devices."""

from __future__ import annotations

from tessera.device_kinds import registry
from tessera.device_kinds.node import DeviceBackend, NodeFamily
from tessera.settings import TesseraSettings

from .devices import HealthEvent, PhysicalGpu


class FamilySource:
    def __init__(self, family: NodeFamily, backend: DeviceBackend) -> None:
        self.node_family = family
        self.family = family.family.name
        self.backend = backend

    @classmethod
    def of(cls, settings: TesseraSettings, node: str) -> FamilySource:
        """The source of `settings.device_family` (its folder registers its node side)."""
        found = registry.node_family(settings.device_family)
        if found is None:
            raise ValueError(f"TESSERA_DEVICE_FAMILY={settings.device_family!r}: no device family "
                             "registers a node side by that name")  # fmt: skip
        return cls(found, found.backend(settings, node))

    def discover(self) -> list[PhysicalGpu]:
        family = self.node_family
        return [
            PhysicalGpu(d.uuid, d.index, d.model, d.memory_mib, d.numa, links=dict(d.links),
                        family=self.family, family_type=family.device_type(d),
                        family_mode=family.default_mode(d), cores=d.cores)
            for d in self.backend.discover()
        ]

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        change = self.backend.wait_health(timeout_s)
        if change is None or change.healthy:
            return None  # recovery is the health tracker's (after health_recovery_s)
        return HealthEvent(change.uuid, "lost")

    def host_usage(self) -> dict[str, tuple[int, int, float]]:
        return self.backend.usage()

    def close(self) -> None:
        self.backend.close()
