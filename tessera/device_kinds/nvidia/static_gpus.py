"""Simulated NVIDIA GPUs (the local stack's, and tests'): count, model and memory from the
settings, UUIDs stable per node and index, spread over `static_numa_nodes` NUMA nodes with
HAMi's PCIe link scores, in MIG mode when the node simulates MIG instances. Faults are appended
to `static_fault_file` as `<GPU index> <XID>` lines, read as NVML's XID events would be."""

from __future__ import annotations

import math
import time
import uuid as uuidlib

from tessera.settings import TesseraSettings

from ..node import HealthChange, PhysicalDevice
from .topology import TOPOLOGY_NODE, TOPOLOGY_SYSTEM, describe_fault, link_score


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{node}/gpu{index}')}"


class SimulatedGpus:
    """DeviceBackend of simulated GPUs (nothing to open or close)."""

    def __init__(self, settings: TesseraSettings, node: str) -> None:
        self.settings = settings
        self.node = node
        self._fault_offset = 0

    def discover(self) -> list[PhysicalDevice]:
        s = self.settings
        count = s.static_gpu_count
        per_numa = max(1, math.ceil(count / s.static_numa_nodes))
        uuids = [gpu_uuid(self.node, i) for i in range(count)]
        in_mig = bool(s.static_mig_instances.strip()) or s.mig_strategy == "dynamic"
        devices = []
        for i, u in enumerate(uuids):
            numa = i // per_numa
            links = {peer: link_score(TOPOLOGY_NODE if j // per_numa == numa else TOPOLOGY_SYSTEM,
                                      0)
                     for j, peer in enumerate(uuids) if j != i}  # fmt: skip
            devices.append(PhysicalDevice(
                uuid=u, index=i, model=s.static_gpu_model, memory_mib=s.static_gpu_memory_mib,
                numa=numa, links=links, attributes={"mig": "true"} if in_mig else {}))
        return devices

    def wait_health(self, timeout_s: float) -> HealthChange | None:
        """The next fault of `static_fault_file` (ignored XIDs skipped), else None."""
        deadline = time.monotonic() + timeout_s
        while True:
            change = self._next_fault()
            if change is not None or time.monotonic() >= deadline:
                return change
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _next_fault(self) -> HealthChange | None:
        path = self.settings.static_fault_file
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                f.seek(self._fault_offset)
                line = f.readline()
        except FileNotFoundError:
            return None
        if not line.endswith(b"\n"):
            return None  # nothing new, or a line still being written
        self._fault_offset += len(line)
        fields = line.split()
        try:
            index, xid = int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            return None
        if xid in self.settings.ignored_xid_set():
            return None
        count = self.settings.static_gpu_count
        uuid = gpu_uuid(self.node, index) if 0 <= index < count else None
        return HealthChange(uuid, False, describe_fault(uuid, "xid", xid), "xid", xid)

    def usage(self) -> dict[str, tuple[int, int, float]]:
        return {}

    def close(self) -> None:
        return None
