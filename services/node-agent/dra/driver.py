"""Preparing and unpreparing claims: the driver's side of kubelet's NodePrepareResources.

Prepare (per claim, idempotent: kubelet retries):
1. read the claim from the API server (its uid must be the one kubelet named) and the pod it is
   reserved for on this node; `claims.plan` reads which devices and how much of each;
2. make the claim's directory (`containers.ContainerStore`, as Allocate does) and seal the
   consumed capacity there as the container's limits (`tessera.region.seal_limits`, as
   PreStartContainer does): the slice is sealed before kubelet even creates the container, and
   only the containers naming this claim receive it (CDI), so identity is exact by construction;
3. write the CDI spec (`cdi.py`) whose device mounts libvgpu, `/etc/ld.so.preload`, the region
   and the limits directory exactly as Allocate's answer;
4. record the preparation (`<region dir>/.dra/<claim uid>.json`), put the pod's allocation in
   the ledger (CAS) and publish `alloc.<node>.allocated`.
Unprepare: the CDI spec, the directory (limits, region) and the record go; the pod's
allocation shrinks while it keeps other claims (an ended pod's release is the scheduler's).

MIG partitions (dynamic MIG, `partitions.py`): the pod's allocation goes into the ledger first
with its instances planned, then `DynamicMig.allocate` makes them (NVML, as Allocate does in
extender mode) and records their MIG UUIDs; the CDI device hands the container the instance's
UUID and no libvgpu (the hardware isolates it). Unprepare takes the claim's instances out of
the ledger entry and destroys them at once (IN_USE: the MIG reconcile retries), so the
allocator may give the placement to the next claim.
MPS (`tessera/dra_config.py`): the container's own control daemon holds the claim's share
before the CDI spec exists (`MpsDaemons.limit_now`, as Allocate in extender mode), its pipe
directory is mounted and libvgpu's compute limiter is off (the sealed limits keep memory).
A claim shared by several pods of the node is handed on when its first pod ends: hand_on.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from tessera import bus
from tessera.cluster.port import ClusterError, NotFoundError
from tessera.device_kinds.base import GrantContext
from tessera.device_kinds.nvidia.mig import MIG as MIG_KIND
from tessera.device_kinds.nvidia.mps import PIPE_CONTAINER_DIR, mps_env
from tessera.models import AllocationEvent, NodeLedger
from tessera.region import seal_limits
from tessera.settings import TesseraSettings

from .. import handshake as hs
from .. import mps as mps_node
from ..containers import ContainerStore, PreparedContainer
from ..mig_service import DynamicMig, MigCreateFailed
from ..mps import MpsDaemons
from ..state import DeviceState
from . import accounting, cdi
from .claims import (
    ClaimError,
    PreparedClaim,
    booked,
    container_names,
    mig_devices,
    mps_cards,
    plan,
    reserved_pods,
    spill_bytes,
    task_priority,
    with_instances,
)
from .hand_on import HandOn
from .quota import DraQuota, QuotaRefused
from .records import ClaimRecords, PrepareError
from .settings import DraSettings


class DraDriver(HandOn):
    """Prepares claims for kubelet. Build with its dependencies; the gRPC layer
    (`endpoint.py`) calls `prepare` / `unprepare`."""

    def __init__(
        self,
        *,
        settings: TesseraSettings,
        dra: DraSettings,
        node: str,
        state: DeviceState,
        store: ContainerStore,
        ledger_kv,
        js,
        cluster,
        log: logging.Logger,
        node_settings: Callable[[], TesseraSettings] | None = None,
        source: str = "",
        quota: DraQuota | None = None,
        mig: DynamicMig | None = None,
        mps: MpsDaemons | None = None,
        lease_ready: Callable[[Path], Awaitable[bool]] | None = None,
    ) -> None:
        self.settings = settings
        self.dra = dra
        self.node = node
        self.state = state
        self.store = store
        self.ledger_kv = ledger_kv
        self.js = js
        self.cluster = cluster
        self.log = log
        self.node_settings = node_settings or (lambda: settings)
        self.source = source or f"node-agent/{node}/dra"
        self.records = ClaimRecords(Path(settings.region_host_dir))
        self.quota = quota
        self.mig = mig  # dynamic MIG (mig_service.py): None when the node does not run it
        self.mps = mps  # MPS cards' control daemons (mps.py)
        # the lease service's `ready`: a claim's account is open before its container can start
        self.lease_ready = lease_ready
        self._lock = asyncio.Lock()  # one claim at a time: the ledger body reads the records
        self._publishing: set[asyncio.Task[None]] = set()

    # --- prepare ---------------------------------------------------------------------------

    async def prepare(self, namespace: str, name: str, uid: str) -> list[tuple[PreparedClaim, str]]:
        """The claim's devices and their CDI device ID; PrepareError with kubelet's message."""
        async with self._lock:
            done = self.records.get(uid)
            if done is not None and cdi.read_spec(self.dra.cdi_dir, uid) is not None:
                await self._record_in_ledger(done.pod_uid)
                return [(done, done.cdi_device)]
            claim = await self._claim(namespace, name, uid)
            pod = await self._pod_of(claim)
            try:
                record = plan(claim, pod, self.node, self.state.devices())
            except ClaimError as exc:
                raise PrepareError(str(exc)) from exc
            if done is not None:  # a prepare cut short: the instances it made are the claim's
                record = with_instances(record, [d.grant for d in done.devices])
            self._check_one_claim_per_container(record)
            await self._hold_quota(record, [*self.records.of_pod(record.pod_uid), record], pod)
            if mig_devices(record):
                record = await self._make_instances(record, pod)
            record = await self._materialise(record, pod)
            self.records.put(record)
            await self._record_in_ledger(record.pod_uid, pod)
            await self._publish("allocated", record, pod)
            self.log.info("claim prepared", extra={
                "claim": f"{namespace}/{name}", "pod": f"{record.namespace}/{record.pod}",
                "devices": [d.grant.model_dump() for d in record.devices],
            })  # fmt: skip
            return [(record, record.cdi_device)]

    async def _claim(self, namespace: str, name: str, uid: str) -> dict:
        try:
            claim = await self.cluster.get_resource_claim(namespace, name)
        except NotFoundError as exc:
            raise PrepareError(f"ResourceClaim {namespace}/{name} not found") from exc
        except ClusterError as exc:
            raise PrepareError(f"ResourceClaim {namespace}/{name}: {exc}") from exc
        if (claim.get("metadata") or {}).get("uid") != uid:
            raise PrepareError(f"ResourceClaim {namespace}/{name} has another uid than {uid} "
                               "(deleted and made again): not prepared")  # fmt: skip
        return claim

    async def _pod_of(self, claim: dict) -> dict:
        """The first pod the claim is reserved for that is bound to this node."""
        namespace = (claim.get("metadata") or {}).get("namespace", "")
        reserved = reserved_pods(claim)
        for pod_name, pod_uid in reserved:
            try:
                pod = await self.cluster.get_pod(namespace, pod_name)
            except ClusterError:
                continue
            meta = pod.get("metadata") or {}
            if meta.get("uid") == pod_uid and (pod.get("spec") or {}).get("nodeName") == self.node:
                return pod
        who = ", ".join(n for n, _ in reserved) or "no pod"
        raise PrepareError(
            f"ResourceClaim {namespace}/{(claim.get('metadata') or {}).get('name')}"
            f" is reserved for {who}, none of them a pod on {self.node}"
        )

    def _check_one_claim_per_container(self, record: PreparedClaim) -> None:
        for other in self.records.of_pod(record.pod_uid):
            shared = set(other.containers) & set(record.containers)
            if other.claim_uid != record.claim_uid and shared:
                raise PrepareError(
                    f"container {record.container or record.container_index} of "
                    f"{record.namespace}/{record.pod} already holds claim {other.name} of "
                    f"{self.dra_name()}: one Tessera claim per container (ask for several "
                    "GPUs with count in one claim)"
                )

    @staticmethod
    def dra_name() -> str:
        from tessera.dra_names import DRIVER_NAME

        return DRIVER_NAME

    async def _make_instances(self, record: PreparedClaim, pod: dict) -> PreparedClaim:
        """The claim's MIG instances, made through dynamic MIG with the pod's allocation in the
        ledger (planned, then created: the reconcile keeps what the ledger wants)."""
        if self.mig is None:
            raise PrepareError(
                f"ResourceClaim {record.namespace}/{record.name} was allocated MIG partitions, "
                "but this node agent does not run dynamic MIG (migstrategy dynamic takes "
                "effect at its start)")  # fmt: skip
        self.records.put(record)
        try:
            await self._record_in_ledger(record.pod_uid, pod)
            ledger = await bus.read(self.ledger_kv, self.node, NodeLedger)
            allocation = ledger.value.allocations.get(record.pod_uid) if ledger else None
            if allocation is None:
                raise PrepareError(f"pod {record.namespace}/{record.pod}: its allocation is "
                                   "not in the ledger")  # fmt: skip
            made = await self.mig.allocate(allocation)
        except (MigCreateFailed, PrepareError) as exc:
            self.records.drop(record.claim_uid)
            raise PrepareError(str(exc)) from exc
        return with_instances(record, [g for row in made.containers for g in row])

    async def _materialise(self, record: PreparedClaim, pod: dict) -> PreparedClaim:
        """Directory, sealed limits, the MPS daemon when the claim shares by MPS, and the CDI
        spec (file I/O in a worker thread)."""
        node_settings = self.node_settings()
        allocation = accounting.pod_allocation(
            self.node,
            [record],
            container_names=container_names(pod),
            init_count=len((pod.get("spec") or {}).get("initContainers") or []),
            core_policy=node_settings.core_policy,
            priority=task_priority(pod, record.container_index),
        )
        assert allocation is not None
        grants = [d.grant for d in record.devices]
        device_name = f"claim-{record.claim_uid}"
        cdi_id = cdi.device_id(device_name)
        mps = mps_cards(record)
        # the pod's spill opt-in (tessera.io/gpumem-spill) as in extender mode (docs/dra.md)
        limits = hs.limits_for(allocation, record.container_index, node_settings,
                               spill_bytes(pod, record))
        if mps:
            limits = mps_node.accounting_only(limits, mps)

        def make_dir():
            cdir = self.store.prepare(PreparedContainer(
                pod_uid=record.pod_uid, namespace=record.namespace, pod=record.pod,
                container=record.container, index=record.container_index, device_ids=[cdi_id],
                grants=grants,
            ))  # fmt: skip
            seal_limits(cdir.limits_dir, limits)
            return cdir

        cdir = await asyncio.to_thread(make_dir)
        if limits.lease and self.lease_ready is not None:
            await self.lease_ready(cdir.limits_dir)
        if all(g.mig is not None for g in grants):  # MIG instances only: no libvgpu
            ctx = GrantContext(devices={}, settings=node_settings, priority=allocation.priority,
                               core_policy=allocation.core_policy)  # fmt: skip
            env, mounts = MIG_KIND.container_edits(grants, ctx).env, []
        else:
            env = hs.container_env(allocation, grants, node_settings)
            preload = self.settings.preload_host_path or str(self.store.preload_file)
            mounts = hs.container_mounts(cdir, self.settings, preload)
        if mps:
            env = {**env, **mps_env(grants, mps)}
            mounts = [*mounts, (PIPE_CONTAINER_DIR, str(await self._mps_daemon(
                record, cdir, allocation, mps)), False)]  # fmt: skip
        spec = cdi.build_spec(device_name, env, mounts)
        await asyncio.to_thread(cdi.write_spec, self.dra.cdi_dir, record.claim_uid, spec)
        return record.model_copy(update={"cdi_device": cdi_id})

    async def _mps_daemon(self, record: PreparedClaim, cdir, allocation, cards: set[str]):
        """The container's own control daemon, limited to the claim's share before the
        container can exist; its pipe directory."""
        if self.mps is None:
            raise PrepareError("MPS sharing is configured, but this node agent runs no MPS "
                               "control daemons")  # fmt: skip
        pipes = []
        for uuid in sorted(cards):
            try:
                pipes.append(await self.mps.limit_now(cdir, allocation, uuid))
            except mps_node.MpsError as exc:
                await asyncio.to_thread(self.store.remove_container, cdir)
                raise PrepareError(f"ResourceClaim {record.namespace}/{record.name}: MPS "
                                   f"limits not set on {uuid}: {exc}") from exc
        return pipes[0]

    # --- unprepare -------------------------------------------------------------------------

    async def unprepare(self, namespace: str, name: str, uid: str) -> None:
        async with self._lock:
            record = self.records.get(uid)
            cdi.remove_spec(self.dra.cdi_dir, uid)
            if record is None:
                return  # never prepared here, or already unprepared: nothing to free
            await asyncio.to_thread(self._scrub, record)
            self.records.drop(uid)
            if mig_devices(record):
                await self._free_instances(record)
            elif self.records.of_pod(record.pod_uid):
                # the pod keeps other claims: its allocation and charge shrink to them
                await self._record_in_ledger(record.pod_uid)
                try:
                    await self._hold_quota(record, self.records.of_pod(record.pod_uid), None)
                except PrepareError as exc:
                    self.log.warning("quota charge not reduced", extra={"err": str(exc)})
            # Its last claim: the pod has ended (kubelet unprepares a pod's claims once it is
            # gone). The scheduler's release of an ended pod takes the allocation out of the
            # ledger, frees its quota charge and publishes alloc.<node>.released, as for every
            # pod: that event is the scheduler's to publish (the quota service frees charges on
            # it), never a node's.
            self.log.info(
                "claim unprepared",
                extra={"claim": f"{namespace}/{name}", "pod": f"{record.namespace}/{record.pod}"},
            )

    async def _free_instances(self, record: PreparedClaim) -> None:
        """The claim's MIG instances leave the pod's ledger entry (the pod's other claims stay;
        none left: the entry stays, holding nothing, for the scheduler's release) and are
        destroyed now: the allocator may give the placement to the next claim at once."""
        held = self.records.of_pod(record.pod_uid)
        if held:
            await self._record_in_ledger(record.pod_uid)
        else:
            try:
                await bus.cas_update(self.ledger_kv, self.node, NodeLedger,
                                     accounting.emptied_mutation(record.pod_uid))
            except bus.NoChange:
                pass
            except Exception as exc:
                raise PrepareError(f"the ledger could not be written ({exc}); kubelet "
                                   "retries") from exc
        if held:
            try:
                await self._hold_quota(record, held, None)
            except PrepareError as exc:
                self.log.warning("quota charge not reduced", extra={"err": str(exc)})
        if self.mig is not None:
            try:
                await self.mig.reconcile_once()
            except Exception as exc:  # its periodic pass retries
                self.log.warning("MIG instances not destroyed yet", extra={"err": str(exc)})

    def _scrub(self, record: PreparedClaim) -> None:
        """The claim's directory goes (sealed limits, region, lease socket), whichever pod it is
        labelled for: a hand-on relabels it before it writes the record, so an agent stopped
        between the two leaves it labelled for the next pod while the record names the ended
        one (kubelet unpreparing before the agent's first reconcile must still scrub it). The
        CDI device names the claim (`claim-<uid>`), so it finds only this claim's."""
        for cdir in self.store.by_devices([record.cdi_device]):
            self.store.remove_container(cdir)

    async def _hold_quota(self, record: PreparedClaim, held: list[PreparedClaim],
                          pod: dict | None, handed_from: str = "",
                          handed_from_keeps: list[PreparedClaim] | None = None
                          ) -> None:  # fmt: skip
        """The pod's charge made what `held` books; `handed_from`: in the same write that pod's
        charge shrinks to what `handed_from_keeps` books (nothing: freed)."""
        if self.quota is None:
            return
        allocation = self._charged(held, pod)
        keeps = self._charged(handed_from_keeps or [], None) if handed_from else None
        try:
            await self.quota.hold(record.namespace, record.pod_uid, record.pod, allocation,
                                  handed_from, keeps)  # fmt: skip
        except QuotaRefused as exc:
            raise PrepareError(str(exc)) from exc

    def _charged(self, held: list[PreparedClaim], pod: dict | None):
        held = booked(held)
        return accounting.pod_allocation(
            self.node, held, container_names=container_names(pod) if pod else [],
            init_count=len(((pod or {}).get("spec") or {}).get("initContainers") or []),
        ) if held else None  # fmt: skip

    # --- the ledger and the event stream -----------------------------------------------------

    async def _record_in_ledger(self, pod_uid: str, pod: dict | None = None) -> None:
        await self._write_ledger(await self._ledger_body(pod_uid, pod))

    async def _ledger_body(self, pod_uid: str, pod: dict | None = None,
                           claims: list[PreparedClaim] | None = None):  # fmt: skip
        """CAS body: the pod's allocation as its booked claims here make it (gone: none);
        `claims`: those instead of the records' (a hand-on, before its record is written)."""
        held = booked(self.records.of_pod(pod_uid) if claims is None else claims)
        if not held:
            return accounting.drop_mutation(pod_uid)
        names = container_names(pod) if pod else []
        init = len(((pod or {}).get("spec") or {}).get("initContainers") or [])
        existing = await bus.read(self.ledger_kv, self.node, NodeLedger)
        before = existing.value.allocations.get(pod_uid) if existing else None
        first = min(r.container_index for r in held)
        priority = task_priority(pod, first) if pod else 1
        if pod is None and before is not None:
            names, init, priority = before.container_names, before.init_count, before.priority
        allocation = accounting.pod_allocation(
            self.node,
            held,
            container_names=names,
            init_count=init,
            priority=priority,
            core_policy=self.node_settings().core_policy,
            quota_held=self.quota is not None and self.quota.enabled,
        )
        assert allocation is not None
        return accounting.put_mutation(self.node, allocation)

    async def _write_ledger(self, body) -> None:
        try:
            await bus.cas_update(self.ledger_kv, self.node, NodeLedger, body)
        except bus.NoChange:
            return
        except ValueError as exc:
            raise PrepareError(str(exc)) from exc
        except Exception as exc:
            raise PrepareError(f"the ledger could not be written ({exc}); kubelet retries") from exc

    async def _publish(self, action: str, record: PreparedClaim, pod: dict | None) -> None:
        """In the background: kubelet's answer never waits on the event stream (its publish
        retries while JetStream is away; the ledger already says what happened)."""
        task = asyncio.create_task(self._publish_now(action, record))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish_now(self, action: str, record: PreparedClaim) -> None:
        event = AllocationEvent(
            event_id=f"{record.pod_uid}:dra:{record.claim_uid}:{action}",
            action=action,  # type: ignore[arg-type]
            node=self.node, pod_uid=record.pod_uid, namespace=record.namespace, name=record.pod,
            containers=[[d.grant for d in record.devices]], source=self.source,
            reason=f"ResourceClaim {record.namespace}/{record.name} "
            f"{'prepared' if action == 'allocated' else 'unprepared'} by {self.dra_name()}",
        )  # fmt: skip
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            self.log.warning("DRA event not published", extra={"err": str(exc)})

    async def reconcile(self) -> None:
        """After a restart, or a ledger lost or rebuilt without them: every prepared claim's
        pod, while it runs, in the ledger (a pod that ended is the scheduler's to release; a
        claim it shared with another pod of this node is handed on to that pod)."""
        pods = {r.pod_uid: r for r in self.records.all()}
        for pod_uid, record in sorted(pods.items()):
            try:
                pod = await self.cluster.get_pod(record.namespace, record.pod)
            except NotFoundError:
                pod = None
            except ClusterError:
                continue  # unreadable now: next round
            meta, status = (pod or {}).get("metadata") or {}, (pod or {}).get("status") or {}
            if pod is None or meta.get("uid") != pod_uid or status.get("phase") in (
                    "Succeeded", "Failed"):  # fmt: skip
                for claim in self.records.of_pod(pod_uid):
                    await self._hand_on(claim)
                continue
            async with self._lock:
                try:
                    await self._record_in_ledger(pod_uid, pod)
                except PrepareError as exc:
                    self.log.warning("DRA allocation not restored", extra={"err": str(exc)})
