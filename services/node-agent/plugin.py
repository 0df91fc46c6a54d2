"""The device plugin gRPC server kubelet talks to, and its registration with kubelet.

`DevicePluginService` answers kubelet (ListAndWatch, GetPreferredAllocation, Allocate,
PreStartContainer) using the pure rules of handshake.py; `PluginEndpoint` owns the unix socket in
kubelet's device-plugin directory, registers, and re-registers whenever kubelet's socket is
recreated (kubelet deletes every socket there when it restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry
from tessera.node_agent import handshake as hs
from tessera.node_agent.containers import ContainerDir, ContainerStore, PreparedContainer
from tessera.node_agent.foreign import hami_held
from tessera.node_agent.grant_check import (
    GrantRefused,
    check_grant,
    check_sealed_capacity,
    counted_sealed,
    recorded_text,
    sealed_disagreements,
    sealed_repair,
)
from tessera.node_agent.metrics import NodeAgentMetrics
from tessera.node_agent.state import DeviceState

from tessera import bus, hami, signing
from tessera.cluster.port import ClusterError, ClusterPort
from tessera.kubeapi import (
    DEVICE_PLUGIN_VERSION,
    HEALTHY,
    KUBELET_SOCKET_NAME,
    UNHEALTHY,
    dp,
    dp_grpc,
    pr,
    pr_grpc,
)
from tessera.models import (
    Allocation,
    AllocationEvent,
    NodeLedger,
    allocation_layout,
    allocation_shape,
)
from tessera.region import LIMITS_FILE_NAME, seal_limits
from tessera.settings import TesseraSettings
from tessera.validation import Problem, Rejections

from . import mig_static, mps
from .mig_service import DynamicMig, MigCreateFailed, visible_devices
from .mps import MpsDaemons

POD_RESOURCES_TIMEOUT_S = 5.0
# GetPreferredAllocation and Allocate ask kubelet which pod it is admitting; past this, guess.
ADMITTING_TIMEOUT_S = 1.0
# kubelet's messages are small; a larger cap than gRPC's 4 MiB default lets an oversized request
# reach validation (INVALID_ARGUMENT with a reason) instead of dying as RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def check_id_count(device_ids: list[str], replicas: int) -> None:
    """More IDs than the node has replicas cannot be a real request."""
    if len(device_ids) > replicas:
        raise hs.HandshakeError(
            f"{len(device_ids)} device IDs in one request, but this node advertises only "
            f"{replicas} replicas", invalid=True,
        )  # fmt: skip


async def list_pod_resources(socket_path: str) -> list[pr.PodResources]:
    """kubelet's pod-resources List (a fresh channel: kubelet may have restarted)."""
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        reply = await stub.List(pr.ListPodResourcesRequest(), timeout=POD_RESOURCES_TIMEOUT_S)
        return list(reply.pod_resources)


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
    """kubelet's peer. One lock serialises the handshake (kubelet calls it serially anyway).

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
    ) -> None:
        self.settings = settings
        self.mig = mig  # dynamic MIG (mig_service.py); None: the node does not run it
        self.mps = mps  # MPS cards' control daemons (mps.py); None: no MPS on this node
        # The settings with this node's device configuration (memory scaling > 1 means
        # CUDA_OVERSUBSCRIBE and oversubscribe in the sealed limits); node_config.py.
        self.node_settings = node_settings or (lambda: settings)
        # limits.set's records on pods are signed with this key (grant_check.record_ok).
        self._record_signer = signing.process_signer(settings.command_key_file)
        self.clock = clock
        self.node = node
        self.metrics = metrics or NodeAgentMetrics()
        self.state = state
        self.store = store
        self.ledger_kv = ledger_kv
        self.js = js
        self.cluster = cluster
        self.log = log
        self.pod_resources = pod_resources
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self.rejections = Rejections(f"node-agent/{node}", js, CollectorRegistry())
        # The pod the last GetPreferredAllocation answered for, and the pod whose containers
        # the last Allocate served: hints for attributing the next Allocate (never proof).
        self._guess: str | None = None
        self._run: str | None = None
        self._sealed_revision = 0  # the ledger revision last compared with what is sealed
        self._sealed_checked_at = 0.0

    # --- kubelet's RPCs ------------------------------------------------------------------------

    async def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    async def ListAndWatch(self, request, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        version = -1
        while True:
            devices, version = await self.state.wait_change(version)
            yield dp.ListAndWatchResponse(devices=[
                dp.Device(
                    ID=hs.replica_id(d.uuid, i),
                    health=HEALTHY if d.healthy else UNHEALTHY,
                    topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=d.numa)]),
                )
                for d in devices
                for i in range(d.split_count)
            ])

    async def GetPreferredAllocation(self, request, context):
        return await self._guarded(context, "GetPreferredAllocation", self.preferred, request)

    async def Allocate(self, request, context):
        return await self._guarded(context, "Allocate", self.allocate, request)

    async def PreStartContainer(self, request, context):
        return await self._guarded(context, "PreStartContainer", self.pre_start, request)

    async def _guarded(self, context, rpc: str, handler, request):
        """Run a handshake step; any refusal or failure is a gRPC error with a message. Each
        call is timed and counted (ok / refused / error) in /metrics."""
        started = time.perf_counter()
        counted = False

        def count(result: str) -> None:  # before kubelet hears the answer, so a scrape right
            nonlocal counted  # after a refusal already shows it
            if not counted:
                counted = True
                self.metrics.handshake(rpc, time.perf_counter() - started, result)

        try:
            async with self._lock:
                reply = await handler(request)
            count("ok")
            return reply
        except hs.HandshakeError as exc:
            count("refused")
            self.log.warning("refused", extra={"rpc": rpc, "reason": str(exc)})
            code = (grpc.StatusCode.INVALID_ARGUMENT if exc.invalid
                    else grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(code, str(exc))
        except Exception as exc:  # the agent keeps serving whatever went wrong
            count("error")
            self.log.exception("handshake step failed", extra={"rpc": rpc})
            await context.abort(grpc.StatusCode.INTERNAL, f"{rpc} failed: {exc}")
        finally:
            count("error")  # cancelled: neither answered nor refused

    # --- the handshake -------------------------------------------------------------------------

    async def _ledger(self) -> NodeLedger | None:
        current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        return current.value if current else None

    async def preferred(self, request: dp.PreferredAllocationRequest):
        devices = self.state.by_uuid()
        replicas = sum(d.split_count for d in devices.values())
        for req in request.container_requests:
            check_id_count(list(req.available_deviceIDs), replicas)
            check_id_count(list(req.must_include_deviceIDs), replicas)
        ledger = await self._ledger()
        only = await self._kubelet_admitting(ledger)
        response = dp.PreferredAllocationResponse()
        run = self._open_run(ledger, only)
        for req in request.container_requests:
            size, available = req.allocation_size, list(req.available_deviceIDs)
            must = list(req.must_include_deviceIDs)
            if run is not None and len(run[0].containers[run[1]]) == size:
                targets = [run]  # kubelet is in the middle of this pod's admission
            else:
                targets = [(a, hs.gpu_containers(a)[0])
                           for a in self._unserved(ledger, only) if hs.first_size(a) == size]
                if not targets and only:  # kubelet's view did not settle it: every pod
                    targets = [(a, hs.gpu_containers(a)[0])
                               for a in self._unserved(ledger) if hs.first_size(a) == size]
            if not targets:
                raise self._no_pod_of_size("asks for", size, ledger)
            ids, error = None, None
            for allocation, index in targets:  # the oldest pod whose GPUs kubelet still offers
                try:
                    ids = hs.preferred_replicas(allocation.containers[index], available, must,
                                                size, devices, hs.describe(allocation, index))
                except hs.HandshakeError as exc:
                    error = error or exc
                    continue
                self._guess = allocation.pod_uid
                later = [j for j in hs.gpu_containers(allocation) if j > index]
                run = (allocation, later[0]) if later else None
                break
            if ids is None:
                assert error is not None
                raise error
            response.container_responses.append(dp.ContainerPreferredAllocationResponse(
                deviceIDs=ids
            ))
        return response

    def _served(self, allocation: Allocation) -> list[ContainerDir]:
        return self.store.for_pod(allocation.pod_uid)

    async def _kubelet_admitting(self, ledger: NodeLedger | None) -> set[str] | None:
        """The in-flight pods kubelet's pod-resources List shows under admission (normally
        one: see hs.kubelet_admitting); None when kubelet could not be asked in time."""
        flying = hs.in_flight(ledger)
        if len(flying) < 2:
            return None  # nothing to tell apart
        try:
            pods = await asyncio.wait_for(
                self.pod_resources(self.settings.pod_resources_socket), ADMITTING_TIMEOUT_S
            )
        except Exception as exc:
            self.log.info("pod-resources not read: guessing the pod", extra={"err": str(exc)})
            return None
        resource = self.settings.resource_name
        listed = {
            (pod.namespace, pod.name): {
                c.name for c in pod.containers
                if any(d.resource_name == resource and d.device_ids for d in c.devices)
            }
            for pod in pods
        }  # fmt: skip
        return hs.kubelet_admitting(flying, listed)

    def _unserved(
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
            existing = self._served(allocation)
            if not existing or hs.admission_restarted(allocation, existing, self._sealed):
                out.append(allocation)
        return out

    def _open_run(
        self, ledger: NodeLedger | None, only: set[str] | None = None
    ) -> tuple[Allocation, int] | None:
        """The pod kubelet is in the middle of admitting (some GPU containers served, not all)
        and its next GPU container. Read from disk, so it survives an agent restart."""
        runs = []
        for allocation in hs.in_flight(ledger):
            if only and allocation.pod_uid not in only:
                continue
            existing = self._served(allocation)
            done = {c.prepared.index for c in existing}
            remaining = [i for i in hs.gpu_containers(allocation) if i not in done]
            if existing and remaining:
                latest = max(c.prepared.prepared_at for c in existing)
                runs.append((allocation.pod_uid != self._run, -latest, allocation, remaining[0]))
        if not runs:
            return None
        _, _, allocation, index = min(runs, key=lambda r: r[:2])
        return allocation, index

    async def _follow_reuse(
        self, allocation: Allocation, index: int, gpus: list[str]
    ) -> Allocation | None:
        """kubelet reused other init-container devices than the grant names: follow it in the
        ledger when the cards allow (the pod's allocation after the change), else None."""
        # HAMi's pods on the node hold room on these cards too (a trade's rule: judged with
        # them, never blind; None: they cannot be judged, so kubelet's choice is not followed).
        capacity = await self._room_beside_hami(
            {d.uuid: (d.memory_mib, d.cores) for d in self.state.devices()}
        )
        if capacity is None:
            return None
        try:
            result = await bus.cas_update(
                self.ledger_kv, self.node, NodeLedger,
                lambda current: hs.follow_reuse_mutation(
                    allocation.pod_uid, index, gpus, capacity, current
                ),
            )
        except hs.HandshakeError as exc:
            self.log.warning("cannot follow kubelet's device reuse", extra={"err": str(exc)})
            return None
        followed = result.value.allocations[allocation.pod_uid]
        self._spawn(self._annotate(followed, {}, (hami.ANN_DEVICES_TO_ALLOCATE,)))
        return followed

    async def _attribute(
        self, ledger: NodeLedger | None, ids: list[str], gpus: list[str],
        only: set[str] | None = None,
    ) -> tuple[Allocation, int]:
        """Which pod and container an Allocate serves (see the README's handshake); `only`:
        the pods kubelet's view says it is admitting."""
        run = self._open_run(ledger, only)
        if run is not None and len(run[0].containers[run[1]]) == len(ids):
            allocation, index = run
            who = hs.describe(allocation, index)
            try:
                hs.check_devices(allocation.containers[index], gpus, who)
            except hs.HandshakeError as exc:
                followed = await self._follow_reuse(allocation, index, gpus)
                if followed is None:
                    self._publish_mismatch(allocation, ids, str(exc))
                    raise
                allocation = followed
            return allocation, index
        chosen = hs.choose_new_pod(self._unserved(ledger, only), len(ids), set(gpus), self._guess)
        unserved = self._unserved(ledger)
        if chosen is None and only:  # kubelet's view did not settle it: every pod
            chosen = hs.choose_new_pod(unserved, len(ids), set(gpus), self._guess)
        if chosen is not None:
            return chosen, hs.gpu_containers(chosen)[0]
        nearest = hs.choose_new_pod(unserved, len(ids), None, self._guess)
        if nearest is None:
            raise self._no_pod_of_size("allocated", len(ids), ledger)
        index = hs.gpu_containers(nearest)[0]
        wanted = ", ".join(g.uuid for g in nearest.containers[index])
        exc = hs.HandshakeError(
            f"kubelet chose GPU(s) {', '.join(sorted(gpus))} but no pod in flight on "
            f"{self.node} was granted them ({hs.describe(nearest, index)} was granted {wanted})",
            mismatch=True,
        )
        self._publish_mismatch(nearest, ids, str(exc))
        raise exc

    def _no_pod_of_size(
        self, verb: str, size: int, ledger: NodeLedger | None
    ) -> hs.HandshakeError:
        flying = hs.in_flight(ledger)
        if not flying:
            return hs.no_pod_in_flight(self.node)
        pods = "; ".join(
            f"{hs.describe(a, hs.gpu_containers(a)[0])} was granted {hs.first_size(a)} GPU(s)"
            for a in flying[:3] if hs.gpu_containers(a)
        )  # fmt: skip
        return hs.HandshakeError(
            f"kubelet {verb} {size} devices but no pod in flight on {self.node} takes "
            f"{size}: {pods}",
            mismatch=True,
        )

    async def allocate(self, request: dp.AllocateRequest):
        devices = self.state.by_uuid()
        if not request.container_requests:
            raise hs.HandshakeError("Allocate with no container requests")
        replicas = sum(d.split_count for d in devices.values())
        check_id_count([i for r in request.container_requests for i in r.devices_ids], replicas)
        checked = [
            (list(req.devices_ids), hs.gpus_of(list(req.devices_ids), devices))
            for req in request.container_requests
        ]
        ledger = await self._ledger()
        only = await self._kubelet_admitting(ledger)
        response = dp.AllocateResponse()
        for ids, gpus in checked:
            allocation, index = await self._attribute(ledger, ids, gpus, only)
            allocation = await self._mig_instances(allocation, index)
            cdir = await self._prepare(allocation, index, ids)
            answer = self._mig_answer(allocation, cdir, self._allocate_response(allocation, cdir))
            single = mig_static.single_instance_env(allocation.containers[index],
                                                    allocation.priority)
            if single is not None:  # migstrategy single: whole instances, no libvgpu
                answer = dp.ContainerAllocateResponse(envs=single)
            response.container_responses.append(await self._mps_answer(allocation, cdir, answer))
            await self._maybe_finish(allocation)
        return response

    # --- dynamic MIG (mig_service.py): the pod's instances before its container is answered ----

    async def _mig_instances(self, allocation: Allocation, index: int) -> Allocation:
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

    @staticmethod
    def _mig_answer(allocation: Allocation, cdir: ContainerDir, out):
        """A MIG instance reaches the container as its MIG UUID (as the NVIDIA device plugin
        hands MIG devices over); a container of MIG instances only gets no libvgpu: the
        hardware isolates it."""
        grants = allocation.containers[cdir.prepared.index]
        if not any(g.mig is not None for g in grants):
            return out
        visible = ",".join(visible_devices(grants))
        if all(g.mig is not None for g in grants):
            return dp.ContainerAllocateResponse(envs={
                "NVIDIA_VISIBLE_DEVICES": visible, "CUDA_VISIBLE_DEVICES": visible,
                "CUDA_TASK_PRIORITY": str(allocation.priority),
            })  # fmt: skip
        out.envs["NVIDIA_VISIBLE_DEVICES"] = visible
        return out

    async def _prepare(self, allocation: Allocation, index: int, ids: list[str]) -> ContainerDir:
        existing = self._served(allocation)
        if hs.admission_restarted(allocation, existing, self._sealed):
            # Every container was prepared, none started, the pod still in flight: the last
            # admission failed before its end (agent crash, ledger error) and kubelet retries.
            self.log.warning("kubelet retries the admission of a pod: preparing it anew",
                             extra={"pod": f"{allocation.namespace}/{allocation.name}"})
            for cdir in existing:
                await asyncio.to_thread(self.store.remove_container, cdir)
        prepared = PreparedContainer(
            pod_uid=allocation.pod_uid,
            namespace=allocation.namespace,
            pod=allocation.name,
            container=hs.container_name(allocation, index),
            index=index,
            device_ids=ids,
            grants=allocation.containers[index],
        )
        cdir = await asyncio.to_thread(self.store.prepare, prepared)
        self._run = allocation.pod_uid
        self.log.info("allocated", extra={
            "pod": f"{allocation.namespace}/{allocation.name}", "container": prepared.container,
            "devices": ids,
        })
        return cdir

    def _allocate_response(self, allocation: Allocation, cdir: ContainerDir):
        grants = allocation.containers[cdir.prepared.index]
        out = dp.ContainerAllocateResponse(envs=hs.container_env(allocation, grants,
                                                                 self.node_settings()))
        for container_path, host_path, read_only in hs.container_mounts(
            cdir, self.settings, self.settings.preload_host_path or str(self.store.preload_file)
        ):
            out.mounts.append(dp.Mount(
                container_path=container_path, host_path=host_path, read_only=read_only
            ))
        return out

    # --- MPS cards (mps.py): each container's own server-side limits before it can run ------

    def _mps_cards(self, allocation: Allocation, index: int) -> set[str]:
        return mps.mps_uuids(self.state.devices()) & {g.uuid for g in allocation.containers[index]}

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

    async def _mps_answer(self, allocation: Allocation, cdir: ContainerDir, out):
        cards = self._mps_cards(allocation, cdir.prepared.index) if self.mps else set()
        if not cards or self.mps is None:
            return out
        pipe = await self._mps_enforce(cdir, allocation, cards)
        grants = [g.uuid for g in allocation.containers[cdir.prepared.index]]
        env, mounts = mps.container_extras(cards, grants, pipe)
        out.envs.update(env)
        for container_path, host_path, read_only in mounts:
            out.mounts.append(dp.Mount(
                container_path=container_path, host_path=host_path, read_only=read_only
            ))
        return out

    async def _mps_limits(self, cdir: ContainerDir, allocation: Allocation, limits):
        """PreStartContainer: the proven owner's limits on the container's own daemon."""
        cards = self._mps_cards(allocation, cdir.prepared.index) if self.mps else set()
        if not cards:
            return limits
        await self._mps_enforce(cdir, allocation, cards)
        return mps.accounting_only(limits, cards)

    async def _maybe_finish(self, allocation: Allocation) -> None:
        """Once every GPU container is served: allocated, claim released, event, bind-phase."""
        prepared = {c.prepared.index for c in self.store.for_pod(allocation.pod_uid)}
        if not set(hs.gpu_containers(allocation)) <= prepared:
            return
        if self._run == allocation.pod_uid:
            self._run = None
        finish = hs.Finish(allocation.pod_uid)
        try:
            await bus.cas_update(self.ledger_kv, self.node, NodeLedger, finish.mutate)
        except bus.NoChange:
            return
        if finish.wrote:  # (cas_update returns the entry as it is when there was nothing to do)
            self._spawn(self._announce_allocated(allocation))

    async def _announce_allocated(self, allocation: Allocation) -> None:
        event = AllocationEvent(
            event_id=f"{allocation.pod_uid}:allocated",
            action="allocated",
            node=self.node,
            pod_uid=allocation.pod_uid,
            namespace=allocation.namespace,
            name=allocation.name,
            containers=allocation.containers,
            source=f"node-agent/{self.node}",
        )
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            self.log.warning("allocated event not published", extra={"err": str(exc)})
        # HAMi's record of what the pod was given (the grants kubelet's devices carry).
        await self._annotate(allocation, {hami.ANN_BIND_PHASE: hami.BIND_PHASE_SUCCESS},
                             (hami.ANN_DEVICES_ALLOCATED,))  # fmt: skip

    async def _annotate(
        self, allocation: Allocation, annotations: dict[str, str],
        grant_keys: tuple[str, ...] = (), attempts: int = 5,
    ) -> None:
        """Patch the pod's annotations (the cluster is the durable record of grants), retried.
        `grant_keys` get the pod's grants as the ledger holds them when the patch is sent, so a
        late patch never writes grants a repair has since replaced."""
        if self.cluster is None:
            return
        for attempt in range(1, attempts + 1):
            try:
                values = dict(annotations)
                if grant_keys:
                    ledger = await self._ledger()
                    current = ledger.allocations.get(allocation.pod_uid) if ledger else None
                    if current is None:
                        return  # released meanwhile: nothing to record
                    keys = await self._recordable(current, grant_keys)
                    devices = hami.encode_pod_devices(current.containers)
                    values |= dict.fromkeys(keys, devices)
                    if hami.ANN_DEVICES_ALLOCATED in keys:  # what this agent allocated, signed
                        values[signing.RECORD_ANNOTATION] = signing.record_signature(
                            self._record_signer, current.pod_uid, devices)
                    if mig := hami.encode_mig_instances(current.containers):
                        values[hami.ANN_MIG_INSTANCES] = mig  # with the instances' UUIDs
                await self.cluster.patch_pod_metadata(
                    allocation.namespace, allocation.name, annotations=values
                )
                return
            except Exception as exc:
                if attempt == attempts:
                    self.log.warning("pod annotations not written", extra={
                        "pod": f"{allocation.namespace}/{allocation.name}", "err": str(exc),
                    })  # fmt: skip
                    return
                await asyncio.sleep(0.2 * attempt)

    async def _recordable(
        self, allocation: Allocation, grant_keys: tuple[str, ...]
    ) -> tuple[str, ...]:
        """`grant_keys` without `hami.io/vgpu-devices-allocated` when the ledger's grants are
        not what the pod asked for: grant_check trusts that annotation as limits.set's record,
        so a grant forged on the bus must never be copied into it."""
        if hami.ANN_DEVICES_ALLOCATED not in grant_keys or self.cluster is None:
            return grant_keys
        try:
            pod = await self.cluster.get_pod(allocation.namespace, allocation.name)
            if (pod.get("metadata") or {}).get("uid") != allocation.pod_uid:
                raise GrantRefused("the cluster's pod has another uid than the ledger's")
            devices = self.state.by_uuid()
            for index, grants in enumerate(allocation.containers):
                if grants:
                    check_grant(pod, index, grants, devices, self.settings)
        except GrantRefused as exc:
            self.rejections.reject("ledger", self.node, Problem("grant_above_request", str(exc)))
            return tuple(k for k in grant_keys if k != hami.ANN_DEVICES_ALLOCATED)
        return grant_keys

    async def pre_start(self, request: dp.PreStartContainerRequest):
        ids = list(request.devices_ids)
        devices = self.state.by_uuid()
        check_id_count(ids, sum(d.split_count for d in devices.values()))
        hs.gpus_of(ids, devices)
        candidates = self.store.by_devices(ids)
        if not candidates:
            raise hs.HandshakeError(
                f"no container was prepared for devices {ids}: PreStartContainer without a "
                "matching Allocate on this node"
            )
        pods = await self.pod_resources(self.settings.pod_resources_socket)
        holders = holders_of(pods, self.settings.resource_name, ids)
        if not holders:
            raise hs.HandshakeError(f"kubelet's pod-resources reports no container holding {ids}")
        cdir, why = hs.pick_prepared(candidates, holders, self._sealed)
        if cdir is None and await self._repair_cross(candidates, holders):
            cdir, why = hs.pick_prepared(self.store.by_devices(ids), holders, self._sealed)
        if cdir is None:
            stray = candidates[0].prepared
            reason = f"{ids}: {why}"
            self._publish_mismatch_raw(stray.pod_uid, stray.namespace, stray.pod, ids, reason)
            if (stray.namespace, stray.pod) not in {(ns, pod) for ns, pod, _ in holders}:
                await self._undo_misattributed(candidates[0])
            raise hs.HandshakeError(reason, mismatch=True)
        p = cdir.prepared
        ledger = await self._ledger()
        allocation = ledger.allocations.get(p.pod_uid) if ledger else None
        if allocation is None or not allocation.active:
            raise hs.HandshakeError(f"pod {p.namespace}/{p.pod} has no active allocation here")
        if p.index >= len(allocation.containers) or not allocation.containers[p.index]:
            raise hs.HandshakeError(f"{hs.describe(allocation, p.index)} has no GPU grant")
        await self._check_grant(allocation, p.index)
        await self._check_sealed(allocation, p.index, cdir)
        limits = await self._mps_limits(cdir, allocation,
                                        hs.limits_for(allocation, p.index, self.node_settings()))
        await asyncio.to_thread(seal_limits, cdir.limits_dir, limits)
        self.log.info("limits sealed", extra={
            "pod": f"{p.namespace}/{p.pod}", "container": p.container, "devices": ids,
        })
        # A crash between Allocate's answer and its ledger write leaves the claim held.
        if hs.finish_pending(allocation.pod_uid, ledger):
            await self._maybe_finish(allocation)
        return dp.PreStartContainerResponse()

    def _record_ok(self, pod: dict) -> bool:
        """The pod's `-allocated` record is limits.set's, signed with this agent's own key."""
        signer = self._record_signer
        if signer.key is None:
            return False  # no key: a grant above the request is never believed
        uid, value, signature = recorded_text(pod)
        return value is not None and signing.record_verifies(
            signature, uid, value, signer.user, {signer.user: signer.key.public_key()})

    async def _check_grant(self, allocation: Allocation, index: int) -> None:
        """The ledger's grant must be what the pod asked for (grant_check): a grant forged on
        the bus is refused before it is sealed. Without a cluster API there is no pod to ask."""
        if self.cluster is None:
            return
        who = hs.describe(allocation, index)
        try:
            pod = await self.cluster.get_pod(allocation.namespace, allocation.name)
        except ClusterError as exc:
            raise hs.HandshakeError(
                f"{who}: cannot read the pod to check its grant: {exc}"
            ) from exc
        try:
            if (pod.get("metadata") or {}).get("uid") != allocation.pod_uid:
                raise GrantRefused(f"{who}: the cluster's pod has another uid than the ledger's")
            check_grant(pod, index, allocation.containers[index], self.state.by_uuid(),
                        self.settings, self._record_ok(pod))  # fmt: skip
        except GrantRefused as exc:
            self.rejections.reject("ledger", self.node, Problem("grant_above_request", str(exc)))
            raise hs.HandshakeError(str(exc), mismatch=True) from exc

    async def reconcile_sealed(self, every_s: float = 2.0) -> None:
        """When the ledger changed: every allocated container it places on other cards than
        the ones it sealed (a rebuild from a forged annotation) is reported, and the ledger is
        put back on the sealed cards where they hold it (grant_check.sealed_repair)."""
        if time.monotonic() - self._sealed_checked_at < every_s:
            return
        self._sealed_checked_at = time.monotonic()
        current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        if current is None or current.revision == self._sealed_revision:
            return
        async with self._lock:
            self._sealed_revision = current.revision
            active = {u: a for u, a in current.value.allocations.items() if a.active}

            def read() -> dict[tuple[str, int], dict[str, int]]:
                return {(c.prepared.pod_uid, c.prepared.index): mps.sealed_memory(c)
                        for c in self.store.all() if c.prepared.pod_uid in active}

            sealed = counted_sealed(await asyncio.to_thread(read), active, ("", -1))
            names = {u: f"{a.namespace}/{a.name}" for u, a in active.items()}
            found = sealed_disagreements(sealed, {u: a.containers for u, a in active.items()},
                                         names)
            if not found:
                return
            for message in found:  # each its own event (not deduplicated by problem code)
                self.rejections.reject("ledger", self.node,
                                       Problem("sealed_grant_disagrees", message),
                                       zlib.crc32(message.encode()) or 1)
            changed, unrepaired = sealed_repair(active, sealed, self.state.by_uuid())
            for who in unrepaired:
                self.rejections.reject("ledger", self.node, Problem(
                    "sealed_grant_unrepaired", f"{who}: the cards it sealed cannot hold it "
                    "in the ledger; new grants there are refused until it ends"))

            def put_back(ledger: NodeLedger | None) -> NodeLedger:
                if ledger is None:
                    raise bus.NoChange
                ledger = ledger.model_copy(deep=True)
                for uid, allocation in changed.items():
                    if ledger.allocations.get(uid) == active[uid]:  # unchanged since read
                        ledger.allocations[uid] = allocation
                return ledger

            if changed:
                with contextlib.suppress(bus.NoChange):
                    await bus.cas_update(self.ledger_kv, self.node, NodeLedger, put_back)
                self.log.warning("ledger put back on the cards the containers sealed",
                                 extra={"pods": sorted(names[u] for u in changed)})

    async def _check_sealed(self, allocation: Allocation, index: int, cdir: ContainerDir) -> None:
        """What the node's containers have sealed is what they hold, whatever the ledger says
        (it may have been restored from a forged annotation, grant_check): a grant that would
        put a card over its capacity beside it is refused, and every sealed container the
        ledger places on other cards is reported."""
        ledger = await self._ledger()
        active = {u: a for u, a in (ledger.allocations.items() if ledger else ()) if a.active}
        others = [c for c in self.store.all()
                  if c.path != cdir.path and c.prepared.pod_uid in active]

        def read() -> dict[tuple[str, int], dict[str, int]]:
            return {(c.prepared.pod_uid, c.prepared.index): mps.sealed_memory(c) for c in others}

        sealed = counted_sealed(await asyncio.to_thread(read), active,
                                (allocation.pod_uid, index))
        names = {u: f"{a.namespace}/{a.name}" for u, a in active.items()}
        for message in sealed_disagreements(sealed, {u: a.containers for u, a in active.items()},
                                            names):
            self.rejections.reject("ledger", self.node, Problem("sealed_grant_disagrees", message),
                                   zlib.crc32(message.encode()) or 1)
        try:
            check_sealed_capacity(hs.describe(allocation, index), allocation.containers[index],
                                  sealed, self.state.by_uuid())
        except GrantRefused as exc:
            self.rejections.reject("ledger", self.node, Problem("sealed_over_capacity", str(exc)))
            raise hs.HandshakeError(str(exc), mismatch=True) from exc

    async def _repair_cross(
        self, candidates: list[ContainerDir], holders: list[tuple[str, str, str]]
    ) -> bool:
        """kubelet gave these devices to pod H while the Allocate was counted for pod L (several
        pods in flight, the guess crossed them). Repaired before anything is sealed, when
        neither pod has started a container:
        - H was granted exactly these GPUs for that container (one GPU layout): the directory
          is relabelled to H (and H's own, if it has one there, to L); no grant moves;
        - H and L have one shape: they exchange grants and progress in the ledger (one CAS,
          every card keeps the same amounts) and their directories are relabelled.
        L, left without a directory, is in flight again and its own Allocate still comes.
        True when repaired."""
        label = next((c for c in candidates if not self._sealed(c)), None)
        pods = {(ns, pod) for ns, pod, _ in holders}
        ledger = await self._ledger()
        if label is None or len(pods) != 1 or ledger is None:
            return False
        (namespace, name), = pods
        holder = next((a for a in ledger.allocations.values()
                       if (a.namespace, a.name) == (namespace, name) and a.active), None)
        labelled = ledger.allocations.get(label.prepared.pod_uid)
        if holder is None or labelled is None or holder.pod_uid == labelled.pod_uid:
            return False
        theirs, mine = self._served(holder), self._served(labelled)
        if any(self._sealed(c) for c in theirs + mine):
            return False
        repaired = await self._relabel_one(label, holder, labelled, theirs)
        # One shape: a swap moves no capacity. Other amounts: a trade, only when the holder is
        # in flight (the labelled pod was counted served by the cross itself); a pod already
        # served that kubelet admits again is not repaired.
        tradable = allocation_layout(holder) == allocation_layout(labelled) and (
            allocation_shape(holder) == allocation_shape(labelled)
            or holder.pod_uid in {a.pod_uid for a in hs.in_flight(ledger)}
        )
        if not repaired and tradable:
            repaired = await self._swap_pods(holder, labelled, theirs, mine)
        if not repaired:
            return False
        self.log.warning("crossed in-flight pods repaired before sealing", extra={
            "holder": f"{holder.namespace}/{holder.name}",
            "counted_for": f"{labelled.namespace}/{labelled.name}",
        })
        current = await self._ledger()
        for pod in (holder, labelled):
            now_ = current.allocations.get(pod.pod_uid) if current else None
            if now_ is None:
                continue
            if self._served(now_):
                await self._maybe_finish(now_)
            else:
                await self._give_back_claim(now_)
            # The scheduler wrote the old grants into the pod at bind: record the new ones.
            served = bool(self._served(now_))
            self._spawn(self._annotate(now_, {
                hami.ANN_BIND_PHASE: (hami.BIND_PHASE_SUCCESS if served
                                      else hami.BIND_PHASE_ALLOCATING),
            }, (hami.ANN_DEVICES_TO_ALLOCATE, hami.ANN_DEVICES_ALLOCATED)))  # fmt: skip
        return True

    def _gpus(self, cdir: ContainerDir) -> set[str]:
        return set(hs.gpus_of(cdir.prepared.device_ids, self.state.by_uuid()))

    async def _relabel(self, cdir: ContainerDir, owner: Allocation) -> None:
        i = cdir.prepared.index
        await asyncio.to_thread(self.store.relabel, cdir, cdir.prepared.model_copy(update={
            "pod_uid": owner.pod_uid, "namespace": owner.namespace, "pod": owner.name,
            "container": hs.container_name(owner, i), "grants": owner.containers[i],
        }))  # fmt: skip

    async def _relabel_one(
        self, label: ContainerDir, holder: Allocation, labelled: Allocation,
        theirs: list[ContainerDir],
    ) -> bool:
        i = label.prepared.index
        if i >= len(holder.containers) or {g.uuid for g in holder.containers[i]} != self._gpus(
            label
        ):
            return False
        displaced = [c for c in theirs if c.prepared.index == i]
        for other in displaced:  # crossed both ways: H's directory there is really L's
            if {g.uuid for g in labelled.containers[i]} != self._gpus(other):
                return False
        await self._relabel(label, holder)
        for other in displaced:
            await self._relabel(other, labelled)
        return True

    async def _swap_pods(
        self, holder: Allocation, labelled: Allocation,
        theirs: list[ContainerDir], mine: list[ContainerDir],
    ) -> bool:
        capacity = {d.uuid: (d.memory_mib, d.cores) for d in self.state.devices()}
        if allocation_shape(holder) != allocation_shape(labelled):  # a trade moves room
            left = await self._room_beside_hami(capacity)
            if left is None:
                return False
            capacity = left
        try:
            result = await bus.cas_update(
                self.ledger_kv, self.node, NodeLedger,
                lambda current: hs.swap_mutation(
                    labelled.pod_uid, holder.pod_uid, current, capacity
                ),
            )
        except hs.HandshakeError as exc:
            self.log.warning("crossed pods cannot be exchanged", extra={"err": str(exc)})
            return False
        except bus.NoChange:
            return False
        swapped = result.value.allocations
        for c in mine:
            await self._relabel(c, swapped[holder.pod_uid])
        for c in theirs:
            await self._relabel(c, swapped[labelled.pod_uid])
        return True

    async def _room_beside_hami(
        self, capacity: dict[str, tuple[int, int]]
    ) -> dict[str, tuple[int, int]] | None:
        """`capacity` less what HAMi's pods bound to this node hold on each card (a cluster
        migrating from HAMi: they are in no ledger, foreign.py), so that a trade is judged with
        every consumer of its cards. None when they cannot be judged (the pods cannot be listed,
        or a HAMi pod's grants do not read): the trade is refused, never made blind. Without a
        cluster port there is no Kubernetes, so no HAMi pod: `capacity` as it is."""
        if self.cluster is None:
            return capacity
        try:
            pods = await self.cluster.list_pods(node_name=self.node)
            held = hami_held(pods, self.node, self.settings)
        except Exception as exc:  # the API away, or a HAMi pod unreadable: fail closed
            self.log.warning("crossed pods not traded: HAMi's pods here cannot be judged",
                             extra={"err": str(exc)})  # fmt: skip
            return None
        return {uuid: (mem - held.get(uuid, (0, 0))[0], cores - held.get(uuid, (0, 0))[1])
                for uuid, (mem, cores) in capacity.items()}  # fmt: skip

    async def _give_back_claim(self, allocation: Allocation) -> None:
        """A pod counted as served that was not: in flight again, so its Allocate can come."""
        with contextlib.suppress(bus.NoChange):
            await bus.cas_update(
                self.ledger_kv, self.node, NodeLedger,
                lambda ledger: hs.reclaim_mutation(
                    allocation.pod_uid, ledger, f"node-agent/{self.node}",
                    self.settings.reservation_ttl_s, self.clock,
                ),
            )

    @staticmethod
    def _sealed(cdir: ContainerDir) -> bool:
        return (cdir.limits_dir / LIMITS_FILE_NAME).is_file()

    async def _undo_misattributed(self, cdir: ContainerDir) -> None:
        """An Allocate answered for the wrong pod: forget that preparation, and give the pod it
        was counted for its claim back so that its own Allocate still succeeds."""
        p = cdir.prepared
        await asyncio.to_thread(self.store.remove_container, cdir)
        if any(c.prepared.pod_uid == p.pod_uid for c in self.store.for_pod(p.pod_uid)):
            return  # other containers of that pod were served: leave its state alone
        ledger = await self._ledger()
        allocation = ledger.allocations.get(p.pod_uid) if ledger else None
        if allocation is not None:
            await self._give_back_claim(allocation)
            self.log.warning("claim given back after a mis-attributed Allocate", extra={
                "pod": f"{p.namespace}/{p.pod}",
            })

    # --- events --------------------------------------------------------------------------------

    def _publish_mismatch(self, allocation: Allocation, ids: list[str], reason: str) -> None:
        self._publish_mismatch_raw(
            allocation.pod_uid, allocation.namespace, allocation.name, ids, reason
        )

    def _publish_mismatch_raw(
        self, pod_uid: str, namespace: str, name: str, ids: list[str], reason: str
    ) -> None:
        digest = hashlib.sha256(",".join(sorted(ids)).encode()).hexdigest()[:12]
        event = AllocationEvent(
            event_id=f"{pod_uid}:mismatch:{digest}",
            action="mismatch",
            node=self.node,
            pod_uid=pod_uid,
            namespace=namespace,
            name=name,
            reason=reason,
            source=f"node-agent/{self.node}",
        )
        self._spawn(self._publish_quietly(event))

    async def _publish_quietly(self, event: AllocationEvent) -> None:
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            self.log.warning("event not published", extra={"err": str(exc)})

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for background publishes (on stop)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=3.0)


def socket_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class ListAndWatchStreams(grpc.aio.ServerInterceptor):
    """Counts kubelet's ListAndWatch streams open on our socket: kubelet holds one for as long
    as it holds our client, so none open well after registering means kubelet dropped us."""

    METHOD = "/v1beta1.DevicePlugin/ListAndWatch"

    def __init__(self) -> None:
        self.open = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method != self.METHOD
                or handler.unary_stream is None):
            return handler
        stream = handler.unary_stream

        async def counted(request, context):
            self.open += 1
            try:
                async for response in stream(request, context):
                    yield response
            finally:
                self.open -= 1

        return grpc.unary_stream_rpc_method_handler(
            counted, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class PluginEndpoint:
    """Our socket in kubelet's device-plugin directory, and the registration with kubelet.

    Registered but no ListAndWatch stream open for `stream_grace_s` means kubelet does not hold
    our client (it dropped it after answering Register: it still held the previous agent's
    connection, which it then saw end; or its dial of our socket failed), so we register again:
    harmless where kubelet still holds us (a no-op), and otherwise the node's devices would stay
    Unhealthy to kubelet until the next kubelet restart."""

    def __init__(
        self,
        plugin_dir: str,
        resource_name: str,
        service: DevicePluginService,
        log: logging.Logger,
        socket_name: str = "tessera-gpu.sock",
        poll_s: float = 0.25,
        stream_grace_s: float = 3.0,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.socket_path = self.plugin_dir / socket_name
        self.resource_name = resource_name
        self.service = service
        self.log = log
        self.poll_s = poll_s
        self.stream_grace_s = stream_grace_s
        self.registrations = 0
        self.streams = ListAndWatchStreams()
        self._server: grpc.aio.Server | None = None
        self._streamless_since: float | None = None
        self._own_inode: int | None = None
        self._kubelet_inode: int | None = None
        self._registered = False

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET_NAME

    async def _serve(self) -> None:
        await self._stop_server()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server(interceptors=[self.streams], options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ])  # fmt: skip
        dp_grpc.add_DevicePluginServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        self._own_inode = socket_inode(self.socket_path)

    async def _stop_server(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None

    async def _register(self) -> bool:
        request = dp.RegisterRequest(
            version=DEVICE_PLUGIN_VERSION,
            endpoint=self.socket_path.name,
            resource_name=self.resource_name,
            options=dp.DevicePluginOptions(
                pre_start_required=True, get_preferred_allocation_available=True
            ),
        )
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                await dp_grpc.RegistrationStub(channel).Register(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            self.log.warning("kubelet registration failed", extra={"err": exc.details()})
            return False
        self.registrations += 1
        self._streamless_since = time.monotonic()
        self.log.info("registered with kubelet", extra={
            "resource": self.resource_name, "endpoint": self.socket_path.name,
        })
        return True

    async def start(self) -> None:
        await self._serve()
        self._kubelet_inode = socket_inode(self.kubelet_socket)
        if self._kubelet_inode is not None:
            self._registered = await self._register()

    async def check(self) -> None:
        """One watch step: re-serve if our socket vanished, re-register if kubelet restarted."""
        if socket_inode(self.socket_path) != self._own_inode:
            self.log.info("plugin socket gone (kubelet restart?); serving again")
            await self._serve()
            self._registered = False
        kubelet = socket_inode(self.kubelet_socket)
        if kubelet != self._kubelet_inode:
            self._kubelet_inode = kubelet
            self._registered = False
        if self._registered and self._dropped_by_kubelet():
            self.log.warning("kubelet holds no ListAndWatch stream of ours; registering again",
                             extra={"resource": self.resource_name,
                                    "after_s": self.stream_grace_s})
            self._registered = False
        if not self._registered and kubelet is not None:
            self._registered = await self._register()
        await self.service.reconcile_sealed()

    def _dropped_by_kubelet(self) -> bool:
        if self.streams.open:
            self._streamless_since = None
            return False
        now = time.monotonic()
        if self._streamless_since is None:
            self._streamless_since = now
        return now - self._streamless_since >= self.stream_grace_s

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
                if stop.is_set():
                    break
                try:
                    await self.check()
                except Exception as exc:
                    self.log.warning("plugin watch step failed", extra={"err": str(exc)})
        finally:
            await self._stop_server()
            with contextlib.suppress(FileNotFoundError):
                if socket_inode(self.socket_path) == self._own_inode:
                    self.socket_path.unlink()
