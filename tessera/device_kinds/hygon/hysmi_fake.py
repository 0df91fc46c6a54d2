"""A simulated Hygon DCU management backend, shaped like `hy-smi` / `rocm-smi` (and the DCGM
library HAMi's DCU plugin links):

| tool / library | here |
|---|---|
| `hy-smi --showid` / DCGM `DeviceInfos` | `devices()` → index, UUID, `DCU-<model>`, PCI, CUs |
| `hy-smi --showmeminfo vram` | `vram(index)` → (total MiB, used MiB) |
| `hy-smi --showuse` | `use(index)` → % |
| `/dev/kfd` open (HAMi's health check) + driver faults | `healthy(index)` |
| the driver's vDCU table (`/etc/vdev/vdev<id>.conf`) | `create_vdev`, `destroy_vdev`, `vdevs` |

The driver refuses a vDCU that would give a CU twice or more memory than the DCU has.
vDCUs and what processes hold live in the state file (they outlive the agent); faults are
appended to the fault file as `<index> <state>` lines (0 = the DCU fell off, 1 = back; -1 = all).
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass

from ..fake_backend import FaultFeed, StateFile
from .annotations import TYPE_PREFIX, VdevConfig

HYSMI_OK = 0
HYSMI_ERR_INVALID = 1
HYSMI_ERR_NO_RESOURCE = 2
HYSMI_ERR_BUSY = 3


@dataclass(frozen=True)
class Dcu:
    index: int
    uuid: str
    type: str  # DCU-<model>
    pci_bus_id: str
    compute_units: int
    memory_mib: int


class SimulatedHySmi:
    """`count` simulated DCUs of one model on this node."""

    def __init__(self, node: str, model: str, count: int, memory_mib: int,
                 compute_units: int = 60, state_path: str = "",
                 fault_path: str = "") -> None:  # fmt: skip
        self.node = node
        self.model = model
        self.count = count
        self.memory_mib = memory_mib
        self.compute_units = compute_units
        self._state = StateFile(state_path)
        self._faults = FaultFeed(fault_path)
        self._down: set[int] = set()

    def devices(self) -> list[Dcu]:
        name = self.model if self.model.startswith(TYPE_PREFIX) else TYPE_PREFIX + self.model
        return [Dcu(i, f"DCU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{self.node}/dcu{i}')}",
                    name, f"0000:{0x10 + i:02x}:00.0", self.compute_units, self.memory_mib)
                for i in range(self.count)]

    def poll_faults(self) -> list[tuple[int, bool]]:
        changes = []
        while (fault := self._faults.next()) is not None:
            index, state = fault
            for i in range(self.count) if index == -1 else [index]:
                if not 0 <= i < self.count:
                    continue
                healthy = state != 0
                if healthy == (i in self._down):
                    (self._down.discard if healthy else self._down.add)(i)
                    changes.append((i, healthy))
        return changes

    def healthy(self, index: int) -> bool:
        return index not in self._down

    def vram(self, index: int) -> tuple[int, int]:
        used = int(self._state.read().get("used_mib", {}).get(str(index), 0))
        return self.memory_mib, min(used, self.memory_mib)

    def use(self, index: int) -> int:
        return int(self._state.read().get("use", {}).get(str(index), 0))

    # --- vDCUs ---------------------------------------------------------------------------------
    def vdevs(self) -> list[VdevConfig]:
        return [VdevConfig.parse(v["conf"]) for v in self._state.read().get("vdevs", [])]

    def holders(self) -> dict[int, str]:
        """vdev id -> who asked for it."""
        return {VdevConfig.parse(v["conf"]).vdev_id: v.get("holder", "")
                for v in self._state.read().get("vdevs", [])}

    def free_cu_mask(self, index: int) -> int:
        taken = 0
        for v in self.vdevs():
            if v.device_id == index:
                taken |= v.cu_mask
        return ((1 << self.compute_units) - 1) & ~taken

    def create_vdev(self, index: int, cu_mask: int, memory_mib: int,
                    holder: str = "") -> tuple[int, VdevConfig | None]:  # fmt: skip
        if not 0 <= index < self.count or memory_mib <= 0 or cu_mask >> self.compute_units:
            return HYSMI_ERR_INVALID, None
        with self._state.change() as state:
            existing = [VdevConfig.parse(v["conf"]) for v in state.setdefault("vdevs", [])]
            mine = [v for v in existing if v.device_id == index]
            if (any(v.cu_mask & cu_mask for v in mine)
                    or sum(v.memory_mib for v in mine) + memory_mib > self.memory_mib):
                return HYSMI_ERR_NO_RESOURCE, None
            vdev_id = min(set(range(len(existing) + 1)) - {v.vdev_id for v in existing})
            pipe_id = min(set(range(len(mine) + 1)) - {v.pipe_id for v in mine})
            dcu = self.devices()[index]
            conf = VdevConfig(dcu.pci_bus_id, cu_mask, bin(cu_mask).count("1"), memory_mib,
                              index, vdev_id, pipe_id)
            state["vdevs"].append({"conf": conf.render(), "holder": holder})
        return HYSMI_OK, conf

    def destroy_vdev(self, vdev_id: int) -> int:
        with self._state.change() as state:
            vdevs = state.setdefault("vdevs", [])
            match = [v for v in vdevs if VdevConfig.parse(v["conf"]).vdev_id == vdev_id]
            if not match:
                return HYSMI_ERR_INVALID
            if state.get("busy", {}).get(str(vdev_id)):
                return HYSMI_ERR_BUSY
            vdevs.remove(match[0])
        return HYSMI_OK

    # --- what a workload does (tests) ----------------------------------------------------------
    def set_usage(self, index: int, used_mib: int, use: int) -> None:
        with self._state.change() as state:
            state.setdefault("used_mib", {})[str(index)] = used_mib
            state.setdefault("use", {})[str(index)] = use
