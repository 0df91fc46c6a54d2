"""A simulated Cambricon CNDev (the library `cnmon` and Cambricon's device plugin use).

Modelled on CNDev's documented calls (names kept, Python-cased), with CNDev's return codes:

| CNDev | here |
|---|---|
| `cndevGetDeviceCount` | `get_device_count()` |
| `cndevGetCardName` / `cndevGetCardNameStringByDevId` | `get_card_name(slot)` e.g. `MLU370-X4` |
| `cndevGetUUID` | `get_uuid(slot)` (`MLU-…`) |
| `cndevGetMemoryUsage` | `get_memory_usage(slot)` → (total MiB, used MiB) |
| `cndevGetDeviceUtilizationInfo` | `get_utilization(slot)` → % |
| `cndevGetCardHealthState` | `get_health(slot)` → 1 healthy, 0 not |
| `cndevCreateSmluProfile` | `create_smlu_profile(slot, vcore %, vmemory units)` → (ret, id) |
| `cndevCreateSmluInstanceByProfileID` | `create_smlu_instance(profile, slot)` → (ret, handle) |
| `cndevDestroySmlu` | `destroy_smlu(handle)` (refused while a process holds it) |
| `cndevGetAllSmluInfo` | `smlu_infos(slot)` → instances with their device node |

An sMLU's compute and memory are the driver's to enforce: the driver refuses an instance that
would take more than 100 % of an MLU's compute or more than its memory. A handle is
`instance << 8 | slot`; an instance's device node is `/dev/cambricon-caps/cap_dev<slot>_mi<n>`.
Instances and what processes hold live in the state file; health faults are appended to the
fault file as `<slot> <state>` lines (state 0 = unhealthy, 1 = healthy again; -1 = every MLU).
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass

from ..fake_backend import FaultFeed, StateFile
from .annotations import MEMORY_UNIT_MIB

CNDEV_SUCCESS = 0
CNDEV_ERROR_INVALID_ARGUMENT = 2
CNDEV_ERROR_INSUFFICIENT_SPACE = 7
CNDEV_ERROR_IN_USE = 11
HEALTHY, UNHEALTHY = 1, 0
CAPS_DIR = "/dev/cambricon-caps"


def smlu_device_node(slot: int, instance: int) -> str:
    return f"{CAPS_DIR}/cap_dev{slot}_mi{instance}"


@dataclass(frozen=True)
class SmluInstance:
    handle: int
    slot: int
    instance: int
    profile: int
    vcore: int
    vmemory: int  # 256 MiB units
    holder: str = ""  # who asked for it (the node agent: the pod's container and MLU)

    @property
    def device_node(self) -> str:
        return smlu_device_node(self.slot, self.instance)


class SimulatedCndev:
    """`count` simulated MLUs of one model (`card_name`, `memory_mib` each) on this node."""

    def __init__(self, node: str, card_name: str, count: int, memory_mib: int,
                 state_path: str = "", fault_path: str = "") -> None:  # fmt: skip
        self.node = node
        self.card_name = card_name
        self.count = count
        self.memory_mib = memory_mib
        self._state = StateFile(state_path)
        self._faults = FaultFeed(fault_path)
        self._health: dict[int, int] = {}

    def get_device_count(self) -> int:
        return self.count

    def get_card_name(self, slot: int) -> str:
        return self.card_name

    def get_uuid(self, slot: int) -> str:
        return f"MLU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{self.node}/mlu{slot}')}"

    def poll_faults(self) -> list[tuple[int, int]]:
        changes = []
        while (fault := self._faults.next()) is not None:
            slot, state = fault
            for s in range(self.count) if slot == -1 else [slot]:
                if 0 <= s < self.count and self._health.get(s, HEALTHY) != state:
                    self._health[s] = state
                    changes.append((s, state))
        return changes

    def get_health(self, slot: int) -> int:
        return self._health.get(slot, HEALTHY)

    def get_memory_usage(self, slot: int) -> tuple[int, int]:
        used = int(self._state.read().get("used_mib", {}).get(str(slot), 0))
        return self.memory_mib, min(used, self.memory_mib)

    def get_utilization(self, slot: int) -> int:
        return int(self._state.read().get("util", {}).get(str(slot), 0))

    # --- sMLU ----------------------------------------------------------------------------------
    def create_smlu_profile(self, slot: int, vcore: int, vmemory: int) -> tuple[int, int]:
        if not (0 <= slot < self.count and 0 < vcore <= 100 and vmemory > 0
                and vmemory * MEMORY_UNIT_MIB <= self.memory_mib):
            return CNDEV_ERROR_INVALID_ARGUMENT, -1
        with self._state.change() as state:
            profiles = state.setdefault("profiles", [])
            for p in profiles:
                if (p["slot"], p["vcore"], p["vmemory"]) == (slot, vcore, vmemory):
                    return CNDEV_SUCCESS, p["id"]
            pid = max([0, *(p["id"] for p in profiles)]) + 1
            profiles.append({"id": pid, "slot": slot, "vcore": vcore, "vmemory": vmemory})
        return CNDEV_SUCCESS, pid

    def create_smlu_instance(self, profile: int, slot: int, holder: str = "") -> tuple[int, int]:
        with self._state.change() as state:
            spec = next((p for p in state.get("profiles", [])
                         if p["id"] == profile and p["slot"] == slot), None)
            if spec is None:
                return CNDEV_ERROR_INVALID_ARGUMENT, -1
            held = [i for i in state.setdefault("instances", []) if i["slot"] == slot]
            if (sum(i["vcore"] for i in held) + spec["vcore"] > 100
                    or (sum(i["vmemory"] for i in held) + spec["vmemory"]) * MEMORY_UNIT_MIB
                    > self.memory_mib):
                return CNDEV_ERROR_INSUFFICIENT_SPACE, -1
            instance = max([0, *(i["instance"] for i in held)]) + 1
            handle = instance << 8 | slot
            state["instances"].append({"handle": handle, "slot": slot, "instance": instance,
                                       "profile": profile, "vcore": spec["vcore"],
                                       "vmemory": spec["vmemory"], "holder": holder})
        return CNDEV_SUCCESS, handle

    def destroy_smlu(self, handle: int) -> int:
        with self._state.change() as state:
            instances = state.setdefault("instances", [])
            match = [i for i in instances if i["handle"] == handle]
            if not match:
                return CNDEV_ERROR_INVALID_ARGUMENT
            if state.get("busy", {}).get(str(handle)):
                return CNDEV_ERROR_IN_USE
            instances.remove(match[0])
        return CNDEV_SUCCESS

    def smlu_infos(self, slot: int | None = None) -> list[SmluInstance]:
        return [SmluInstance(i["handle"], i["slot"], i["instance"], i["profile"], i["vcore"],
                             i["vmemory"], i.get("holder", ""))
                for i in self._state.read().get("instances", [])
                if slot is None or i["slot"] == slot]

    # --- what a workload does (tests) ----------------------------------------------------------
    def set_usage(self, slot: int, used_mib: int, util: int) -> None:
        with self._state.change() as state:
            state.setdefault("used_mib", {})[str(slot)] = used_mib
            state.setdefault("util", {})[str(slot)] = util
