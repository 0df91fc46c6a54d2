"""The node agent's side of an Ascend chip type: NPUs found through DCMI (simulated here: the
hardware cannot run on this machine), registered with HAMi's annotation, health from DCMI.

- A device is one NPU (its die id is its UUID, its logic id its index); on 910C one **module**
  (two dies; its index the module's, its memory and AI cores both dies', its UUID die 0's ID
  and `part_ids` both dies' IDs, as HAMi's Ascend plugin registers each NPU), allocated whole.
- What it advertises is the chip's own memory (`memoryAllocatable`) and AI cores, with the
  node's configuration (split count) as for any device; the Ascend kind checks every vNPU
  against the chip's own figures, so a scaling the configuration applies never overcommits a
  chip (the driver's vNPUs are hard partitions).
- Health: DCMI's health code, major (2) or critical (3) = unhealthy, back at 0 or 1.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..fake_backend import HealthPoller
from ..node import HealthChange, NodeDeviceConfig, NodeFamily, PhysicalDevice
from .chips import AscendChip, active_chip, active_chips, chip_for_name, chip_for_type
from .dcmi_fake import HEALTH_MAJOR, SimulatedDcmi
from .family import AscendFamily
from .vnpu import mode_of

if TYPE_CHECKING:
    from tessera.models import DeviceInfo
    from tessera.settings import TesseraSettings


PART_IDS = "part_ids"  # PhysicalDevice.attributes: a 910C module's NPUs' die IDs, in order


def vnpu_count(chip: AscendChip) -> int:
    """HAMi's `VDeviceCount`: how many vNPUs of the smallest template a chip holds (1 without
    templates; a 910C module is given whole: 1)."""
    if chip.module_pairs or not chip.templates:
        return 1
    return max(1, chip.memory_allocatable // chip.templates[0].memory)


def chip_for_model(model: str) -> AscendChip | None:
    """The chip a node's model names: a commonWord (`Ascend910B3`) or a chip name (`910B3`)."""
    chips = active_chips()
    return chip_for_type(chips, model) or chip_for_name(chips, model)


class DcmiBackend:
    """DeviceBackend over (simulated) DCMI."""

    def __init__(self, dcmi: SimulatedDcmi) -> None:
        self.dcmi = dcmi
        self.chip = dcmi.chip
        self._health = HealthPoller(self._changes)

    def _npus(self) -> list[tuple[int, int, int]]:
        """(card, device, logic id) of every NPU."""
        d = self.dcmi
        return [(card, dev, d.get_device_logic_id(card, dev))
                for card in d.get_card_num_list() for dev in range(d.get_device_num_in_card(card))]

    def discover(self) -> list[PhysicalDevice]:
        d, chip = self.dcmi, self.chip
        found = []
        for card, dev, logic in self._npus():
            if chip.module_pairs and dev != 0:
                continue  # the module is the device: its first die speaks for it
            dies = d.get_device_num_in_card(card) if chip.module_pairs else 1
            healthy = all(d.get_device_health(card, j) < HEALTH_MAJOR for j in range(dies)) \
                if chip.module_pairs else d.get_device_health(card, dev) < HEALTH_MAJOR
            attributes = {"chip": d.get_device_chip_info(card, dev)["chip_name"],
                          "card": str(card), "dies": str(dies)}
            if chip.module_pairs:  # each NPU's own die ID, as HAMi's plugin registers them
                attributes[PART_IDS] = ",".join(d.get_device_die(card, j) for j in range(dies))
            found.append(PhysicalDevice(
                uuid=d.get_device_die(card, dev),
                index=card if chip.module_pairs else logic,
                model=chip.common_word,
                memory_mib=chip.memory_allocatable * dies,
                cores=chip.ai_core * dies, healthy=healthy, attributes=attributes,
            ))
        return found

    def wait_health(self, timeout_s: float) -> HealthChange | None:
        return self._health.wait(timeout_s)

    def _changes(self) -> list[HealthChange]:
        changes = self.dcmi.poll_faults()
        if not changes:
            return []
        by_logic = {logic: (card, dev) for card, dev, logic in self._npus()}
        out = []
        for logic, code in changes:
            card, dev = by_logic[logic]
            uuid = self.dcmi.get_device_die(card, 0 if self.chip.module_pairs else dev)
            out.append(HealthChange(uuid, code < HEALTH_MAJOR,
                                    f"DCMI health {code} on NPU {logic}"))
        return out

    def usage(self) -> dict[str, tuple[int, int, float]]:
        out: dict[str, tuple[int, int, float]] = {}
        for card, dev, _ in self._npus():
            total, used = self.dcmi.get_device_hbm_info(card, dev)
            uuid = self.dcmi.get_device_die(card, 0 if self.chip.module_pairs else dev)
            before = out.get(uuid, (0, 0, 0.0))
            out[uuid] = (before[0] + (used << 20), before[1] + (total << 20),
                         max(before[2], float(self.dcmi.get_device_utilization_rate(card, dev))))
        return out

    def close(self) -> None:
        return None


class AscendNode(NodeFamily):
    def __init__(self, family: AscendFamily) -> None:
        self.family = family  # type: ignore[misc]

    def backend(self, settings: TesseraSettings, node: str) -> DcmiBackend:
        if settings.device_source != "static":
            raise RuntimeError(
                "Ascend NPUs are read through DCMI (libdcmi.so on an Ascend node), which this "
                "build does not link; run the node agent with TESSERA_DEVICE_SOURCE=static for "
                "the simulated NPUs")
        chip = active_chip(self.family.common_word)  # type: ignore[attr-defined]
        state_dir = settings.region_host_dir or "."
        return DcmiBackend(SimulatedDcmi(
            node, chip, settings.static_gpu_count,
            state_path=os.path.join(state_dir, f"dcmi-{chip.common_word}.json"),
            fault_path=settings.static_fault_file or ""))

    def default_mode(self, device: PhysicalDevice) -> str:
        return mode_of(self.family.common_word)  # type: ignore[attr-defined]

    def advertise(
        self, found: Sequence[PhysicalDevice], config: NodeDeviceConfig,
        unhealthy: frozenset[str] = frozenset(),
    ) -> list[DeviceInfo]:
        """As the interface's default, but a chip's slots are its vNPU count as HAMi's Ascend
        device plugin registers it (`Count`): `memoryAllocatable` over the smallest template's
        memory (1 without templates); a 910C module 1 (given whole). Not the node's NVIDIA
        split count: the vNPUs a chip can hold are the driver's, not a setting."""
        slots = vnpu_count(active_chip(self.family.common_word))  # type: ignore[attr-defined]
        parts = {d.uuid: [p for p in d.attributes.get(PART_IDS, "").split(",") if p]
                 for d in found}  # fmt: skip
        return [d.model_copy(update={"split_count": slots, "part_ids": parts.get(d.uuid, [])})
                for d in super().advertise(found, config, unhealthy)]


def _register_nodes() -> None:
    from ..registry import register_node
    from . import FAMILIES

    for family in FAMILIES.values():
        register_node(AscendNode(family))


_register_nodes()
