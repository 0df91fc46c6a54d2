"""HAMi's Cambricon MLU names and annotations. Pure.

Facts from HAMi (`pkg/device/cambricon`, its chart's `mluResourceName`/`mluResourceMem`/
`mluResourceCores`, docs/cambricon-mlu-support.md) and Cambricon's device plugin (dynamic-smlu
mode); the code is ours:

- Resources (configurable): `cambricon.com/vmlu` (MLUs), `cambricon.com/mlu.smlu.vmemory`
  (device memory in **units of 256 MiB**), `cambricon.com/mlu.smlu.vcore` (% of an MLU's compute,
  100 when absent). Without vmemory a container takes an MLU's whole memory.
- User knobs: `cambricon.com/use-mlutype` / `nouse-mlutype` (comma list, case-insensitive
  substring of the card type), `cambricon.com/use-gpuuuid` / `nouse-gpuuuid` (exact UUIDs).
- Scheduler-owned: `hami.io/cambricon-mlu-devices-to-allocate` / `-allocated` (HAMi's device
  list), `CAMBRICON_DSMLU_PROFILE` = `<slot>_<vcore>_<vmemory units>` (the sMLU the device plugin
  creates), `CAMBRICON_DSMLU_ASSIGNED` = `false` until the plugin made it, then `true`.
- Device-plugin-owned: `CAMBRICON_DSMLU_PROFILE_INSTANCE` = `<profile>_<handle>_<slot>_<instance>`.
- HAMi's node lock `cambricon.com/dsmlu.lock` is not used: Tessera has no node-wide lock.
- Node: HAMi reads an MLU node's capacity; Tessera also writes its own
  `tessera.io/node-register-mlu` (HAMi's JSON device list) for `tessera get nodes`.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMON_WORD = "MLU"
DEFAULT_COUNT = "cambricon.com/vmlu"
DEFAULT_MEMORY = "cambricon.com/mlu.smlu.vmemory"
DEFAULT_CORES = "cambricon.com/mlu.smlu.vcore"
MEMORY_UNIT_MIB = 256

USE_TYPE = "cambricon.com/use-mlutype"
NOUSE_TYPE = "cambricon.com/nouse-mlutype"
USE_UUID = "cambricon.com/use-gpuuuid"
NOUSE_UUID = "cambricon.com/nouse-gpuuuid"
TO_ALLOCATE = "hami.io/cambricon-mlu-devices-to-allocate"
ALLOCATED = "hami.io/cambricon-mlu-devices-allocated"
DSMLU_PROFILE = "CAMBRICON_DSMLU_PROFILE"
DSMLU_ASSIGNED = "CAMBRICON_DSMLU_ASSIGNED"
DSMLU_PROFILE_INSTANCE = "CAMBRICON_DSMLU_PROFILE_INSTANCE"
NODE_LOCK = "cambricon.com/dsmlu.lock"
NODE_REGISTER = "tessera.io/node-register-mlu"  # Tessera's own (HAMi reads node capacity)

USER_KEYS = (USE_TYPE, NOUSE_TYPE, USE_UUID, NOUSE_UUID)
SCHEDULER_OWNED = (TO_ALLOCATE, ALLOCATED, DSMLU_PROFILE, DSMLU_ASSIGNED)
AGENT_OWNED = (DSMLU_PROFILE_INSTANCE,)


@dataclass(frozen=True)
class DsmluProfile:
    """What the sMLU of a container holds: its MLU slot, % compute, memory in 256 MiB units."""

    slot: int
    vcore: int
    vmemory: int

    def encode(self) -> str:
        return f"{self.slot}_{self.vcore}_{self.vmemory}"

    @classmethod
    def decode(cls, text: str) -> DsmluProfile:
        parts = text.split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{DSMLU_PROFILE}: expected <slot>_<vcore>_<vmemory>: {text[:40]!r}")
        return cls(int(parts[0]), int(parts[1]), int(parts[2]))


def encode_profile_instance(profile: int, handle: int, slot: int, instance: int) -> str:
    return f"{profile}_{handle}_{slot}_{instance}"


def vmemory_units(memory_mib: int) -> int:
    """MiB → sMLU memory units (rounded up: a container never gets less than it was granted)."""
    return -(-memory_mib // MEMORY_UNIT_MIB)
