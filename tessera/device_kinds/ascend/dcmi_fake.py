"""A simulated Ascend DCMI (the driver's management library `npu-smi` is built on).

Modelled on DCMI's documented calls, in the same shape (cards, the devices in each card, a
logic id per device; return codes instead of exceptions where DCMI returns them):

| DCMI | here |
|---|---|
| `dcmi_get_card_num_list` | `get_card_num_list()` → card ids |
| `dcmi_get_device_num_in_card` | `get_device_num_in_card(card)` (910C: 2 dies a module, else 1) |
| `dcmi_get_device_logic_id` | `get_device_logic_id(card, device)` |
| `dcmi_get_device_chip_info` | `get_device_chip_info(card, device)` → `Ascend`, e.g. `910B3` |
| `dcmi_get_device_die_v2` | `get_device_die(card, device)` → the die id the NPU's UUID is made of |
| `dcmi_get_device_health` | `get_device_health(card, device)` → 0 OK, 1/2/3 minor/major/critical |
| `dcmi_get_device_hbm_info` | `get_device_hbm_info(card, device)` → (total MB, used MB) |
| `dcmi_get_device_utilization_rate` | `get_device_utilization_rate(card, device)` → AI core % |
| `dcmi_create_vdevice` | `create_vdevice(card, device, template)` → (ret, vdev id) |
| `dcmi_set_destroy_vdevice` | `destroy_vdevice(card, device, vdev id)` → ret |
| `npu-smi info -t template-info` | `templates(card, device)` |

The driver refuses a vNPU whose template it does not know, or that would overlap the chip's
AI cores, AI CPUs or memory (`DCMI_ERR_RESOURCE_OCCUPIED`), and refuses to destroy a vNPU a
process still holds (`DCMI_ERR_DEVICE_BUSY`). vNPUs and what processes hold live in the state
file (they outlive the agent, as on a real node); health faults are appended to the fault file
as `<logic id> <health code>` lines (-1: every chip; 0 makes the chip healthy again).
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass

from ..fake_backend import FaultFeed, StateFile
from .chips import AscendChip, VnpuTemplate

DCMI_OK = 0
DCMI_ERR_INVALID_PARAMETER = -8001
DCMI_ERR_RESOURCE_OCCUPIED = -8020
DCMI_ERR_DEVICE_BUSY = -8012
HEALTH_OK, HEALTH_MINOR, HEALTH_MAJOR, HEALTH_CRITICAL = 0, 1, 2, 3
FIRST_VDEV_ID = 100  # vNPU ids are numbered above the physical ones


@dataclass(frozen=True)
class VDevice:
    vdev_id: int
    logic_id: int
    template: str
    holder: str  # who asked for it (the node agent records the pod/container)


class SimulatedDcmi:
    """`chips` simulated NPUs of one chip type on this node (`chip` from the vnpus table)."""

    def __init__(self, node: str, chip: AscendChip, chips: int, state_path: str = "",
                 fault_path: str = "") -> None:  # fmt: skip
        self.node = node
        self.chip = chip
        self.chips = chips
        self._per_card = 2 if chip.module_pairs else 1
        self._state = StateFile(state_path)
        self._faults = FaultFeed(fault_path)
        self._health: dict[int, int] = {}

    # --- topology ------------------------------------------------------------------------------
    def get_card_num_list(self) -> list[int]:
        return list(range((self.chips + self._per_card - 1) // self._per_card))

    def get_device_num_in_card(self, card: int) -> int:
        return min(self._per_card, self.chips - card * self._per_card)

    def get_device_logic_id(self, card: int, device: int) -> int:
        return card * self._per_card + device

    def get_device_chip_info(self, card: int, device: int) -> dict[str, str]:
        return {"chip_type": "Ascend", "chip_name": self.chip.chip_name, "chip_ver": "V1"}

    def get_device_die(self, card: int, device: int) -> str:
        logic = self.get_device_logic_id(card, device)
        return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{self.node}/npu{logic}")).upper()

    def templates(self, card: int, device: int) -> list[dict[str, int | str]]:
        return [{"name": t.name, "memory": t.memory, "aicore": t.ai_core, "aicpu": t.ai_cpu}
                for t in self.chip.templates]

    # --- health and usage ----------------------------------------------------------------------
    def poll_faults(self) -> list[tuple[int, int]]:
        """Reads new fault lines; returns (logic id, health code) changes."""
        changes = []
        while (fault := self._faults.next()) is not None:
            logic, code = fault
            targets = range(self.chips) if logic == -1 else [logic]
            for t in targets:
                if 0 <= t < self.chips and self._health.get(t, HEALTH_OK) != code:
                    self._health[t] = code
                    changes.append((t, code))
        return changes

    def get_device_health(self, card: int, device: int) -> int:
        return self._health.get(self.get_device_logic_id(card, device), HEALTH_OK)

    def get_device_hbm_info(self, card: int, device: int) -> tuple[int, int]:
        logic = self.get_device_logic_id(card, device)
        used = self._state.read().get("used_mb", {}).get(str(logic), 0)
        return self.chip.memory_capacity, min(int(used), self.chip.memory_capacity)

    def get_device_utilization_rate(self, card: int, device: int) -> int:
        logic = self.get_device_logic_id(card, device)
        return int(self._state.read().get("aicore_util", {}).get(str(logic), 0))

    # --- vNPUs ---------------------------------------------------------------------------------
    def vdevices(self) -> list[VDevice]:
        return [VDevice(int(v["vdev_id"]), int(v["logic_id"]), v["template"], v.get("holder", ""))
                for v in self._state.read().get("vdevices", [])]

    def create_vdevice(self, card: int, device: int, template: str,
                       holder: str = "") -> tuple[int, int]:  # fmt: skip
        logic = self.get_device_logic_id(card, device)
        spec = self.chip.template(template)
        if spec is None or not 0 <= logic < self.chips:
            return DCMI_ERR_INVALID_PARAMETER, -1
        with self._state.change() as state:
            existing = state.setdefault("vdevices", [])
            held = [self.chip.template(v["template"]) for v in existing
                    if v["logic_id"] == logic]
            if not self._room_for(spec, [t for t in held if t is not None]):
                return DCMI_ERR_RESOURCE_OCCUPIED, -1
            vdev_id = max([FIRST_VDEV_ID - 1, *(v["vdev_id"] for v in existing)]) + 1
            existing.append({"vdev_id": vdev_id, "logic_id": logic, "template": template,
                             "holder": holder})
        return DCMI_OK, vdev_id

    def destroy_vdevice(self, card: int, device: int, vdev_id: int) -> int:
        logic = self.get_device_logic_id(card, device)
        with self._state.change() as state:
            existing = state.setdefault("vdevices", [])
            match = [v for v in existing if v["vdev_id"] == vdev_id and v["logic_id"] == logic]
            if not match:
                return DCMI_ERR_INVALID_PARAMETER
            if state.get("busy", {}).get(str(vdev_id)):
                return DCMI_ERR_DEVICE_BUSY
            existing.remove(match[0])
        return DCMI_OK

    def _room_for(self, spec: VnpuTemplate, held: list[VnpuTemplate]) -> bool:
        """The driver's own check (kept apart from the scheduler's rules on purpose): the
        chip's AI cores, AI CPUs and memory are never cut twice."""
        cores = sum(t.ai_core for t in held) + spec.ai_core
        cpus = sum(t.ai_cpu for t in held) + spec.ai_cpu
        memory = sum(t.memory for t in held) + spec.memory
        return (cores <= self.chip.ai_core and memory <= self.chip.memory_allocatable
                and (not self.chip.ai_cpu or cpus <= self.chip.ai_cpu))

    # --- what a workload does (tests and the simulated kubelet) --------------------------------
    def set_usage(self, logic_id: int, used_mb: int, aicore_util: int) -> None:
        with self._state.change() as state:
            state.setdefault("used_mb", {})[str(logic_id)] = used_mb
            state.setdefault("aicore_util", {})[str(logic_id)] = aicore_util
