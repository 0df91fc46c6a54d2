"""NVIDIA's part of the handshake on the node: the env the kinds give (tessera.device_kinds
.nvidia: libvgpu slices, MIG instances, MPS), libvgpu's mounts for a container that holds any
slice, the dynamic MIG instances created before the container is answered (mig_service.py),
single-strategy instances answered whole (mig_static.py), and an MPS card's own control daemon
limited before the container can run (mps.py)."""

from __future__ import annotations

from pathlib import Path

from tessera.node_agent import handshake as hs
from tessera.node_agent.containers import ContainerDir

from tessera.device_kinds.nvidia import NVIDIA
from tessera.device_kinds.nvidia.mps import PIPE_CONTAINER_DIR
from tessera.kubeapi import dp
from tessera.models import Allocation
from tessera.region import ContainerLimits

from . import mig_static, mps
from .kind_answers import grant_context
from .mig_service import DynamicMig, MigCreateFailed
from .mps import MpsDaemons
from .plugin_context import PluginContext


class NvidiaAnswers:
    def __init__(self, ctx: PluginContext, mps_daemons: MpsDaemons | None,
                 mig: DynamicMig | None) -> None:
        self.ctx = ctx
        self.mps = mps_daemons  # MPS cards' control daemons (mps.py); None: no MPS here
        self.mig = mig  # dynamic MIG (mig_service.py); None: the node does not run it

    async def before_answer(self, allocation: Allocation, index: int) -> Allocation:
        """The pod's dynamic MIG instances exist before its container is answered."""
        if not any(g.mig is not None for g in allocation.containers[index]):
            return allocation
        if self.mig is None:
            raise hs.HandshakeError(
                f"{hs.describe(allocation, index)} was granted a MIG instance, but this node "
                "agent does not run dynamic MIG (migstrategy dynamic takes effect at its start)")
        try:
            return await self.mig.allocate(allocation)
        except MigCreateFailed as exc:
            raise hs.HandshakeError(str(exc)) from exc

    async def answer(self, allocation: Allocation, cdir: ContainerDir
                     ) -> dp.ContainerAllocateResponse:
        grants = allocation.containers[cdir.prepared.index]
        single = mig_static.single_instance_env(grants, allocation.priority)
        if single is not None:  # migstrategy single: whole instances, no libvgpu
            return dp.ContainerAllocateResponse(envs=single)
        edits = NVIDIA.container_edits(grants, grant_context(self.ctx, allocation))
        out = dp.ContainerAllocateResponse(envs=edits.env)
        if all(g.mig is not None for g in grants):
            return out  # MIG instances only: the hardware isolates them, no libvgpu
        settings = self.ctx.settings
        mounts = hs.container_mounts(
            cdir, settings, settings.preload_host_path or str(self.ctx.store.preload_file))
        cards = self._mps_cards(allocation, cdir.prepared.index)
        if cards:  # the container's own daemon, limited before it can run
            pipe = await self._mps_enforce(cdir, allocation, cards)
            mounts = [*mounts, (PIPE_CONTAINER_DIR, str(pipe), False)]
        for container_path, host_path, read_only in mounts:
            out.mounts.append(dp.Mount(
                container_path=container_path, host_path=host_path, read_only=read_only
            ))
        return out

    async def limits(self, cdir: ContainerDir, allocation: Allocation, limits: ContainerLimits
                     ) -> ContainerLimits:
        """PreStartContainer: the proven owner's limits on the container's own MPS daemon."""
        cards = self._mps_cards(allocation, cdir.prepared.index)
        if not cards:
            return limits
        await self._mps_enforce(cdir, allocation, cards)
        return mps.accounting_only(limits, cards)

    def _mps_cards(self, allocation: Allocation, index: int) -> set[str]:
        if self.mps is None:
            return set()
        held = {g.uuid for g in allocation.containers[index]}
        return mps.mps_uuids(self.ctx.state.devices()) & held

    async def _mps_enforce(self, cdir: ContainerDir, allocation: Allocation, cards: set[str]
                           ) -> Path:
        assert self.mps is not None
        pipes = []
        for uuid in sorted(cards):
            try:
                pipes.append(await self.mps.limit_now(cdir, allocation, uuid))
            except mps.MpsError as exc:
                raise hs.HandshakeError(f"MPS limits not set on {uuid}: {exc}") from exc
        return pipes[0]
