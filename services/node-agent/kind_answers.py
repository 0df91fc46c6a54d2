"""What a container gets from Allocate and PreStartContainer, asked of its device family: the
plugin's gRPC layer attributes the container (attribution.py) and hands its grants here. The
family of a container is its devices' (tessera.device_kinds: the kind serving each device's
mode). NVIDIA's answer lives in nvidia_answers.py (libvgpu, MIG instances, MPS daemons); every
other family gets `FamilyAnswers`: its kinds' edits (tessera.device_kinds) with what the node
adds (`NodeFamily.node_edits`), for the vendor's runtime to enforce."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from tessera.node_agent.containers import ContainerDir

from tessera.device_kinds import ContainerEdits, GrantContext, registry
from tessera.kubeapi import dp
from tessera.models import Allocation, DeviceGrant
from tessera.region import ContainerLimits

from .plugin_context import PluginContext


class ContainerAnswers(Protocol):
    """A family's part of the handshake, once the container is attributed and prepared."""

    async def before_answer(self, allocation: Allocation, index: int) -> Allocation:
        """What must exist before the container is answered (MIG: its instances); the pod's
        allocation afterwards."""
        ...

    async def answer(self, allocation: Allocation, cdir: ContainerDir
                     ) -> dp.ContainerAllocateResponse: ...

    async def limits(self, cdir: ContainerDir, allocation: Allocation, limits: ContainerLimits
                     ) -> ContainerLimits:
        """PreStartContainer: the limits to seal, after what the family enforces itself."""
        ...


def response_of(edits: ContainerEdits) -> dp.ContainerAllocateResponse:
    out = dp.ContainerAllocateResponse(envs=edits.env, annotations=edits.annotations)
    for m in edits.mounts:
        out.mounts.append(dp.Mount(container_path=m.container_path, host_path=m.host_path,
                                   read_only=m.read_only))  # fmt: skip
    for d in edits.devices:
        out.devices.append(dp.DeviceSpec(container_path=d.container_path, host_path=d.host_path,
                                         permissions=d.permissions))  # fmt: skip
    return out


def grant_context(ctx: PluginContext, allocation: Allocation) -> GrantContext:
    return GrantContext(ctx.state.by_uuid(), ctx.node_settings(), allocation.priority,
                        allocation.core_policy)  # fmt: skip


class FamilyAnswers:
    """Any family without a node-agent answer of its own: the kinds' edits and the node's."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx

    async def before_answer(self, allocation: Allocation, index: int) -> Allocation:
        return allocation

    async def answer(self, allocation: Allocation, cdir: ContainerDir
                     ) -> dp.ContainerAllocateResponse:
        grants = allocation.containers[cdir.prepared.index]
        ctx = grant_context(self.ctx, allocation)
        family = family_of(grants, self.ctx)
        edits = family.container_edits(grants, ctx)
        node_family = registry.node_family(family.name)
        if node_family is not None:
            owner = f"{allocation.pod_uid}/{cdir.prepared.container}"
            edits = edits.merge(await asyncio.to_thread(
                node_family.node_edits, grants, ctx.devices, owner))
        return response_of(edits)

    async def limits(self, cdir: ContainerDir, allocation: Allocation, limits: ContainerLimits
                     ) -> ContainerLimits:
        return limits


def family_of(grants: Sequence[DeviceGrant], ctx: PluginContext):
    """The family of the container's devices (its first registered device's; the default
    family when none is known)."""
    devices = ctx.state.by_uuid()
    for g in grants:
        device = devices.get(g.uuid)
        kind = registry.kind_of(device) if device is not None else None
        if kind is not None:
            return kind.family
    return registry.family(registry.DEFAULT_FAMILY)


class AnswersByFamily:
    """The answers of each family present on the node (`FamilyAnswers` for those with none of
    their own)."""

    def __init__(self, ctx: PluginContext, own: dict[str, ContainerAnswers]) -> None:
        self.ctx = ctx
        self.own = own
        self.generic = FamilyAnswers(ctx)

    def of(self, grants: Sequence[DeviceGrant]) -> ContainerAnswers:
        return self.own.get(family_of(grants, self.ctx).name, self.generic)
