"""The node agent's side of the `mlu` family: MLUs found through CNDev (simulated here: the
hardware cannot run on this machine), health, usage, and the sMLU instances.

The node agent plays Cambricon's device plugin in dynamic-smlu mode: at Allocate it creates the
container's sMLU (a CNDev profile of the grant's % compute and 256 MiB memory units, then an
instance of it; the driver enforces both) and hands the container its device node. Instances
are held in the owner's name (`<pod uid>/<container>`); `release(owner)` destroys them when the
pod's allocation ends and `reconcile(live owners)` destroys any an owner no longer holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..base import ContainerEdits, DeviceNode
from ..fake_backend import HealthPoller
from ..node import HealthChange, NodeFamily, PhysicalDevice, held_by, holder_name, owner_gone
from . import annotations as ann
from .cndev_fake import CNDEV_SUCCESS, HEALTHY, SimulatedCndev, smlu_device_node
from .family import MLU
from .smlu import MODE, is_share, profile_of

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings


class CndevBackend:
    """DeviceBackend over (simulated) CNDev."""

    def __init__(self, cndev: SimulatedCndev) -> None:
        self.cndev = cndev
        self._health = HealthPoller(self._changes)

    def discover(self) -> list[PhysicalDevice]:
        c = self.cndev
        return [PhysicalDevice(uuid=c.get_uuid(s), index=s, model=c.get_card_name(s),
                               memory_mib=c.get_memory_usage(s)[0], cores=100,
                               healthy=c.get_health(s) == HEALTHY)
                for s in range(c.get_device_count())]

    def wait_health(self, timeout_s: float) -> HealthChange | None:
        return self._health.wait(timeout_s)

    def _changes(self) -> list[HealthChange]:
        return [HealthChange(self.cndev.get_uuid(slot), state == HEALTHY,
                             f"CNDev health state {state} on MLU {slot}")
                for slot, state in self.cndev.poll_faults()]  # fmt: skip

    def usage(self) -> dict[str, tuple[int, int, float]]:
        c = self.cndev
        out = {}
        for s in range(c.get_device_count()):
            total, used = c.get_memory_usage(s)
            out[c.get_uuid(s)] = (used << 20, total << 20, float(c.get_utilization(s)))
        return out

    def close(self) -> None:
        return None


class CambriconNode(NodeFamily):
    family = MLU

    def __init__(self) -> None:
        self._backend: CndevBackend | None = None

    def backend(self, settings: TesseraSettings, node: str) -> CndevBackend:
        if settings.device_source != "static":
            raise RuntimeError(
                "Cambricon MLUs are read through CNDev (libcndev.so on an MLU node), which this "
                "build does not link; run the node agent with TESSERA_DEVICE_SOURCE=static for "
                "the simulated MLUs")
        state_dir = settings.region_host_dir or "."
        self._backend = CndevBackend(SimulatedCndev(
            node, settings.static_gpu_model, settings.static_gpu_count,
            settings.static_gpu_memory_mib, state_path=os.path.join(state_dir, "cndev.json"),
            fault_path=settings.static_fault_file or ""))
        return self._backend

    def default_mode(self, device: PhysicalDevice) -> str:
        return MODE

    def _cndev(self) -> SimulatedCndev:
        if self._backend is None:
            raise RuntimeError("the MLU backend is not open")
        return self._backend.cndev

    def node_edits(
        self, grants: Sequence[DeviceGrant], devices: Mapping[str, DeviceInfo], owner: str = "",
    ) -> ContainerEdits:
        """Creates the container's sMLU (once per owner and MLU) and hands its device node."""
        cndev = self._cndev()
        edits = ContainerEdits()
        for g in grants:
            device = devices[g.uuid]
            if not is_share(g, device):
                continue
            holder = holder_name(owner, g.uuid)
            held = [i for i in cndev.smlu_infos(device.index) if i.holder == holder]
            if held:
                instance = held[0]
                node, handle, profile_id = instance.device_node, instance.handle, instance.profile
                number = instance.instance
            else:
                profile = profile_of(g, device)
                ret, profile_id = cndev.create_smlu_profile(profile.slot, profile.vcore,
                                                            profile.vmemory)
                if ret != CNDEV_SUCCESS:
                    raise RuntimeError(f"CNDev refused the sMLU profile {profile.encode()}: {ret}")
                ret, handle = cndev.create_smlu_instance(profile_id, profile.slot, holder)
                if ret != CNDEV_SUCCESS:
                    raise RuntimeError(f"CNDev refused an sMLU of {profile.encode()} on MLU "
                                       f"{profile.slot}: {ret}")
                number = handle >> 8
                node = smlu_device_node(device.index, number)
            edits.devices.append(DeviceNode(node, node))
            edits.annotations[ann.DSMLU_PROFILE_INSTANCE] = ann.encode_profile_instance(
                profile_id, handle, device.index, number)
        return edits

    def release(self, owner: str) -> None:
        """Destroys the owner's sMLUs (its pod's allocation ended)."""
        cndev = self._cndev()
        for i in cndev.smlu_infos():
            if held_by(i.holder, owner):
                cndev.destroy_smlu(i.handle)

    def reconcile(self, live_owners: Iterable[str]) -> None:
        """Destroys every sMLU whose owner holds no allocation any more (as Cambricon's plugin
        recycles instances of pods that are gone)."""
        live = set(live_owners)
        cndev = self._cndev()
        for i in cndev.smlu_infos():
            if owner_gone(i.holder, live):
                cndev.destroy_smlu(i.handle)


NODE = CambriconNode()


def _register() -> None:
    from ..registry import register_node

    register_node(NODE)


_register()
