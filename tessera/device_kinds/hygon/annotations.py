"""HAMi's Hygon DCU names and annotations, and the vDCU config file. Pure.

Facts from HAMi (`pkg/device/hygon`, docs/hygon-dcu-support.md) and HAMi's dcu-vgpu-device-
plugin; the code is ours:

- Resources (configurable): `hygon.com/dcunum` (DCUs), `hygon.com/dcumem` (MiB per DCU),
  `hygon.com/dcucores` (% of a DCU's compute units; 0 when absent). Memory or cores make a
  **vDCU**, which serves one DCU per container (more DCUs: whole DCUs).
- Device type `DCU-<model>` (e.g. `DCU-Z100L`); user knobs `hygon.com/use-dcutype` /
  `nouse-dcutype` (comma list, case-insensitive substring of the type), `hygon.com/use-gpuuuid`
  / `nouse-gpuuuid` (exact UUIDs).
- Node: `hami.io/node-dcu-register` (HAMi's legacy device list: `UUID,count,devmem,devcore,
  type,numa,health:` per device), `hami.io/node-handshake-dcu` (`Reported_<time>`).
- Pod, scheduler-owned: `hami.io/dcu-devices-to-allocate` / `-allocated` (HAMi's device list).
- HAMi's node lock (`hami.io/mutex.lock` in v2.7-v2.10, shared with its NVIDIA lock) is not
  used: Tessera has no node-wide lock.
- What a vDCU container gets (the device plugin's Allocate): `/dev/kfd`, `/dev/mkfd`,
  `/dev/dri/card<N>`, `/dev/dri/renderD<128+N>`, and a `vdev<id>.conf` mounted at
  `/etc/vdev/docker/` that the DCU driver in the container (`source /opt/hygondriver/env.sh`)
  enforces: `PciBusId`, two `cu_mask` lines, `cu_count`, `mem: <MiB> MiB`, `device_id`,
  `vdev_id`, `pipe_id`, `enable: 1`; the driver at `/opt/hygondriver`, `/opt/hyhal`.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMON_WORD = "DCU"
TYPE_PREFIX = "DCU-"
DEFAULT_COUNT = "hygon.com/dcunum"
DEFAULT_MEMORY = "hygon.com/dcumem"
DEFAULT_CORES = "hygon.com/dcucores"

USE_TYPE = "hygon.com/use-dcutype"
NOUSE_TYPE = "hygon.com/nouse-dcutype"
USE_UUID = "hygon.com/use-gpuuuid"
NOUSE_UUID = "hygon.com/nouse-gpuuuid"
NODE_REGISTER = "hami.io/node-dcu-register"
NODE_HANDSHAKE = "hami.io/node-handshake-dcu"
TO_ALLOCATE = "hami.io/dcu-devices-to-allocate"
ALLOCATED = "hami.io/dcu-devices-allocated"
NODE_LOCK = "hami.io/mutex.lock"

USER_KEYS = (USE_TYPE, NOUSE_TYPE, USE_UUID, NOUSE_UUID)
SCHEDULER_OWNED = (TO_ALLOCATE, ALLOCATED)
VDEV_CONTAINER_DIR = "/etc/vdev/docker/"
DRIVER_CONTAINER_DIR = "/opt/hygondriver"
HYHAL_DIR = "/opt/hyhal"
RENDER_MINOR_BASE = 128


@dataclass(frozen=True)
class RegisteredDcu:
    uuid: str
    count: int
    memory_mib: int
    cores: int
    type: str
    numa: int
    healthy: bool
    index: int | None = None
    mode: str = ""


def encode_register(dcus: list[RegisteredDcu]) -> str:
    """HAMi's legacy node-device encoding, one `…:` item per DCU (its seven fields, then the
    index and mode as the longer form carries them)."""
    return "".join(f"{d.uuid},{d.count},{d.memory_mib},{d.cores},{d.type},{d.numa},"
                   f"{'true' if d.healthy else 'false'}"
                   + (f",{d.index},{d.mode}" if d.index is not None else "") + ":"
                   for d in dcus)


def decode_register(text: str) -> list[RegisteredDcu]:
    out = []
    for item in (p for p in text.split(":") if p):
        fields = item.split(",")
        if len(fields) < 7:
            raise ValueError(f"{NODE_REGISTER}: item needs 7 fields: {item[:80]!r}")
        try:
            out.append(RegisteredDcu(
                fields[0], int(fields[1]), int(fields[2]), int(fields[3]), fields[4],
                int(fields[5]), fields[6].lower() == "true",
                int(fields[7]) if len(fields) > 7 and fields[7] else None,
                fields[8] if len(fields) > 8 else ""))
        except ValueError as exc:
            raise ValueError(f"{NODE_REGISTER}: bad number in {item[:80]!r}") from exc
    return out


def cu_count_for(cores_percent: int, compute_units: int) -> int:
    """HAMi's plugin: the CUs a vDCU gets = cores % × the DCU's CUs / 100 (rounded down, at
    least 1 when any compute was asked)."""
    if cores_percent <= 0:
        return 0
    return max(1, cores_percent * compute_units // 100)


def allocate_cu_mask(free_mask: int, compute_units: int, wanted: int) -> int | None:
    """The lowest `wanted` free CUs as a bit mask (bit i = CU i); None when too few are free."""
    chosen, taken = 0, 0
    for cu in range(compute_units):
        if taken == wanted:
            break
        if free_mask >> cu & 1:
            chosen |= 1 << cu
            taken += 1
    return chosen if taken == wanted else None


@dataclass(frozen=True)
class VdevConfig:
    """One vDCU's `vdev<id>.conf`, as HAMi's DCU plugin writes it for the DCU driver."""

    pci_bus_id: str
    cu_mask: int
    cu_count: int
    memory_mib: int
    device_id: int
    vdev_id: int
    pipe_id: int

    def render(self) -> str:
        low, high = self.cu_mask & 0xFFFFFFFF, self.cu_mask >> 32
        return (f"PciBusId: {self.pci_bus_id}\n"
                f"cu_mask: 0x{low:x}\n"
                f"cu_mask: 0x{high:x}\n"
                f"cu_count: {self.cu_count}\n"
                f"mem: {self.memory_mib} MiB\n"
                f"device_id: {self.device_id}\n"
                f"vdev_id: {self.vdev_id}\n"
                f"pipe_id: {self.pipe_id}\n"
                "enable: 1\n")

    @classmethod
    def parse(cls, text: str) -> VdevConfig:
        values: dict[str, list[str]] = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                values.setdefault(key.strip(), []).append(value.strip())
        try:
            masks = [int(m, 16) for m in values["cu_mask"]]
            return cls(values["PciBusId"][0], masks[0] | (masks[1] << 32 if len(masks) > 1
                                                          else 0),
                       int(values["cu_count"][0]), int(values["mem"][0].split()[0]),
                       int(values["device_id"][0]), int(values["vdev_id"][0]),
                       int(values["pipe_id"][0]))
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"vdev config: {exc}") from exc
