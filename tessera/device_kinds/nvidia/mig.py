"""NVIDIA MIG (HAMi's `mig` mode). A card registered in mode `mig` either serves dynamic MIG
(`DeviceInfo.mig` set: the request becomes the smallest covering instance profile placed beside
the card's instances, `mig_fit.py`; while it holds no instance it also takes libvgpu slices,
never both at once), or holds static instances kubelet allocates as `nvidia.com/mig-<profile>`
(no slices at all)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from tessera import mig as mig_tables

from ..base import (
    NO_SELECTION,
    ContainerEdits,
    DeviceKind,
    DeviceView,
    GrantContext,
    Selection,
    Take,
    capacity_reason,
)
from .family import NVIDIA
from .mig_fit import CARD_MIG_INFEASIBLE, MigFit, MigRefusal, fit
from .slices import slice_env

if TYPE_CHECKING:
    from tessera.hami import ContainerRequest
    from tessera.models import DeviceGrant, DeviceInfo

MODE = "mig"


class MigDeviceView(DeviceView, Protocol):
    """A dynamic-MIG card as the scheduler sees it (services/scheduler/cards.py `Card`)."""

    mig_model: str  # '' = static MIG (no dynamic instances)
    mig_geometries: tuple[Mapping[str, int], ...]
    mig_instances: list[mig_tables.Instance]
    libvgpu_slices: int


def instance_fit(device: MigDeviceView, request: ContainerRequest) -> MigFit | MigRefusal:
    """The instance this request becomes on a dynamic-MIG card."""
    return fit(device.mig_model, device.mig_instances, request.memory_on(device.memory_mib),
               request.cores, libvgpu_slices=device.libvgpu_slices,
               geometries=device.mig_geometries)  # fmt: skip


def wants_instance(device: MigDeviceView, modes: str | None) -> bool:
    """Whether the request becomes a MIG instance on this card: a dynamic-MIG card, and the pod
    asks `mig` or no mode at all (a pod asking `hami-core` gets a libvgpu slice)."""
    return bool(device.mig_model) and (not modes or MODE in modes)


def instance_charge(
    grant: DeviceGrant, device: DeviceInfo | None
) -> tuple[mig_tables.MigProfile, int, int]:
    """(profile, MiB, cores) an instance of the profile a dynamic-MIG grant names holds on its
    card, whatever the grant's own figures say: what the card really holds for it. The card's
    model is its registration's (`DeviceInfo.mig`); while the node has not registered, the
    grant's device type's. MigError when the card serves no dynamic MIG or its model has no
    such profile."""
    assert grant.mig is not None
    if device is not None:
        model = mig_tables.MODELS.get(device.mig.model) if device.mig is not None else None
    else:
        model = mig_tables.model_for(grant.type)
    if model is None:
        raise mig_tables.MigError(f"{grant.uuid} does not serve dynamic MIG")
    profile = model.profile(grant.mig.profile)
    return profile, model.profile_memory_mib(profile), model.profile_cores(profile)


def visible_devices(grants: Sequence[DeviceGrant]) -> list[str]:
    """What NVIDIA_VISIBLE_DEVICES lists: a MIG instance's UUID, else the GPU's."""
    return [g.mig.mig_uuid if g.mig is not None and g.mig.mig_uuid else g.uuid for g in grants]


class NvidiaMig(DeviceKind):
    name = "nvidia.mig"
    family = NVIDIA
    modes = (MODE,)
    explains = True

    def served_modes(self, device: DeviceView) -> tuple[str, ...]:
        """A dynamic-MIG card serves MIG instances and, while it holds none, libvgpu slices."""
        return (MODE, "hami-core") if getattr(device, "mig_model", "") else (MODE,)

    def mig_refusal(
        self, device: MigDeviceView, request: ContainerRequest, modes: str | None
    ) -> tuple[str, str] | None:
        """(reason, sentence) when the card cannot serve the request in the mode asked."""
        if wants_instance(device, modes):
            placed = instance_fit(device, request)
            return (placed.reason, placed.detail) if isinstance(placed, MigRefusal) else None
        if device.mig_model and device.mig_instances:
            return CARD_MIG_INFEASIBLE, (
                f"the card holds {len(device.mig_instances)} MIG instance(s); it takes libvgpu "
                "slices only when it is empty (modes are never mixed on one card)")
        if not device.mig_model:
            return CARD_MIG_INFEASIBLE, ""  # static instances: kubelet's (nvidia.com/mig-*)
        return None

    def capacity_refusal(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str | None:
        """HAMi's checks 11-14 on the request's amounts, then 15: the instance (or, on an empty
        dynamic card asked for `hami-core`, the slice)."""
        refused = capacity_reason(device, request.memory_on(device.memory_mib), request.cores)
        if refused is not None:
            return refused
        mig_refused = self.mig_refusal(device, request, selection.modes)  # type: ignore[arg-type]
        return mig_refused[0] if mig_refused is not None else None

    def explain(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str:
        if capacity_reason(device, request.memory_on(device.memory_mib), request.cores):
            return ""  # refused before the instance was looked at
        refused = self.mig_refusal(device, request, selection.modes)  # type: ignore[arg-type]
        return refused[1] if refused is not None else ""

    def take(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> Take:
        """The profile's amounts when the request becomes an instance (checks 11-14 run on the
        request's own amounts, as HAMi's do; the charge is the profile's)."""
        placed = self._placed(device, request, selection)
        if placed is not None:
            return Take(placed.memory_mib, placed.cores, placed.profile)
        return Take(request.memory_on(device.memory_mib), request.cores)

    def _placed(
        self, device: DeviceView, request: ContainerRequest, selection: Selection
    ) -> MigFit | None:
        if wants_instance(device, selection.modes):  # type: ignore[arg-type]
            placed = instance_fit(device, request)  # type: ignore[arg-type]
            if isinstance(placed, MigFit):
                return placed
        return None

    def grant(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> DeviceGrant:
        from tessera.models import DeviceGrant, MigInstanceGrant

        placed = self._placed(device, request, selection)
        if placed is None:
            return DeviceGrant(uuid=device.uuid, type=device.type,
                               memory_mib=request.memory_on(device.memory_mib),
                               cores=request.cores)  # fmt: skip
        model = mig_tables.model_for(device.mig_model)  # type: ignore[attr-defined]
        size = model.profile(placed.profile).memory_slices  # type: ignore[union-attr]
        return DeviceGrant(uuid=device.uuid, type=device.type, memory_mib=placed.memory_mib,
                           cores=placed.cores,
                           mig=MigInstanceGrant(profile=placed.profile, start=placed.start,
                                                size=size))  # fmt: skip

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        """A MIG instance reaches the container as its MIG UUID (as NVIDIA's device plugin hands
        MIG devices over); a container of MIG instances only gets no libvgpu (the hardware
        isolates it); one mixing slices gets the slice env with the instances visible."""
        if not any(g.mig is not None for g in grants):
            return ContainerEdits(env=slice_env(grants, ctx))
        visible = ",".join(visible_devices(grants))
        if all(g.mig is not None for g in grants):
            return ContainerEdits(env={"NVIDIA_VISIBLE_DEVICES": visible,
                                       "CUDA_VISIBLE_DEVICES": visible,
                                       "CUDA_TASK_PRIORITY": str(ctx.priority)})  # fmt: skip
        return ContainerEdits(env={**slice_env(grants, ctx), "NVIDIA_VISIBLE_DEVICES": visible})


MIG = NvidiaMig()
