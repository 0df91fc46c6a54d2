"""The node agent's side of the `dcu` family: DCUs found through hy-smi (simulated here: the
hardware cannot run on this machine), health, usage, and the vDCU config files.

The node agent plays HAMi's DCU device plugin: for a vDCU it takes the grant's share of the
DCU's compute units (the lowest free CUs, never one another vDCU holds), records the vDCU with
the driver's table, writes its `vdev<id>.conf` in a directory of the owner's
(`<pod uid>/<container>`) under the region host dir and mounts it at `/etc/vdev/docker/`, with
the driver at `/opt/hygondriver` and `/opt/hyhal`. `release(owner)` / `reconcile(live owners)`
remove vDCUs whose pods are gone (HAMi's plugin: RefreshContainerDevices).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..base import ContainerEdits, Mount
from ..fake_backend import HealthPoller
from ..node import HealthChange, NodeFamily, PhysicalDevice, held_by, holder_name, owner_gone
from . import annotations as ann
from .family import DCU
from .hysmi_fake import HYSMI_OK, SimulatedHySmi
from .vdcu import MODE, is_vdcu

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings

# compute units of the DCU models the simulation knows (others: 60)
COMPUTE_UNITS = {"Z100": 60, "Z100L": 60, "K100": 120, "K100_AI": 120}
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class HySmiBackend:
    """DeviceBackend over the (simulated) hy-smi."""

    def __init__(self, smi: SimulatedHySmi) -> None:
        self.smi = smi
        self._health = HealthPoller(self._changes)

    def discover(self) -> list[PhysicalDevice]:
        return [PhysicalDevice(uuid=d.uuid, index=d.index, model=d.type, memory_mib=d.memory_mib,
                               cores=100, healthy=self.smi.healthy(d.index),
                               attributes={"pci": d.pci_bus_id, "cus": str(d.compute_units)})
                for d in self.smi.devices()]

    def wait_health(self, timeout_s: float) -> HealthChange | None:
        return self._health.wait(timeout_s)

    def _changes(self) -> list[HealthChange]:
        return [HealthChange(self.smi.devices()[index].uuid, healthy,
                             f"DCU {index} {'is back' if healthy else 'fell off the bus'}")
                for index, healthy in self.smi.poll_faults()]  # fmt: skip

    def usage(self) -> dict[str, tuple[int, int, float]]:
        out = {}
        for d in self.smi.devices():
            total, used = self.smi.vram(d.index)
            out[d.uuid] = (used << 20, total << 20, float(self.smi.use(d.index)))
        return out

    def close(self) -> None:
        return None


class HygonNode(NodeFamily):
    family = DCU

    def __init__(self) -> None:
        self._backend: HySmiBackend | None = None
        self._vdev_root = Path(".")
        self._driver_dir = "/opt/hygondriver"

    def backend(self, settings: TesseraSettings, node: str) -> HySmiBackend:
        if settings.device_source != "static":
            raise RuntimeError(
                "Hygon DCUs are read through hy-smi/DCGM on a DCU node, which this build does not "
                "link; run the node agent with TESSERA_DEVICE_SOURCE=static for the simulated DCUs")
        state_dir = settings.region_host_dir or "."
        model = settings.static_gpu_model.removeprefix(ann.TYPE_PREFIX)
        self._vdev_root = Path(state_dir) / "dcu-vdev"
        self._backend = HySmiBackend(SimulatedHySmi(
            node, model, settings.static_gpu_count, settings.static_gpu_memory_mib,
            compute_units=COMPUTE_UNITS.get(model, 60),
            state_path=os.path.join(state_dir, "hysmi.json"),
            fault_path=settings.static_fault_file or ""))
        return self._backend

    def default_mode(self, device: PhysicalDevice) -> str:
        return MODE

    def _smi(self) -> SimulatedHySmi:
        if self._backend is None:
            raise RuntimeError("the DCU backend is not open")
        return self._backend.smi

    def _owner_dir(self, owner: str) -> Path:
        return self._vdev_root / _UNSAFE.sub("_", owner.replace("/", "__"))

    def node_edits(
        self, grants: Sequence[DeviceGrant], devices: Mapping[str, DeviceInfo], owner: str = "",
    ) -> ContainerEdits:
        """A vDCU's config file (once per owner and DCU), mounted with the driver."""
        smi = self._smi()
        edits = ContainerEdits()
        for g in grants:
            device = devices[g.uuid]
            if not is_vdcu(g, device):
                continue
            holder = holder_name(owner, g.uuid)
            existing = [vid for vid, h in smi.holders().items() if h == holder]
            conf = next((v for v in smi.vdevs() if v.vdev_id in existing), None)
            if conf is None:
                cus = ann.cu_count_for(g.cores, smi.compute_units)
                mask = ann.allocate_cu_mask(smi.free_cu_mask(device.index), smi.compute_units,
                                            cus) if cus else 0
                if mask is None:
                    raise RuntimeError(f"DCU {device.index}: {cus} compute units asked, fewer "
                                       "are free")
                ret, conf = smi.create_vdev(device.index, mask, g.memory_mib, holder)
                if ret != HYSMI_OK or conf is None:
                    raise RuntimeError(f"hy-smi refused a vDCU of {g.memory_mib} MiB on DCU "
                                       f"{device.index}: {ret}")
            directory = self._owner_dir(owner)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"vdev{conf.vdev_id}.conf").write_text(conf.render())
            edits.mounts.append(Mount(ann.VDEV_CONTAINER_DIR, str(directory), read_only=True))
            edits.mounts.append(Mount(ann.DRIVER_CONTAINER_DIR, self._driver_dir))
            edits.mounts.append(Mount(ann.HYHAL_DIR, ann.HYHAL_DIR))
        return edits

    def release(self, owner: str) -> None:
        smi = self._smi()
        for vid, holder in smi.holders().items():
            if held_by(holder, owner):
                smi.destroy_vdev(vid)
                shutil.rmtree(self._owner_dir(holder.partition("@")[0]), ignore_errors=True)

    def reconcile(self, live_owners: Iterable[str]) -> None:
        live = set(live_owners)
        smi = self._smi()
        for vid, holder in smi.holders().items():
            if owner_gone(holder, live):
                smi.destroy_vdev(vid)
                shutil.rmtree(self._owner_dir(holder.partition("@")[0]), ignore_errors=True)


NODE = HygonNode()


def _register() -> None:
    from ..registry import register_node

    register_node(NODE)


_register()
