"""The `nvidia` family: HAMi's NVIDIA resources, annotations and request reading."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tessera import hami

from ..base import AdmissionNotes, ContainerEdits, DeviceFamily, GrantContext, ResourceNames

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tessera.hami import ContainerRequest
    from tessera.models import DeviceGrant
    from tessera.settings import TesseraSettings

FAMILY = "nvidia"


class NvidiaFamily(DeviceFamily):
    """NVIDIA GPUs: `nvidia.com/gpu`, `…/gpumem`, `…/gpumem-percentage`, `…/gpucores`,
    `…/priority` (each configurable: TESSERA_RESOURCE_NAME, _MEM, _MEM_PERCENTAGE, _CORES,
    _PRIORITY, as HAMi's chart values)."""

    name = FAMILY
    vendor = "NVIDIA"
    register_annotation = hami.ANN_NODE_REGISTER
    to_allocate_annotation = hami.ANN_DEVICES_TO_ALLOCATE
    allocated_annotation = hami.ANN_DEVICES_ALLOCATED
    use_type_annotation = hami.ANN_USE_GPUTYPE
    nouse_type_annotation = hami.ANN_NOUSE_GPUTYPE
    use_uuid_annotation = hami.ANN_USE_GPUUUID
    nouse_uuid_annotation = hami.ANN_NOUSE_GPUUUID
    mode_annotation = hami.ANN_VGPU_MODE
    type_prefixes = ("NVIDIA",)
    counts_in_quota = True

    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        return ResourceNames(
            count=settings.resource_name, memory=settings.resource_mem,
            memory_percentage=settings.resource_mem_percentage, cores=settings.resource_cores,
            priority=settings.resource_priority,
        )  # fmt: skip

    def resource_names(self, settings: TesseraSettings) -> ResourceNames:
        """NVIDIA's names are the five TESSERA_RESOURCE_* settings (one home for them)."""
        return self.default_names(settings)

    def read_request(
        self, container: Mapping[str, Any], settings: TesseraSettings
    ) -> ContainerRequest | None:
        return hami.parse_container_request(container, settings)  # type: ignore[arg-type]

    @property
    def reader(self) -> Any:
        return hami.parse_container_request

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        """One container may hold slices, MPS cards and MIG instances together: the slice env
        (MIG's when it holds an instance: the instances visible by their MIG UUIDs, and no
        libvgpu env when it holds instances only), with MPS's on top for its MPS cards."""
        from .mig import MIG
        from .mps import MODE as MPS_MODE
        from .mps import mps_env
        from .slices import SLICES

        if any(g.mig is not None for g in grants):
            edits = MIG.container_edits(grants, ctx)
            if all(g.mig is not None for g in grants):
                return edits
        else:
            edits = SLICES.container_edits(grants, ctx)
        cards = {g.uuid for g in grants
                 if (d := ctx.devices.get(g.uuid)) is not None and d.mode.lower() == MPS_MODE}
        edits.env.update(mps_env(grants, cards))
        return edits

    def admit_container(
        self, container: dict[str, Any], label: str, settings: TesseraSettings,
        notes: AdmissionNotes,
    ) -> ContainerRequest | None:
        """HAMi's webhook rules for the container (admission.py); also run on containers that
        name no family's resources (NVIDIA_VISIBLE_DEVICES=none hides the node's GPUs)."""
        from .admission import admit_container

        return admit_container(container, label, settings, notes.changes, notes.warnings)


NVIDIA = NvidiaFamily()
