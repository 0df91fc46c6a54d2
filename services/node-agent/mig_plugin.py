"""Device plugins for static MIG instances: one gRPC service (and socket) per MIG resource.

kubelet counts these extended resources itself (one device = one instance), so unlike the
libvgpu plugin there is no ledger handshake: the device IDs kubelet hands Allocate *are* the
instances the container gets. Rules in mig_static.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from tessera.node_agent import mig_static
from tessera.node_agent.mig_static import MigOffer
from tessera.node_agent.plugin_endpoint import PluginEndpoint

from tessera.kubeapi import HEALTHY, UNHEALTHY, dp, dp_grpc


class MigInventory:
    """The instances offered per resource; ListAndWatch streams follow changes."""

    def __init__(self) -> None:
        self._offers: dict[str, tuple[MigOffer, ...]] = {}
        self._version = 0
        self._changed = asyncio.Condition()

    def offers(self, resource: str) -> tuple[MigOffer, ...]:
        return self._offers.get(resource, ())

    @property
    def resources(self) -> list[str]:
        return sorted(self._offers)

    async def set(self, plan: dict[str, tuple[MigOffer, ...]]) -> None:
        async with self._changed:
            if plan == self._offers:
                return
            self._offers = dict(plan)
            self._version += 1
            self._changed.notify_all()

    async def wait_change(self, resource: str, seen: int) -> tuple[tuple[MigOffer, ...], int]:
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != seen)
            return self.offers(resource), self._version


class MigPluginService(dp_grpc.DevicePluginServicer):
    """kubelet's peer for one MIG resource (`nvidia.com/mig-1g.10gb`, or the GPU resource under
    the `single` strategy)."""

    def __init__(self, resource: str, inventory: MigInventory, log: logging.Logger) -> None:
        self.resource = resource
        self.inventory = inventory
        self.log = log

    async def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions(pre_start_required=True,
                                      get_preferred_allocation_available=True)

    async def ListAndWatch(self, request, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        version = -1
        while True:
            offers, version = await self.inventory.wait_change(self.resource, version)
            yield dp.ListAndWatchResponse(devices=[
                dp.Device(ID=o.uuid, health=HEALTHY if o.healthy else UNHEALTHY,
                          topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=o.numa)]))
                for o in offers
            ])

    async def GetPreferredAllocation(self, request, context):
        """Instances on the fewest cards: kubelet's must-include first, then the available ones
        in card order (any instance of a profile is as good as another)."""
        out = dp.PreferredAllocationResponse()
        order = {o.uuid: (o.parent_index, o.start) for o in self.inventory.offers(self.resource)}
        for req in request.container_requests:
            chosen = list(req.must_include_deviceIDs)
            rest = sorted((i for i in req.available_deviceIDs if i not in chosen),
                          key=lambda i: order.get(i, (1 << 30, 0)))
            chosen += rest[: max(0, req.allocation_size - len(chosen))]
            out.container_responses.append(dp.ContainerPreferredAllocationResponse(
                deviceIDs=chosen))
        return out

    async def Allocate(self, request, context):
        out = dp.AllocateResponse()
        offers = self.inventory.offers(self.resource)
        for req in request.container_requests:
            try:
                env = mig_static.container_env(offers, list(req.devices_ids))
            except ValueError as exc:
                self.log.warning("MIG allocate refused", extra={"resource": self.resource,
                                                                "err": str(exc)})
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            out.container_responses.append(dp.ContainerAllocateResponse(envs=env))
            self.log.info("MIG instances allocated", extra={
                "resource": self.resource, "devices": list(req.devices_ids)})
        return out

    async def PreStartContainer(self, request, context):
        return dp.PreStartContainerResponse()


class MigPlugins:
    """One plugin endpoint per resource the plan offers; started and stopped as it changes."""

    def __init__(self, plugin_dir: str, log: logging.Logger) -> None:
        self.plugin_dir = plugin_dir
        self.log = log
        self.inventory = MigInventory()
        self.endpoints: dict[str, PluginEndpoint] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.passes = 0  # plans applied (discovery passes)
        self.problem = ""  # why instances are not offered, when they are not

    async def apply(self, plan: mig_static.MigPlan) -> None:
        self.passes += 1
        self.problem = plan.problem
        await self.inventory.set(plan.resources)
        for resource in [r for r in self.endpoints if r not in plan.resources]:
            self._stops[resource].set()
            await asyncio.wait({self._tasks.pop(resource)}, timeout=3.0)
            del self.endpoints[resource], self._stops[resource]
        for resource in plan.resources:
            if resource in self.endpoints:
                continue
            service = MigPluginService(resource, self.inventory, self.log)
            endpoint = PluginEndpoint(self.plugin_dir, resource, service, self.log,
                                      socket_name=mig_static.socket_name(resource))
            stop = asyncio.Event()
            self.endpoints[resource], self._stops[resource] = endpoint, stop
            self._tasks[resource] = asyncio.create_task(endpoint.run(stop))

    async def close(self) -> None:
        for stop in self._stops.values():
            stop.set()
        if self._tasks:
            await asyncio.wait(set(self._tasks.values()), timeout=3.0)
        self._tasks.clear()
        self.endpoints.clear()
        self._stops.clear()


async def run_static_mig(
    *,
    source: object,
    strategy: Callable[[], str],
    health: Callable[[], dict[str, bool]],
    plugins: MigPlugins,
    gpu_resource: str,
    interval_s: float,
    stop: asyncio.Event,
    log: logging.Logger,
    changed: Callable[[], Awaitable[object]] | None = None,
    gpus: Callable[[], list] | None = None,
    single: Callable[[list | None], Awaitable[None]] | None = None,
    served: Callable[[list[MigOffer]], Awaitable[None]] | None = None,
) -> None:
    """Offer the instances NVML (or the static source) reports under the node's current MIG
    strategy, on the GPUs the node offers and as healthy as they are (`health`); re-read every
    `interval_s` and whenever the advertised GPUs change (`changed`), so instances an operator
    makes or removes, a strategy or filter changed through the node config and a card's health
    follow without a restart.

    Under `single` the instances are not served here: they become the node's GPUs (`single`
    hands them to the node configuration, which the GPU plugin and the registration follow), so
    the one plugin of `nvidia.com/gpu` on the node serves them, with the scheduler's placement
    and the handshake's exact identity; `single(None)` gives the GPUs back."""
    discover = getattr(source, "mig_offers", None)
    last_problem = ""
    try:
        while not stop.is_set():
            current = strategy()
            offers = []
            if discover is not None and current in ("single", "mixed"):
                try:
                    offers = await asyncio.to_thread(discover)
                except Exception as exc:  # NVML trouble: keep what is offered, try again
                    log.warning("MIG discovery failed", extra={"err": str(exc)})
                    offers = None
            if offers is not None:
                offers = mig_static.on_offered_gpus(offers, health())
                if current == "single" and single is not None and gpus is not None:
                    devices, problem = mig_static.single_devices(gpus(), offers)
                    await single(devices)
                    plan = mig_static.MigPlan({}, problem)
                else:
                    if single is not None:
                        await single(None)
                    plan = mig_static.plan(current, offers, gpu_resource)
                    if current == "single" and plan.resources:  # nothing to hand them to
                        plan = mig_static.MigPlan({}, "migstrategy single: no GPU plugin here")
                if served is not None:  # what the registration shows (mixed)
                    await served([o for v in plan.resources.values() for o in v])
                if plan.problem and plan.problem != last_problem:
                    log.warning("MIG instances not offered", extra={"reason": plan.problem})
                last_problem = plan.problem
                await plugins.apply(plan)
            waiters = [asyncio.ensure_future(stop.wait())]
            if changed is not None:
                waiters.append(asyncio.ensure_future(changed()))
            _done, pending = await asyncio.wait(waiters, timeout=interval_s,
                                                return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
    finally:
        await plugins.close()
