"""Which pod and container a kubelet call serves (the README's handshake), for every device
kind: GetPreferredAllocation's pick, Allocate's attribution of kubelet's devices to one of the
pods in flight (kubelet's own view where it can be asked, the hints otherwise), kubelet's reuse
of init containers' devices followed in the ledger, and the container's directory prepared.
The pure rules are handshake.py's; this reads the ledger, the store and kubelet."""

from __future__ import annotations

import asyncio
import time

from tessera.node_agent import handshake as hs
from tessera.node_agent.containers import ContainerDir, PreparedContainer

from tessera import bus, hami
from tessera.kubeapi import dp, pr
from tessera.models import Allocation, NodeLedger

from . import ledger_mutations as lm
from .device_units import DeviceUnits
from .plugin_context import PluginContext
from .pod_records import PodRecords

# GetPreferredAllocation and Allocate ask kubelet which pod it is admitting; past this, guess.
ADMITTING_TIMEOUT_S = 1.0
# kubelet calls Allocate right after the GetPreferredAllocation of the same container: the view
# that call took serves that Allocate (once, within this age) instead of a second List.
VIEW_REUSE_S = 1.0


def check_id_count(device_ids: list[str], replicas: int) -> None:
    """More IDs than the node has replicas cannot be a real request."""
    if len(device_ids) > replicas:
        raise hs.HandshakeError(
            f"{len(device_ids)} device IDs in one request, but this node advertises only "
            f"{replicas} replicas", invalid=True,
        )  # fmt: skip


class PodAttribution:
    def __init__(
        self, ctx: PluginContext, records: PodRecords, units: DeviceUnits | None = None
    ) -> None:
        self.ctx = ctx
        self.records = records
        self.units = units or DeviceUnits()
        # kubelet's view the last GetPreferredAllocation took: (when, pods it names).
        self._preferred_view: tuple[float, set[str]] | None = None
        # When the last GetPreferredAllocation read the ledger exactly (follows_preferred).
        self._preferred_at = float("-inf")

    async def preferred(self, request: dp.PreferredAllocationRequest):
        ctx = self.ctx
        devices = ctx.state.by_uuid()
        replicas = sum(d.split_count for d in devices.values())
        units = self.units
        for req in request.container_requests:
            check_id_count(units.whole(req.available_deviceIDs), replicas)
            check_id_count(units.touched(req.must_include_deviceIDs), replicas)
        # kubelet's List asked beside the exact ledger read, not after it, when the entry the
        # watch knows already holds several pods in flight (kubelet admits one pod at a time:
        # its List is the same during the whole call)
        listing = self.list_early()
        ledger = await ctx.ledger()  # exact: which pod kubelet admits is decided from here
        self._preferred_at = time.monotonic()
        only = await self.kubelet_admitting(ledger, listing)
        self._preferred_view = (time.monotonic(), only) if only else None
        response = dp.PreferredAllocationResponse()
        run = self.open_run(ledger, only)
        for req in request.container_requests:
            # in grant units: a device spanning k of kubelet's IDs is one (device_units.py)
            size, available = units.size(req.allocation_size), units.whole(req.available_deviceIDs)
            must = units.touched(req.must_include_deviceIDs)
            if run is not None and len(run[0].containers[run[1]]) == size:
                targets = [run]  # kubelet is in the middle of this pod's admission
            else:
                targets = [(a, hs.gpu_containers(a)[0])
                           for a in self.unserved(ledger, only) if hs.first_size(a) == size]
                if not targets and only:  # kubelet's view did not settle it: every pod
                    targets = [(a, hs.gpu_containers(a)[0])
                               for a in self.unserved(ledger) if hs.first_size(a) == size]
            if not targets:
                raise self.no_pod_of_size("asks for", size, ledger)
            ids, error = None, None
            for allocation, index in targets:  # the oldest pod whose GPUs kubelet still offers
                try:
                    ids = hs.preferred_replicas(allocation.containers[index], available, must,
                                                size, devices, hs.describe(allocation, index))
                except hs.HandshakeError as exc:
                    error = error or exc
                    continue
                ctx.guess = allocation.pod_uid
                later = [j for j in hs.gpu_containers(allocation) if j > index]
                run = (allocation, later[0]) if later else None
                break
            if ids is None:
                assert error is not None
                raise error
            response.container_responses.append(dp.ContainerPreferredAllocationResponse(
                deviceIDs=units.expand(ids)
            ))
        return response

    def follows_preferred(self) -> bool:
        """Whether this Allocate is the one kubelet makes right after a GetPreferredAllocation
        (back to back, for one container), which read the ledger exactly: then the entry known
        since (watched, at least as new) serves it. Used once. kubelet also calls Allocate with
        no GetPreferredAllocation before it (its topology manager aligned exactly the devices
        asked, or an init container's devices are reused): that one reads exactly, since a pod
        bound after the last read may not have reached the watch yet."""
        at, self._preferred_at = self._preferred_at, float("-inf")
        return time.monotonic() - at <= VIEW_REUSE_S

    async def admitting_for_allocate(self, ledger: NodeLedger | None) -> set[str] | None:
        """kubelet's view for an Allocate: the one the GetPreferredAllocation just before it
        took (kubelet calls the two back to back for one container; used once, and only while
        fresh), else asked now. Either way a hint: PreStartContainer proves the pod."""
        view, self._preferred_view = self._preferred_view, None
        if view is not None and time.monotonic() - view[0] <= VIEW_REUSE_S:
            in_flight = {a.pod_uid for a in hs.in_flight(ledger)}
            if view[1] & in_flight:
                return view[1] & in_flight
        return await self.kubelet_admitting(ledger)

    def list_early(self) -> asyncio.Future[list[pr.PodResources]] | None:
        """kubelet's List started now, when the entry the watch knows has several pods in
        flight (kubelet_admitting will want it); None otherwise."""
        ctx = self.ctx
        known = ctx.watched.known() if ctx.watched.live else None
        if known is None or len(hs.in_flight(known.value)) < 2:
            return None
        listing = asyncio.ensure_future(ctx.pod_resources(ctx.settings.pod_resources_socket))
        listing.add_done_callback(lambda f: f.cancelled() or f.exception())  # always retrieved
        return listing

    async def kubelet_admitting(
        self, ledger: NodeLedger | None,
        listing: asyncio.Future[list[pr.PodResources]] | None = None,
    ) -> set[str] | None:
        """The in-flight pods kubelet's pod-resources List shows under admission (normally
        one: see hs.kubelet_admitting); None when kubelet could not be asked in time.
        `listing`: that List already asked (list_early)."""
        ctx = self.ctx
        flying = hs.in_flight(ledger)
        if len(flying) < 2:
            if listing is not None:
                listing.cancel()
            return None  # nothing to tell apart
        try:
            pods = await asyncio.wait_for(
                listing if listing is not None
                else ctx.pod_resources(ctx.settings.pod_resources_socket),
                ADMITTING_TIMEOUT_S,
            )  # fmt: skip
        except Exception as exc:
            ctx.log.info("pod-resources not read: guessing the pod", extra={"err": str(exc)})
            return None
        resource = ctx.resource_name
        listed = {
            (pod.namespace, pod.name): {
                c.name for c in pod.containers
                if any(d.resource_name == resource and d.device_ids for d in c.devices)
            }
            for pod in pods
        }  # fmt: skip
        return hs.kubelet_admitting(flying, listed)

    def unserved(
        self, ledger: NodeLedger | None, only: set[str] | None = None
    ) -> list[Allocation]:
        """In-flight pods kubelet has not begun to admit (or is admitting anew after a failure
        before the end: every container prepared, none started, still only bound); with
        `only` (kubelet's view, when it names any), just those."""
        out = []
        for allocation in hs.in_flight(ledger):
            if only and allocation.pod_uid not in only:
                continue
            if not hs.gpu_containers(allocation):
                continue
            existing = self.ctx.served(allocation)
            if not existing or self.restarted(allocation, existing):
                out.append(allocation)
        return out

    def restarted(self, allocation: Allocation, existing: list[ContainerDir]) -> bool:
        """kubelet admits the pod anew (hs.admission_restarted), unless Allocate has just
        answered for it and its finish is on its way (the ledger still shows it bound)."""
        return (hs.admission_restarted(allocation, existing, self.ctx.sealed)
                and not self.records.answered(allocation.pod_uid))  # fmt: skip

    def open_run(
        self, ledger: NodeLedger | None, only: set[str] | None = None
    ) -> tuple[Allocation, int] | None:
        """The pod kubelet is in the middle of admitting (some GPU containers served, not all)
        and its next GPU container. Read from disk, so it survives an agent restart."""
        runs = []
        for allocation in hs.in_flight(ledger):
            if only and allocation.pod_uid not in only:
                continue
            existing = self.ctx.served(allocation)
            done = {c.prepared.index for c in existing}
            remaining = [i for i in hs.gpu_containers(allocation) if i not in done]
            if existing and remaining:
                latest = max(c.prepared.prepared_at for c in existing)
                runs.append((allocation.pod_uid != self.ctx.run, -latest, allocation,
                             remaining[0]))  # fmt: skip
        if not runs:
            return None
        _, _, allocation, index = min(runs, key=lambda r: r[:2])
        return allocation, index

    async def follow_reuse(
        self, allocation: Allocation, index: int, gpus: list[str]
    ) -> Allocation | None:
        """kubelet reused other init-container devices than the grant names: follow it in the
        ledger when the cards allow (the pod's allocation after the change), else None."""
        ctx = self.ctx
        # HAMi's pods on the node hold room on these cards too (a trade's rule: judged with
        # them, never blind; None: they cannot be judged, so kubelet's choice is not followed).
        capacity = await ctx.room_beside_hami(
            {d.uuid: (d.memory_mib, d.cores) for d in ctx.state.devices()}
        )
        if capacity is None:
            return None
        try:
            result = await bus.cas_update(
                ctx.ledger_kv, ctx.node, NodeLedger,
                lambda current: lm.follow_reuse_mutation(
                    allocation.pod_uid, index, gpus, capacity, current
                ),
            )
        except hs.HandshakeError as exc:
            ctx.log.warning("cannot follow kubelet's device reuse", extra={"err": str(exc)})
            return None
        followed = result.value.allocations[allocation.pod_uid]
        ctx.moves += 1
        ctx.spawn(self.records.annotate(followed, {}, (hami.ANN_DEVICES_TO_ALLOCATE,)))
        return followed

    async def attribute(
        self, ledger: NodeLedger | None, ids: list[str], gpus: list[str],
        only: set[str] | None = None,
    ) -> tuple[Allocation, int]:
        """Which pod and container an Allocate serves (see the README's handshake); `only`:
        the pods kubelet's view says it is admitting."""
        ctx = self.ctx
        run = self.open_run(ledger, only)
        if run is not None and len(run[0].containers[run[1]]) == len(ids):
            allocation, index = run
            who = hs.describe(allocation, index)
            try:
                hs.check_devices(allocation.containers[index], gpus, who)
            except hs.HandshakeError as exc:
                followed = await self.follow_reuse(allocation, index, gpus)
                if followed is None:
                    self.records.publish_mismatch(allocation, ids, str(exc))
                    raise
                allocation = followed
            return allocation, index
        chosen = hs.choose_new_pod(self.unserved(ledger, only), len(ids), set(gpus), ctx.guess)
        unserved = self.unserved(ledger)
        if chosen is None and only:  # kubelet's view did not settle it: every pod
            chosen = hs.choose_new_pod(unserved, len(ids), set(gpus), ctx.guess)
        if chosen is not None:
            return chosen, hs.gpu_containers(chosen)[0]
        nearest = hs.choose_new_pod(unserved, len(ids), None, ctx.guess)
        if nearest is None:
            raise self.no_pod_of_size("allocated", len(ids), ledger)
        index = hs.gpu_containers(nearest)[0]
        wanted = ", ".join(g.uuid for g in nearest.containers[index])
        exc = hs.HandshakeError(
            f"kubelet chose GPU(s) {', '.join(sorted(gpus))} but no pod in flight on "
            f"{ctx.node} was granted them ({hs.describe(nearest, index)} was granted {wanted})",
            mismatch=True,
        )
        self.records.publish_mismatch(nearest, ids, str(exc))
        raise exc

    def no_pod_of_size(
        self, verb: str, size: int, ledger: NodeLedger | None
    ) -> hs.HandshakeError:
        node = self.ctx.node
        flying = hs.in_flight(ledger)
        if not flying:
            return hs.no_pod_in_flight(node)
        pods = "; ".join(
            f"{hs.describe(a, hs.gpu_containers(a)[0])} was granted {hs.first_size(a)} GPU(s)"
            for a in flying[:3] if hs.gpu_containers(a)
        )  # fmt: skip
        return hs.HandshakeError(
            f"kubelet {verb} {size} devices but no pod in flight on {node} takes "
            f"{size}: {pods}",
            mismatch=True,
        )

    async def prepare(self, allocation: Allocation, index: int, ids: list[str]) -> ContainerDir:
        """The container's directory (region, limits dir), for the pod attributed."""
        ctx = self.ctx
        existing = ctx.served(allocation)
        if self.restarted(allocation, existing):
            # Every container was prepared, none started, the pod still in flight: the last
            # admission failed before its end (agent crash, ledger error) and kubelet retries.
            ctx.log.warning("kubelet retries the admission of a pod: preparing it anew",
                            extra={"pod": f"{allocation.namespace}/{allocation.name}"})
            for cdir in existing:
                await asyncio.to_thread(ctx.store.remove_container, cdir)
        prepared = PreparedContainer(
            pod_uid=allocation.pod_uid,
            namespace=allocation.namespace,
            pod=allocation.name,
            container=hs.container_name(allocation, index),
            index=index,
            device_ids=ids,
            grants=allocation.containers[index],
            memory_reclaim=allocation.memory_reclaim,  # elastic memory (leases.py)
            memory_wait_s=allocation.memory_wait_s,
        )
        cdir = await asyncio.to_thread(ctx.store.prepare, prepared)
        ctx.run = allocation.pod_uid
        ctx.log.info("allocated", extra={
            "pod": f"{allocation.namespace}/{allocation.name}", "container": prepared.container,
            "devices": ids,
        })
        return cdir
