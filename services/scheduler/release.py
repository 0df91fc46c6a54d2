"""Taking allocations out of the ledger: a pod that ended (release) and reservations or claims
that lapsed (sweep). Each removal releases the quota charge and publishes `alloc.<node>.released`.

The sweep runs on every replica; CAS makes that safe. Before dropping an expired reservation it
asks the cluster whether the pod is in fact bound to the node (a replica died between the cluster
bind and marking it bound): such a reservation is kept and marked bound instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tessera import hami
from tessera.bus import CasConflictError, NoChange
from tessera.cluster.port import ClusterError, ClusterPort
from tessera.device_kinds import pod_grants
from tessera.dra_names import DRA_REASON
from tessera.models import Allocation, AllocationEvent, AllocationState, NodeLedger

from .background import EventPublisher
from .config import SchedulerSettings
from .dra_shared import shared_in_use
from .indexed_ledger import IndexedLedger
from .ledger import ReservationGoneError, RoomTakenError
from .metrics import SchedulerMetrics
from .quota_client import QuotaClient

log = logging.getLogger("tessera.scheduler")
_ROOM_GONE = "bound in the cluster after its reservation lapsed, and its room was given away"


class AllocationReleaser:
    def __init__(
        self,
        *,
        ledger: IndexedLedger,
        cluster: ClusterPort | None,
        quota: QuotaClient,
        publisher: EventPublisher,
        metrics: SchedulerMetrics,
        config: SchedulerSettings,
        instance: str,
        clock: Callable[[], float],
    ) -> None:
        self.ledger = ledger
        self.cluster = cluster
        self.quota = quota
        self.publisher = publisher
        self.metrics = metrics
        self.config = config
        self.instance = instance
        self.clock = clock
        # uid -> (node, namespace, name): pods this replica bound in the cluster whose `bound`
        # mark it left to the node agent's Allocate (binding.PodBinder._leave_mark); the
        # sweeper marks them bound without asking the cluster if the Allocate has not come
        # after orphaned_bind_s, and withdraws the grant of one whose reservation vanished.
        self.bound_unmarked: dict[str, tuple[str, str, str]] = {}

    async def release(self, node: str, uid: str, *, why: str) -> bool:
        """Remove the pod's allocation (ledger, quota, event). True when this call removed it.
        A DRA booking another pod of the node still uses through a shared claim is kept
        (`dra_shared`): the node's DRA driver hands it on; a later release frees the rest."""
        self.bound_unmarked.pop(uid, None)  # released on purpose: nothing to withdraw later
        if await self._still_shared(node, uid):
            return False
        try:
            async with self.ledger.lock(node):
                result, removed = await self.ledger.writer.release(
                    node, uid, self.ledger.hint(node)
                )
        except CasConflictError as exc:
            log.warning("release lost too many races", extra={"pod_uid": uid, "err": str(exc)})
            return False
        self.ledger.apply(node, result)
        if removed is None:
            return False
        self.metrics.released.inc()
        if removed.quota_held:
            self.quota.release_soon(removed.namespace, uid, removed.name)
        self.publisher.publish_soon(AllocationEvent(
            event_id=f"{uid}:released", action="released", node=node, pod_uid=uid,
            namespace=removed.namespace, name=removed.name, containers=removed.containers,
            reason=why, source=self.instance,
        ))  # fmt: skip
        return True

    async def _still_shared(self, node: str, uid: str) -> bool:
        entry = self.ledger.index.entries.get(node)
        view = entry.view if entry is not None else None
        raw = view.allocations.get(uid) if view is not None else None  # model or wire Struct
        if raw is None or getattr(raw, "reason", "") != DRA_REASON or self.cluster is None:
            return False  # (any other pod: no read, no model built)
        assert entry is not None
        ledger = entry.ledger
        held = ledger.allocations.get(uid) if ledger is not None else None
        if held is None:
            return False
        registration = entry.registration
        devices = registration.devices if registration is not None else []
        claims = await shared_in_use(self.cluster, node, held, ledger, devices)
        if claims:
            log.info("DRA booking kept: a shared claim is still in use on its node", extra={
                "pod": f"{held.namespace}/{held.name}", "node": node, "claims": claims,
            })  # fmt: skip
        return bool(claims)

    async def sweep(self) -> int:
        """Drop every expired reservation and lapsed claim; returns how many pods were dropped."""
        now = self.clock()
        dropped = 0
        await self._forget_marked()
        for entry in self.ledger.index.sweep_candidates():  # not every node: see there
            ledger = entry.ledger
            if ledger is None:
                continue
            await self._adopt_orphaned_bind(entry.name, ledger, now)
            lapsed_claim = any(c.expires_at <= now for c in ledger.in_flight().values())
            due = entry.reserved_until is not None and entry.reserved_until <= now
            if not (due or lapsed_claim):
                continue
            keep = await self._bound_meanwhile(entry.name, ledger, now)
            withdrawn: list[str] = []
            try:
                result, removed = await self.ledger.writer.sweep(
                    entry.name, now, keep, entry.registration, withdrawn,
                    self.ledger.index.foreign_allocations(entry.name),
                )
            except CasConflictError:
                continue
            self.ledger.apply(entry.name, result)
            for allocation in removed:
                if allocation.pod_uid in withdrawn:
                    await self.withdraw_grant(allocation.namespace, allocation.name, _ROOM_GONE)
                dropped += 1
                self.metrics.expired.inc()
                if allocation.quota_held:
                    self.quota.release_soon(allocation.namespace, allocation.pod_uid,
                                            allocation.name)  # fmt: skip
                self.publisher.publish_soon(AllocationEvent(
                    event_id=f"{allocation.pod_uid}:released", action="released",
                    node=entry.name, pod_uid=allocation.pod_uid, namespace=allocation.namespace,
                    name=allocation.name, containers=allocation.containers,
                    reason=_ROOM_GONE if allocation.pod_uid in withdrawn
                    else "reservation expired before bind", source=self.instance,
                ))  # fmt: skip
        return dropped

    async def _bound_meanwhile(self, node: str, ledger: NodeLedger, now: float) -> frozenset[str]:
        """Expired reservations whose pod is in fact bound to the node (a replica died between
        the cluster bind and marking it bound): these are kept and marked bound."""
        keep = set()
        for a in ledger.allocations.values():
            if a.state != AllocationState.RESERVED or a.expires_at is None or a.expires_at > now:
                continue
            if await self._pod_bound_to(a, node):
                keep.add(a.pod_uid)
        return frozenset(keep)

    async def withdraw_grant(self, namespace: str, name: str, why: str) -> None:
        """A pod bound in the cluster whose allocation left the ledger because its room was
        given to others (ledger.RoomTakenError, `sweep_mutate`): its annotations lose the grant
        (so no ledger rebuild from pods restores it), marked failed as HAMi marks a failed bind.
        The node agent serves it no Allocate (the ledger holds nothing for it): kubelet fails its
        admission and its controller makes a new pod."""
        log.warning("bound pod withdrawn: its room was taken", extra={
            "pod": f"{namespace}/{name}", "err": why,
        })  # fmt: skip
        if self.cluster is None:
            return
        try:
            await self.cluster.patch_pod_metadata(namespace, name, annotations={
                hami.ANN_BIND_PHASE: hami.BIND_PHASE_FAILED,
                **dict.fromkeys(pod_grants.role_keys(pod_grants.TO_ALLOCATE)),  # every family's
                hami.ANN_MIG_INSTANCES: None,
            })  # fmt: skip
        except ClusterError as exc:  # the ledger no longer holds it: the agent refuses it anyway
            log.warning("withdrawn grant left on the pod", extra={
                "pod": f"{namespace}/{name}", "err": str(exc),
            })  # fmt: skip

    async def _pod_bound_to(self, allocation: Allocation, node: str) -> bool:
        if self.cluster is None:
            return False
        try:
            pod = await self.cluster.get_pod(allocation.namespace, allocation.name)
        except ClusterError:
            return False
        meta = pod.get("metadata") or {}
        return meta.get("uid") == allocation.pod_uid and (
            (pod.get("spec") or {}).get("nodeName") == node
        )

    async def _forget_marked(self) -> None:
        """Drop from `bound_unmarked` the pods no longer waiting for their mark (allocated or
        marked). One whose allocation vanished (a release this replica's bind had not seen:
        the case the bind's mark CAS refused with ReservationGoneError) loses its grant, as the
        bind would have withdrawn it, when the cluster still has it bound to that node: its
        room may be another pod's now."""
        entries = self.ledger.index.entries
        for uid, (node, namespace, name) in list(self.bound_unmarked.items()):
            entry = entries.get(node)
            if entry is None or entry.ledger is None:
                del self.bound_unmarked[uid]  # the node is gone: nothing runs there
                continue
            held = entry.ledger.allocations.get(uid)
            if held is not None and held.state == AllocationState.RESERVED:
                continue
            del self.bound_unmarked[uid]
            if held is None and await self._still_bound(uid, namespace, name, node):
                await self.withdraw_grant(namespace, name, "its reservation was gone when the "
                                          "bind was to be recorded")  # fmt: skip

    async def _still_bound(self, uid: str, namespace: str, name: str, node: str) -> bool:
        if self.cluster is None:
            return False
        try:
            pod = await self.cluster.get_pod(namespace, name)
        except ClusterError:
            return False
        return (pod.get("metadata") or {}).get("uid") == uid and (
            (pod.get("spec") or {}).get("nodeName") == node
        )

    async def _adopt_orphaned_bind(self, node: str, ledger: NodeLedger, now: float) -> None:
        """A claim's holder is still `reserved` long after taking the claim: its binder died
        between the cluster bind and marking it bound, or (`bound_unmarked`) this replica bound
        it and left the mark to an Allocate that has not come yet. If the pod is bound to the
        node, mark it bound now, so its reservation never lapses under it. (A pod not bound is
        left alone: its binder may just be slow.)"""
        for claim in list(ledger.in_flight().values()):
            if claim.expires_at <= now or now - claim.taken_at < self.config.orphaned_bind_s:
                continue
            held = ledger.allocations.get(claim.pod_uid)
            if held is None or held.state != AllocationState.RESERVED:
                continue
            ours = (self.bound_unmarked.get(held.pod_uid) or ("",))[0] == node
            if not ours and not await self._pod_bound_to(held, node):
                continue
            await self._adopt(node, held, now, announce=not ours)

    async def _adopt(self, node: str, held: Allocation, now: float, announce: bool = True) -> None:
        entry = self.ledger.index.entries.get(node)
        try:
            async with self.ledger.lock(node):
                result = await self.ledger.writer.mark_bound(
                    node, held.pod_uid, now, self.ledger.hint(node),
                    entry.registration if entry is not None else None,
                    self.ledger.index.foreign_allocations(node),
                )
        except (ReservationGoneError, CasConflictError, NoChange):
            return
        except RoomTakenError as exc:  # lapsed, and its room given away: never run on it
            if await self.release(node, held.pod_uid, why=str(exc)):
                await self.withdraw_grant(held.namespace, held.name, str(exc))
            return
        self.ledger.apply(node, result)
        self.bound_unmarked.pop(held.pod_uid, None)
        if not announce:
            return  # its binder announced the bind
        self.publisher.publish_soon(AllocationEvent(
            event_id=f"{held.pod_uid}:bound", action="bound", node=node, pod_uid=held.pod_uid,
            namespace=held.namespace, name=held.name, containers=held.containers,
            reason="adopted: bound in the cluster, its binder did not finish",
            source=self.instance,
        ))  # fmt: skip
