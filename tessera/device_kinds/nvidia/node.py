"""The node agent's side of the `nvidia` family: GPUs found through NVML (or simulated on the
local stack), advertised as HAMi registers them.

- Backend: `NvmlBackend` (nvml_backend.py) on a GPU node, `SimulatedGpus` (static_gpus.py) with
  `TESSERA_DEVICE_SOURCE=static`.
- Registration: a GPU's type is `NVIDIA-<NVML name>` (HAMi's), its mode `mig` when NVML reports
  MIG mode on (`attributes["mig"]`), else `hami-core` (libvgpu slices); a node configured for
  `mps` (or another mode) says so in its config. Under `migstrategy: dynamic`, a GPU in MIG mode
  whose model Tessera knows advertises the MIG geometries the node may lay out on it.
- What a container gets at Allocate is NVIDIA's own node-agent answer (libvgpu mounts, MIG
  instances, MPS daemons: services/node-agent/nvidia_answers.py), not `node_edits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tessera import mig

from ..node import DeviceBackend, NodeDeviceConfig, NodeFamily, PhysicalDevice
from .family import NVIDIA
from .mig import MODE as MIG_MODE
from .slices import MODE as SLICES_MODE

if TYPE_CHECKING:
    from tessera.models import DeviceInfo, MigCapability
    from tessera.settings import TesseraSettings

TYPE_PREFIX = "NVIDIA-"


def in_mig_mode(device: PhysicalDevice) -> bool:
    return device.attributes.get("mig") == "true"


class NvidiaNode(NodeFamily):
    family = NVIDIA

    def backend(self, settings: TesseraSettings, node: str) -> DeviceBackend:
        if settings.device_source == "static":
            from .static_gpus import SimulatedGpus

            return SimulatedGpus(settings, node)
        from .nvml_backend import NvmlBackend

        return NvmlBackend(settings)

    def device_type(self, device: PhysicalDevice) -> str:
        return TYPE_PREFIX + device.model

    def default_mode(self, device: PhysicalDevice) -> str:
        return MIG_MODE if in_mig_mode(device) else SLICES_MODE

    def advertise(
        self, found: Sequence[PhysicalDevice], config: NodeDeviceConfig,
        unhealthy: frozenset[str] = frozenset(),
    ) -> list[DeviceInfo]:
        """The family's registration, with each GPU's dynamic MIG capability."""
        devices = super().advertise(found, config, unhealthy)
        if config.mig_strategy != mig.STRATEGY_DYNAMIC or config.mode not in (None, MIG_MODE):
            return devices
        by_uuid = {d.uuid: d for d in found}
        return [d.model_copy(update={"mig": capability})
                if (capability := self.mig_capability(by_uuid[d.uuid], config)) else d
                for d in devices]  # fmt: skip

    @staticmethod
    def mig_capability(device: PhysicalDevice, config: NodeDeviceConfig) -> MigCapability | None:
        """What a GPU advertises for dynamic MIG: a GPU in MIG mode whose model Tessera knows,
        with the operator's geometries for that model (none: any layout NVIDIA's tables
        allow)."""
        from tessera.models import MigCapability

        model = mig.model_for(device.model) if in_mig_mode(device) else None
        if model is None:
            return None
        allowed = mig.parse_geometries(config.mig_geometries).get(model.name, [])
        return MigCapability(model=model.name, geometries=allowed)


NODE = NvidiaNode()


def _register() -> None:
    from ..registry import register_node

    register_node(NODE)


_register()
