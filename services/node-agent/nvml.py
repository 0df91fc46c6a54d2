"""NVIDIA's MIG through NVML, over the family's NVML backend
(tessera.device_kinds.nvidia.nvml_backend: discovery, links, MIG mode, XID/ECC events, host
usage): the instances NVML lists, and dynamic MIG. `NvmlSource` is NVIDIA's source on NVML.

Every call here blocks in the driver: the agent runs them in a thread.
"""

from __future__ import annotations

from tessera.node_agent.nvidia_source import NvidiaSource

from tessera.device_kinds.nvidia.nvml_backend import NvmlBackend, normalise_bus_id
from tessera.settings import TesseraSettings

__all__ = ["NvmlSource", "normalise_bus_id", "nvml_mig_backend", "nvml_offers"]


class NvmlSource(NvidiaSource):
    def __init__(self, settings: TesseraSettings) -> None:
        super().__init__(NvmlBackend(settings), settings, node="")


def nvml_offers(nvml: NvmlBackend) -> list:
    """The MIG instances that exist on the GPUs (nvml_mig.py), as static offers."""
    from tessera.node_agent import nvml_mig
    from tessera.node_agent.mig_static import MigOffer

    out = []
    with nvml.lock:
        for index, (u, h) in enumerate(nvml.handles.items()):
            for d in nvml_mig.list_devices(h, nvml.index_of(h, index)):
                out.append(MigOffer(uuid=d.uuid, parent_uuid=u, parent_index=d.parent_index,
                                    profile=d.profile, start=d.start, gi_id=d.gi_id,
                                    numa=nvml.numa_of(h)))
    return out


def nvml_mig_backend(nvml: NvmlBackend) -> object:
    """Dynamic MIG through NVML (nvml_mig.py) on the GPUs in MIG mode, under the backend's NVML
    lock (mig_dynamic.MigReconciler's three calls and `handles`)."""
    from tessera.node_agent import nvml_mig

    with nvml.lock:
        handles = {u: (h, nvml.index_of(h, i)) for i, (u, h) in enumerate(nvml.handles.items())
                   if nvml.in_mig_mode(h) and nvml_mig.model_of(h) is not None}  # fmt: skip
    return nvml_mig.LockedNvmlMig(handles, nvml.lock)
