"""A node's devices, read through their family's backend (tessera.device_kinds: the vendor's
management library, or its simulation on the local stack), as the node agent's device source:
discovery, health and host usage the same way for every family (NVIDIA's NVML among them), so
registration, health, usage and the device plugin run unchanged on any family's devices."""

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

    @staticmethod
    def node_family_of(settings: TesseraSettings) -> NodeFamily:
        """The node side of `settings.device_family` (its folder registers it; unset: the
        default family's, NVIDIA)."""
        name = settings.device_family or registry.DEFAULT_FAMILY
        found = registry.node_family(name)
        if found is None:
            raise ValueError(f"TESSERA_DEVICE_FAMILY={name!r}: no device family registers a "
                             "node side by that name")  # fmt: skip
        return found

    @classmethod
    def of(cls, settings: TesseraSettings, node: str) -> FamilySource:
        """The source of the node's family, on the backend its node side opens."""
        found = cls.node_family_of(settings)
        return cls(found, found.backend(settings, node))

    def discover(self) -> list[PhysicalGpu]:
        family = self.node_family
        return [
            PhysicalGpu(d.uuid, d.index, d.model, d.memory_mib, d.numa, links=dict(d.links),
                        mig=d.attributes.get("mig") == "true", family=self.family,
                        family_type=family.device_type(d), family_mode=family.default_mode(d),
                        cores=d.cores, attributes=dict(d.attributes))
            for d in self.backend.discover()
        ]

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        change = self.backend.wait_health(timeout_s)
        if change is None or change.healthy:
            return None  # recovery is the health tracker's (after health_recovery_s)
        return HealthEvent(change.uuid, change.cause or "lost", change.code)

    def host_usage(self) -> dict[str, tuple[int, int, float]]:
        return self.backend.usage()

    def close(self) -> None:
        self.backend.close()
