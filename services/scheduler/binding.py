"""Bind: make sure the pod holds a reservation on the node, put it in the node's in-flight set
(waiting only while pods of another shape are in flight there), write HAMi's annotations and bind
in the cluster, then mark the allocation bound in the ledger. A failed cluster bind releases the
allocation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tessera import elastic, hami
from tessera.bus import CasConflictError, NoChange, Versioned
from tessera.cluster.port import ClusterError, ClusterPort, ConflictError
from tessera.device_kinds import pod_grants
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
    allocation_shape,
)

from .background import EventPublisher
from .config import SchedulerSettings
from .filtering import PodFilter
from .indexed_ledger import IndexedLedger
from .ledger import (
    AlreadyBoundError,
    ClaimHeldError,
    ReservationGoneError,
    RoomTakenError,
    claimed_ahead,
    competing_claim,
    first_request,
)
from .metrics import SchedulerMetrics
from .pods import PodIdentity, allocation_live
from .release import AllocationReleaser

log = logging.getLogger("tessera.scheduler")

_NO_GPU = "\0no-gpu"  # _ensure_reserved's answer for a pod that asks for no GPU


FAIR_AFTER_S = 3.0


class _QueuedError(Exception):
    """A bind of another shape waits for this node ahead of this one."""

    def __init__(self, ahead_uid: str) -> None:
        super().__init__(f"pod {ahead_uid}, of another shape, waits for it first")


class PodBinder:
    def __init__(
        self,
        *,
        config: SchedulerSettings,
        ledger: IndexedLedger,
        cluster: ClusterPort | None,
        pod_filter: PodFilter,
        releaser: AllocationReleaser,
        publisher: EventPublisher,
        metrics: SchedulerMetrics,
        instance: str,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.index = ledger.index
        self.cluster = cluster
        self.pod_filter = pod_filter
        self.releaser = releaser
        self.publisher = publisher
        self.metrics = metrics
        self.instance = instance
        self.clock = clock
        # node -> binds waiting to join its in-flight set, in arrival order: (uid, shape, since)
        self._waiting: dict[str, list[tuple[str, tuple | None, float]]] = {}

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """'' on success, else the error text kube-scheduler shows."""
        if not self.cluster:
            return "no cluster API configured: this scheduler cannot bind pods"
        if not uid:
            try:
                uid = (await self.cluster.get_pod(namespace, name))["metadata"]["uid"]
            except (ClusterError, KeyError) as exc:
                return f"pod {namespace}/{name}: {exc}"
        ident = PodIdentity(uid, namespace, name)
        error = await self._ensure_reserved(ident, node)
        if error == _NO_GPU:
            return await self._bind_plain(ident, node)
        if error:
            return error
        deadline = self.clock() + self.config.bind_timeout_s
        try:
            return await self._bind_claimed(ident, node, deadline)
        finally:
            self._leave_queue(node, uid)

    async def _bind_claimed(self, ident: PodIdentity, node: str, deadline: float) -> str:
        uid, namespace, name = ident.uid, ident.namespace, ident.name
        waited = False
        ahead_of_time = self._claimed_ahead(node, uid)
        result = ahead_of_time
        while result is None:
            now = self.clock()
            try:
                # Decided on the index first: a waiting bind wakes on every change of the node's
                # entry and must not pay a KV read and decode for each (the watch decoded it).
                held = self._competitor(node, uid, now)
                if held is not None:
                    raise ClaimHeldError(held)
                ahead = self._queued_ahead(node, uid)
                if ahead is not None:
                    raise _QueuedError(ahead)
                async with self.ledger.lock(node):
                    result = await self.ledger.writer.claim(
                        node, uid, self.instance, now, self.config.claim_ttl_s,
                        self.ledger.hint(node), self.config.max_in_flight_per_node,
                        self._registration(node), self.index.foreign_allocations(node),
                    )  # fmt: skip
            except (ClaimHeldError, _QueuedError) as exc:
                if not waited:
                    self.metrics.claim_waits.inc()
                    waited = True
                self._join_queue(node, uid)
                remaining = deadline - now
                if remaining <= 0:
                    return f"node {node} is busy: {exc}; retry"
                until = (exc.claim.expires_at - now + 0.01 if isinstance(exc, ClaimHeldError)
                         else 0.5)  # fmt: skip
                await self.index.wait_changed(node, min(remaining, until))
            except ReservationGoneError as exc:
                # Our reservation lapsed while we waited for the claim: take a fresh one if
                # the pod still fits the node, and keep waiting within the same deadline.
                if self.clock() >= deadline:
                    return f"pod {namespace}/{name} on {node}: {exc}; it will be filtered again"
                error = await self._ensure_reserved(ident, node, trust_index=False)
                if error:
                    return error
                await asyncio.sleep(0.01)  # never a tight loop, whatever the ledger says
            except AlreadyBoundError:
                return ""
            except CasConflictError as exc:
                return f"ledger busy on {node}: {exc}"
        self._leave_queue(node, uid)
        if result is not ahead_of_time:  # (the index holds the filter's write already)
            self.ledger.apply(node, result)
        allocation = result.value.allocations[uid]
        error = await self._bind_in_cluster(ident, node, allocation)
        if error:
            await self.releaser.release(node, uid, why=f"bind failed: {error}")
            return error
        if not await self._leave_mark(ident, node):
            error = await self._mark_bound(node, uid)
            if error:
                await self._withdraw_grant(ident, node, error)
                return error
        self.metrics.bound.inc()
        self.publisher.publish_soon(AllocationEvent(
            event_id=f"{uid}:bound", action="bound", node=node, pod_uid=uid,
            namespace=namespace, name=name, containers=allocation.containers,
            source=self.instance,
        ))  # fmt: skip
        return ""

    # --- fairness among waiting binds (this replica's) --------------------------------------
    # Pods of one shape join a node's in-flight set without waiting; a steady stream of them
    # would starve a pod of another shape waiting for the set to drain. So once a bind of
    # another shape has waited FAIR_AFTER_S, later binds queue behind it: the set drains, the
    # waiter goes in flight, and the node alternates between shapes. Shorter waits hold nobody
    # back (most waits end within one kubelet round trip).

    def _shape(self, node: str, uid: str) -> tuple | None:
        """(first device count, shape): what ledger.competes compares."""
        hint = self.ledger.hint(node)
        allocation = hint.value.allocations.get(uid) if hint is not None else None
        if allocation is None:
            return None
        return first_request(allocation), allocation_shape(allocation)

    def _join_queue(self, node: str, uid: str) -> None:
        queue = self._waiting.setdefault(node, [])
        if all(w[0] != uid for w in queue):
            queue.append((uid, self._shape(node, uid), self.clock()))

    def _leave_queue(self, node: str, uid: str) -> None:
        queue = self._waiting.get(node)
        if not queue:
            return
        kept = [w for w in queue if w[0] != uid]
        if len(kept) != len(queue):
            self.index.notify(node)  # those behind it look again
        if kept:
            self._waiting[node] = kept
        else:
            del self._waiting[node]

    def _queued_ahead(self, node: str, uid: str) -> str | None:
        """A bind of another shape that started waiting for this node before this one."""
        queue = self._waiting.get(node)
        if not queue:
            return None
        mine = self._shape(node, uid)
        now = self.clock()
        for other, shape, since in queue:
            if other == uid:
                return None
            competing = shape is not None and mine is not None and (
                shape[0] == mine[0] and shape[1] != mine[1]
            )
            if competing and now - since >= FAIR_AFTER_S:
                return other
        return None

    def _claimed_ahead(self, node: str, uid: str) -> Versioned[NodeLedger] | None:
        """The node's entry when the pod's filter already put it in flight there (ledger
        .ClaimAhead) with time to spare: the bind then writes no claim of its own."""
        hint = self.ledger.hint(node)
        if hint is None or not claimed_ahead(hint.value, uid, self.clock(),
                                             self.config.claim_ttl_s):  # fmt: skip
            return None
        return hint

    def _competitor(self, node: str, uid: str, now: float) -> InFlightClaim | None:
        """The in-flight pod this bind must wait for, as the index sees the node (None: try)."""
        hint = self.ledger.hint(node)
        if hint is None or uid not in hint.value.allocations:
            return None  # the CAS decides on a fresh read
        return competing_claim(hint.value, uid, now, self.config.max_in_flight_per_node,
                               self._registration(node),
                               self.index.foreign_allocations(node))  # fmt: skip

    def _registration(self, node: str) -> NodeRegistration | None:
        entry = self.index.entries.get(node)
        return entry.registration if entry is not None else None

    async def _leave_mark(self, ident: PodIdentity, node: str) -> bool:
        """Whether the `bound` mark may be left out of this bind (one ledger write per pod
        fewer: reserve, then the node agent's `allocated`, which it takes from `reserved` as
        from `bound`), judged on the entry as this replica holds it (no read: a KV read costs
        the NATS server about what the write did, more on a large bucket whose blocks are not
        cached). Only while nothing can take the pod's room meanwhile: it is in flight (its
        claim is what the agent serves) and its reservation and claim both have at least half
        a claim's time left, so neither lapses before the sweeper marks it bound after
        `orphaned_bind_s` if the Allocate has not come (`AllocationReleaser.bound_unmarked`; any
        replica does so, asking the cluster, if this one dies). A release this replica has not
        seen yet (what the mark's CAS would have found: `RoomTakenError`'s case) is found by the
        sweeper instead, which withdraws the grant as the bind would have
        (`AllocationReleaser._forget_marked`); until then the agent serves the pod nothing, its
        allocation being gone. Never for a preemption nominee (giving up a nomination drops a
        `reserved` nominee). False: the bind marks it as before (`_mark_bound`)."""
        if self.config.mark_bound_at_bind:
            return False
        hint = self.ledger.hint(node)
        if hint is None:
            return False
        ledger = hint.value
        uid = ident.uid
        allocation, claim = ledger.allocations.get(uid), ledger.in_flight().get(uid)
        now = self.clock()
        spare = max(self.config.claim_ttl_s / 2, 2 * self.config.orphaned_bind_s)
        if (allocation is None or claim is None or allocation.state != AllocationState.RESERVED
                or allocation.expires_at is None or allocation.expires_at - now < spare
                or claim.expires_at - now < spare):  # fmt: skip
            return False
        for other in ledger.allocations.values():  # (a plain loop: no generator per bind)
            if other.preempted_by == uid:
                return False
        self.releaser.bound_unmarked[uid] = (node, ident.namespace, ident.name)
        return True

    async def _mark_bound(self, node: str, uid: str, attempts: int = 3) -> str:
        """Record the cluster bind in the ledger. The pod is bound whatever happens here, so a
        failure (NATS away) is retried, then left to the sweeper, which adopts binds the cluster
        shows; it never turns into a bind error kube-scheduler would act on. The one exception
        (the error text returned): the reservation lapsed during the cluster bind and its room
        was given to other pods meanwhile (ledger.RoomTakenError), or the reservation is gone."""
        for attempt in range(1, attempts + 1):
            try:
                async with self.ledger.lock(node):
                    bound = await self.ledger.writer.mark_bound(
                        node, uid, self.clock(), self.ledger.hint(node), self._registration(node),
                        self.index.foreign_allocations(node),
                    )
                self.ledger.apply(node, bound)
                return ""
            except NoChange:
                return ""  # already bound, or the node agent has marked it allocated
            except ReservationGoneError as exc:
                # Swept as lapsed before the cluster bind showed (or the pod was deleted): its
                # room may be another pod's now, so the grant on the pod is not its own.
                log.warning("mark bound: reservation gone", extra={"pod_uid": uid, "err": str(exc)})
                return f"pod {uid}: its reservation was gone when the bind was recorded ({exc})"
            except RoomTakenError as exc:
                return str(exc)
            except Exception as exc:
                log.warning("mark bound failed", extra={"pod_uid": uid, "attempt": attempt,
                                                        "err": str(exc)})  # fmt: skip
                await asyncio.sleep(0.05 * attempt)
        return ""

    async def _withdraw_grant(self, ident: PodIdentity, node: str, why: str) -> None:
        """The pod is bound in the cluster, but the grant it was bound with is no longer its
        own (RoomTakenError). It must never run with limits for memory it was not granted: its
        allocation leaves the ledger and its annotations lose the grant (`withdraw_grant`)."""
        await self.releaser.release(node, ident.uid, why=why)
        await self.releaser.withdraw_grant(ident.namespace, ident.name, why)

    async def _ensure_reserved(
        self, ident: PodIdentity, node: str, *, trust_index: bool = True
    ) -> str:
        """The pod must hold a live reservation on `node`; make one if filter did not (the
        side-effect-free path, another replica's expired one, a different node)."""
        now = self.clock()
        entry = self.index.entries.get(node)
        known = entry.ledger.allocations.get(ident.uid) if entry and entry.ledger else None
        if trust_index and known is not None and allocation_live(known, now):
            return ""  # our index saw the reservation (ours, or a replica's via the watch)
        current = await self.ledger.read(node)
        existing = current.value.allocations.get(ident.uid) if current is not None else None
        if existing is not None and allocation_live(existing, now):
            return ""
        held = self.index.pod_nodes.get(ident.uid)
        if held is not None and held != node:
            await self.releaser.release(held, ident.uid, why=f"kube-scheduler bound it to {node}")
        assert self.cluster is not None
        try:
            pod = await self.cluster.get_pod(ident.namespace, ident.name)
        except ClusterError as exc:
            return f"pod {ident.namespace}/{ident.name}: {exc}"
        outcome = await self.pod_filter.filter(pod, [node])
        if outcome.passed_all:
            return _NO_GPU
        if outcome.nodenames == [node]:
            return ""
        reasons = outcome.failed.get(node) or outcome.unresolvable.get(node) or outcome.error
        return f"pod {ident.namespace}/{ident.name} does not fit {node}: {reasons}"

    async def _bind_plain(self, ident: PodIdentity, node: str) -> str:
        """A pod that asks for no GPU: bind it, nothing to record."""
        assert self.cluster is not None
        try:
            await self.cluster.bind_pod(ident.namespace, ident.name, ident.uid, node)
        except ClusterError as exc:
            return f"bind {ident.namespace}/{ident.name} to {node}: {exc}"
        return ""

    async def _bind_in_cluster(self, ident: PodIdentity, node: str, allocation: Allocation) -> str:
        assert self.cluster is not None
        now = str(int(self.clock()))
        try:
            await self.cluster.patch_pod_metadata(
                ident.namespace,
                ident.name,
                annotations={
                    # each held family's -devices-to-allocate, as HAMi's PatchAnnotations
                    **pod_grants.grant_annotations(allocation.containers,
                                                   (pod_grants.TO_ALLOCATE,)),
                    hami.ANN_VGPU_NODE: node,
                    hami.ANN_VGPU_TIME: now,
                    hami.ANN_BIND_TIME: now,
                    hami.ANN_BIND_PHASE: hami.BIND_PHASE_ALLOCATING,
                    # dynamic MIG placements, for a ledger rebuilt from the cluster
                    **({hami.ANN_MIG_INSTANCES: mig}
                       if (mig := hami.encode_mig_instances(allocation.containers)) else {}),
                    # elastic burst limits, for a ledger rebuilt from the cluster
                    **({elastic.ANN_BURST_ALLOCATED: burst}
                       if (burst := elastic.encode_burst(allocation.containers)) else {}),
                },
                labels={hami.LABEL_VGPU_NODE: node},
            )
            await self.cluster.bind_pod(ident.namespace, ident.name, ident.uid, node)
        except ConflictError as exc:
            with contextlib.suppress(ClusterError):
                pod = await self.cluster.get_pod(ident.namespace, ident.name)
                if (pod.get("spec") or {}).get("nodeName") == node:
                    return ""  # a retried bind that already happened
            return f"bind {ident.namespace}/{ident.name} to {node}: {exc}"
        except (ClusterError, ValueError) as exc:
            with contextlib.suppress(ClusterError):
                await self.cluster.patch_pod_metadata(
                    ident.namespace, ident.name,
                    annotations={hami.ANN_BIND_PHASE: hami.BIND_PHASE_FAILED},
                )  # fmt: skip
            return f"bind {ident.namespace}/{ident.name} to {node}: {exc}"
        return ""
