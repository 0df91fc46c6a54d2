"""The device plugin gRPC server kubelet talks to: a thin layer over the parts.

`DevicePluginService` answers kubelet (ListAndWatch, GetPreferredAllocation, Allocate,
PreStartContainer): each call is guarded (a refusal or failure is a gRPC error with a message,
timed and counted), attribution.py says which pod and container it serves, the container's
device family answers it (kind_answers.py; NVIDIA's: nvidia_answers.py), crossed.py repairs a
crossed attribution before sealing, sealed_checks.py checks the grant and what is sealed,
pod_records.py records the pod's progress. The socket and the registration with kubelet are
plugin_endpoint.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry
from tessera.node_agent import handshake as hs
from tessera.node_agent.containers import ContainerStore
from tessera.node_agent.metrics import NodeAgentMetrics
from tessera.node_agent.state import DeviceState

from tessera import signing
from tessera.cluster.port import ClusterPort
from tessera.device_kinds import registry
from tessera.device_kinds.nvidia import FAMILY as NVIDIA_FAMILY
from tessera.kubeapi import HEALTHY, UNHEALTHY, dp, dp_grpc, pr
from tessera.models import Allocation
from tessera.region import seal_limits
from tessera.settings import TesseraSettings
from tessera.validation import Rejections

from . import ledger_mutations as lm
from .attribution import VIEW_REUSE_S, PodAttribution, check_id_count
from .container_setup import spill_of
from .crossed import CrossRepair
from .device_units import DeviceUnits
from .kind_answers import AnswersByFamily
from .mig_service import DynamicMig
from .mps import MpsDaemons
from .nvidia_answers import NvidiaAnswers
from .plugin_context import PluginContext
from .plugin_endpoint import PluginEndpoint
from .pod_records import PodRecords
from .pod_resources_client import PodResourcesLister
from .sealed_checks import SealedChecks

__all__ = ["DevicePluginService", "PluginEndpoint", "holders_of", "list_pod_resources"]

# kubelet's pod-resources List on a kept channel (one per socket; made anew when kubelet
# recreates its socket): pod_resources_client.py.
list_pod_resources = PodResourcesLister()


def holders_of(
    pods: list[pr.PodResources], resource_name: str, device_ids: list[str]
) -> list[tuple[str, str, str]]:
    """(namespace, pod, container) of every container kubelet assigned exactly these IDs."""
    wanted = sorted(device_ids)
    return [
        (pod.namespace, pod.name, container.name)
        for pod in pods
        for container in pod.containers
        for devices in container.devices
        if devices.resource_name == resource_name and sorted(devices.device_ids) == wanted
    ]


class DevicePluginService(dp_grpc.DevicePluginServicer):
    """kubelet's peer. One lock serialises GetPreferredAllocation and Allocate (kubelet calls
    them one pod at a time) and PreStartContainer's seal (its proof runs outside: pre_start).

    Several pods may be in flight on the node (one shape at a time, see the README): Allocate
    attributes kubelet's devices to one of them, PreStartContainer proves which pod holds them
    and repairs a crossed attribution before any limit is sealed."""

    def __init__(
        self,
        *,
        settings: TesseraSettings,
        node: str,
        state: DeviceState,
        store: ContainerStore,
        ledger_kv: KeyValue,
        js: JetStreamContext,
        cluster: ClusterPort | None,
        log: logging.Logger,
        pod_resources: Callable[[str], Awaitable[list[pr.PodResources]]] = list_pod_resources,
        clock: Callable[[], float] | None = None,
        metrics: NodeAgentMetrics | None = None,
        node_settings: Callable[[], TesseraSettings] | None = None,
        mps: MpsDaemons | None = None,
        mig: DynamicMig | None = None,
        family: str | None = None,
        lease_ready: Callable[[Path], Awaitable[bool]] | None = None,
    ) -> None:
        """`family`: the device family this plugin serves (tessera.device_kinds; its count
        resource is what kubelet knows the devices by, and ListAndWatch lists its devices
        only); None: the node's devices as one NVIDIA resource (TESSERA_RESOURCE_NAME)."""
        self.family = family
        # The lease service's `ready`: a sealed container's account is open before kubelet
        # starts it (None: no lease service, as in the plugin's own tests).
        self.lease_ready = lease_ready
        resource = (registry.family(family).resource_names(settings).count if family
                    else settings.resource_name)  # fmt: skip
        self.ctx = ctx = PluginContext(
            settings=settings, node=node, state=state, store=store, ledger_kv=ledger_kv, js=js,
            cluster=cluster, log=log, pod_resources=pod_resources, clock=clock,
            metrics=metrics or NodeAgentMetrics(),
            node_settings=node_settings or (lambda: settings),
            rejections=Rejections(f"node-agent/{node}", js, CollectorRegistry()),
            record_signer=signing.process_signer(settings.command_key_file),
            resource_name=resource,
        )  # fmt: skip
        self.records = PodRecords(ctx)
        # kubelet's IDs per device (a 910C module is two NPUs to kubelet): device_units.py
        self.units = DeviceUnits(registry.family(family).ids_per_device if family else 1)
        self.attribution = PodAttribution(ctx, self.records, self.units)
        self.crossed = CrossRepair(ctx, self.records)
        self.checks = SealedChecks(ctx)
        self.answers = AnswersByFamily(ctx, {NVIDIA_FAMILY: NvidiaAnswers(ctx, mps, mig)})

    @property
    def metrics(self) -> NodeAgentMetrics:
        return self.ctx.metrics

    # --- kubelet's RPCs ------------------------------------------------------------------------

    async def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    async def ListAndWatch(self, request, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        version = -1
        while True:
            devices, version = await self.ctx.state.wait_change(version)
            if self.family is not None:
                devices = [d for d in devices if registry.family_of_mode(d.mode) == self.family]
            yield dp.ListAndWatchResponse(devices=[
                dp.Device(
                    ID=device_id,
                    health=HEALTHY if d.healthy else UNHEALTHY,
                    topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=d.numa)]),
                )
                for d in devices
                for device_id in self.units.listed(d.uuid, d.split_count)
            ])

    async def GetPreferredAllocation(self, request, context):
        return await self._guarded(context, "GetPreferredAllocation",
                                   self.attribution.preferred, request)  # fmt: skip

    async def Allocate(self, request, context):
        return await self._guarded(context, "Allocate", self.allocate, request)

    async def PreStartContainer(self, request, context):
        # (takes the lock itself, for the parts that need it: pre_start)
        return await self._guarded(context, "PreStartContainer", self.pre_start, request,
                                   locked=False)

    async def _guarded(self, context, rpc: str, handler, request, locked: bool = True):
        """Run a handshake step; any refusal or failure is a gRPC error with a message. Each
        call is timed and counted (ok / refused / error) in /metrics."""
        started = time.perf_counter()
        counted = False
        log = self.ctx.log

        def count(result: str) -> None:  # before kubelet hears the answer, so a scrape right
            nonlocal counted  # after a refusal already shows it
            if not counted:
                counted = True
                self.ctx.metrics.handshake(rpc, time.perf_counter() - started, result)

        try:
            if locked:
                async with self.ctx.lock:
                    reply = await handler(request)
            else:
                reply = await handler(request)
            count("ok")
            return reply
        except hs.HandshakeError as exc:
            count("refused")
            log.warning("refused", extra={"rpc": rpc, "reason": str(exc)})
            code = (grpc.StatusCode.INVALID_ARGUMENT if exc.invalid
                    else grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(code, str(exc))
        except Exception as exc:  # the agent keeps serving whatever went wrong
            count("error")
            log.exception("handshake step failed", extra={"rpc": rpc})
            await context.abort(grpc.StatusCode.INTERNAL, f"{rpc} failed: {exc}")
        finally:
            count("error")  # cancelled: neither answered nor refused

    # --- the handshake -------------------------------------------------------------------------

    async def allocate(self, request: dp.AllocateRequest):
        ctx = self.ctx
        devices = ctx.state.by_uuid()
        if not request.container_requests:
            raise hs.HandshakeError("Allocate with no container requests")
        replicas = sum(d.split_count for d in devices.values())
        check_id_count([i for r in request.container_requests for i in r.devices_ids], replicas)
        requested = [self.units.collapse(req.devices_ids) for req in request.container_requests]
        checked = [(ids, hs.gpus_of(ids, devices)) for ids in requested]
        # right after the GetPreferredAllocation that read the ledger exactly, the entry known
        # since (watched, at least as new) serves it; any other Allocate reads exactly
        # (attribution.py, follows_preferred)
        fresh = VIEW_REUSE_S if self.attribution.follows_preferred() else None
        ledger = await ctx.ledger(fresh_within=fresh)
        only = await self.attribution.admitting_for_allocate(ledger)
        response = dp.AllocateResponse()
        for ids, gpus in checked:
            allocation, index = await self.attribution.attribute(ledger, ids, gpus, only)
            answers = self.answers.of(allocation.containers[index])
            allocation = await answers.before_answer(allocation, index)
            cdir = await self.attribution.prepare(allocation, index, ids)
            response.container_responses.append(await answers.answer(allocation, cdir))
            self.records.finish_soon(allocation)  # written while kubelet goes on
        return response

    async def pre_start(self, request: dp.PreStartContainerRequest):
        """Prove which pod holds the devices (kubelet's pod-resources), check its grant, seal.

        Out of the lock (kubelet's pod workers call it while the next pod's Allocate runs):
        kubelet's List, the ledger read and the pod read for the grant check. Under the lock:
        the proof is taken again from the store (the same preparation must still be the one
        picked for the holders, and no grant or directory moved meanwhile: ctx.moves), then
        the sealed-capacity check and the seal. Anything else (no match: a crossed attribution
        to repair, or a refusal) runs wholly under the lock, as every step did before."""
        ctx = self.ctx
        kubelet_ids = list(request.devices_ids)  # what pod-resources reports the holder by
        ids = self.units.collapse(kubelet_ids)
        devices = ctx.state.by_uuid()
        check_id_count(ids, sum(d.split_count for d in devices.values()))
        hs.gpus_of(ids, devices)
        if not ctx.store.by_devices(ids):
            raise hs.HandshakeError(
                f"no container was prepared for devices {ids}: PreStartContainer without a "
                "matching Allocate on this node"
            )
        pods = await ctx.pod_resources(ctx.settings.pod_resources_socket)
        holders = holders_of(pods, ctx.resource_name, kubelet_ids)
        if not holders:
            raise hs.HandshakeError(f"kubelet's pod-resources reports no container holding {ids}")
        moves = ctx.moves
        cdir, _ = hs.pick_prepared(ctx.store.by_devices(ids), holders, ctx.sealed)
        if cdir is not None:
            ledger = await ctx.ledger()
            allocation = self._granted(ledger, cdir)
            pod = await self.checks.check_grant(allocation, cdir.prepared.index)
            async with ctx.lock:
                again, _ = hs.pick_prepared(ctx.store.by_devices(ids), holders, ctx.sealed)
                if (ctx.moves == moves and again is not None and again.path == cdir.path
                        and again.prepared == cdir.prepared):
                    await self._seal(cdir, allocation, ledger, ids, pod)
                    return dp.PreStartContainerResponse()
        async with ctx.lock:  # no match, or something moved meanwhile: all of it, locked
            await self._prove_and_seal(ids, holders)
        return dp.PreStartContainerResponse()

    def _granted(self, ledger, cdir) -> Allocation:
        """The active allocation a prepared container belongs to, with a grant at its index."""
        p = cdir.prepared
        allocation = ledger.allocations.get(p.pod_uid) if ledger else None
        if allocation is None or not allocation.active:
            raise hs.HandshakeError(f"pod {p.namespace}/{p.pod} has no active allocation here")
        if p.index >= len(allocation.containers) or not allocation.containers[p.index]:
            raise hs.HandshakeError(f"{hs.describe(allocation, p.index)} has no GPU grant")
        return allocation

    async def _prove_and_seal(self, ids: list[str], holders: list[tuple[str, str, str]]) -> None:
        """PreStart's proof under the lock: the preparation for the holders (a crossed one
        repaired first, a stray one undone and refused), its grant checked, its limits sealed."""
        ctx = self.ctx
        candidates = ctx.store.by_devices(ids)
        if not candidates:
            raise hs.HandshakeError(
                f"no container was prepared for devices {ids}: PreStartContainer without a "
                "matching Allocate on this node"
            )
        cdir, why = hs.pick_prepared(candidates, holders, ctx.sealed)
        if cdir is None and await self.crossed.repair(candidates, holders):
            ctx.moves += 1
            cdir, why = hs.pick_prepared(ctx.store.by_devices(ids), holders, ctx.sealed)
        if cdir is None:
            stray = candidates[0].prepared
            reason = f"{ids}: {why}"
            self.records.publish_mismatch_raw(stray.pod_uid, stray.namespace, stray.pod, ids,
                                              reason)  # fmt: skip
            if (stray.namespace, stray.pod) not in {(ns, pod) for ns, pod, _ in holders}:
                ctx.moves += 1
                await self.crossed.undo_misattributed(candidates[0])
            raise hs.HandshakeError(reason, mismatch=True)
        ledger = await ctx.ledger()
        allocation = self._granted(ledger, cdir)
        pod = await self.checks.check_grant(allocation, cdir.prepared.index)
        await self._seal(cdir, allocation, ledger, ids, pod)

    async def _seal(self, cdir, allocation: Allocation, ledger, ids: list[str],
                    pod: dict | None = None) -> None:
        """Under the lock: the sealed-capacity check beside the node's sealed containers, then
        the container's limits sealed (and a finish a crash left pending written). `pod`: the
        cluster's pod, read by the grant check (its spill opt-in; None: no spill)."""
        ctx = self.ctx
        p = cdir.prepared
        await self.checks.check_sealed(allocation, p.index, cdir, ledger)
        answers = self.answers.of(allocation.containers[p.index])
        limits = await answers.limits(cdir, allocation, hs.limits_for(
            allocation, p.index, ctx.node_settings(), spill_of(pod, p.container)))
        await asyncio.to_thread(seal_limits, cdir.limits_dir, limits)
        ctx.log.info("limits sealed", extra={
            "pod": f"{p.namespace}/{p.pod}", "container": p.container, "devices": ids,
        })
        if limits.lease and self.lease_ready is not None:
            await self.lease_ready(cdir.limits_dir)
        # Allocate's finish is written after its answer (finish_soon): wait for it; a crash
        # between that answer and its write leaves the claim held: written here then.
        if self.records.answered(allocation.pod_uid):
            await self.records.settle(allocation.pod_uid)
            known = ctx.watched.known()  # holds that write when it was made
            ledger = known.value if known is not None else ledger
        if lm.finish_pending(allocation.pod_uid, ledger):
            await self.records.maybe_finish(allocation)

    async def watch_ledger(self, stop: asyncio.Event) -> None:
        """Follow the node's ledger entry until `stop` (kubelet's calls read it from there:
        watched_ledger.py); without it every call reads KV."""
        await self.ctx.run_ledger_watch(stop)

    async def reconcile_sealed(self, every_s: float = 2.0) -> None:
        """Between watch steps: sealed containers the ledger misplaces (sealed_checks.py)."""
        await self.checks.reconcile(every_s)

    async def drain(self) -> None:
        """Wait for background publishes (on stop)."""
        await self.ctx.drain()
