"""Dynamic MIG on the node, wired to the ledger: instances made at Allocate, destroyed on release,
reconciled after a restart.

- `allocate(pod)` (from the device plugin's Allocate): the pod's instances are created through
  `MigReconciler` (NVML, or the static source's simulation) and recorded in its grants
  (`mig_uuid`, state `created`); the container gets their MIG UUIDs. When NVML refuses (no room,
  an operator's instance in the way), the allocation is marked `failed` with NVML's reason, so
  it no longer holds capacity; `alloc.<node>.failed` and a Warning event on the pod say why, and
  the Allocate is refused with the same sentence (kubelet fails the pod; the scheduler then
  releases its quota).
- `run()` reconciles every `interval_s`: an instance whose allocation was released is destroyed
  at once (IN_USE: retried next pass), one nobody ever claimed after `mig_orphan_grace_s`; an
  allocated pod whose instance is gone is reported (`mig.vanished`, its grant marked `vanished`,
  a Warning event), never silently remade. After an agent restart the first pass adopts the
  instances the ledger names (by MIG UUID: someone else's instance at the same place is never
  handed to a pod).

The ledger side (`wanted`, the CAS bodies) is pure and tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tessera import bus
from tessera.cluster.port import ClusterPort, ObjectRef
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    DeviceGrant,
    MigState,
    NodeLedger,
    now,
)

from .mig_dynamic import MigReconciler, Outcome, Wanted

Place = tuple[str, str, int]  # GPU uuid, profile, start


class MigCreateFailed(Exception):
    """NVML refused an instance of the pod being allocated; the message says why."""


# --- the ledger side (pure) ------------------------------------------------------------------


def place_of(grant: DeviceGrant) -> Place:
    assert grant.mig is not None
    return grant.uuid, grant.mig.profile, grant.mig.start


def wanted(ledger: NodeLedger | None, allocating: Iterable[str] = ()) -> list[Wanted]:
    """The instances the node's active allocations hold. Those of `allocating` pods are due
    (created when missing); a grant already `created` whose instance is missing has vanished;
    other planned grants are pending (kept when there, not made yet). Grants marked vanished or
    failed want nothing."""
    due = set(allocating)
    out: list[Wanted] = []
    for allocation in (ledger.allocations.values() if ledger else ()):
        if not allocation.active:
            continue
        for g in allocation.mig_grants():
            state = g.mig.state  # type: ignore[union-attr]
            if state in (MigState.VANISHED, MigState.FAILED):
                continue
            mine = allocation.pod_uid in due
            out.append(Wanted(
                allocation.pod_uid, *place_of(g),
                present_before=state == MigState.CREATED and not mine,
                pending=state == MigState.PLANNED and not mine,
                mig_uuid=g.mig.mig_uuid if state == MigState.CREATED else "",  # type: ignore
            ))  # fmt: skip
    return out


def _with_grants(
    ledger: NodeLedger | None, pod_uid: str, change: Callable[[DeviceGrant], DeviceGrant | None]
) -> NodeLedger:
    """A copy of `ledger` with `change` applied to pod_uid's MIG grants (None: unchanged);
    bus.NoChange when nothing changes."""
    allocation = ledger.allocations.get(pod_uid) if ledger else None
    if ledger is None or allocation is None or not allocation.active:
        raise bus.NoChange
    changed = False
    containers = []
    for grants in allocation.containers:
        row = []
        for g in grants:
            new = change(g) if g.mig is not None else None
            changed = changed or new is not None
            row.append(new or g)
        containers.append(row)
    if not changed:
        raise bus.NoChange
    out = ledger.model_copy(deep=True)
    out.allocations[pod_uid] = allocation.model_copy(
        update={"containers": containers, "updated_at": now()})
    return out


def created_mutation(pod_uid: str, made: dict[Place, str]) -> Callable[[NodeLedger | None],
                                                                        NodeLedger]:
    """Record the MIG UUIDs of the pod's instances (`made`: place -> MIG uuid)."""

    def change(g: DeviceGrant) -> DeviceGrant | None:
        uuid = made.get(place_of(g))
        if uuid is None or (g.mig.mig_uuid == uuid and g.mig.state == MigState.CREATED):
            return None
        return g.model_copy(update={"mig": g.mig.model_copy(
            update={"mig_uuid": uuid, "state": MigState.CREATED})})

    return lambda ledger: _with_grants(ledger, pod_uid, change)


def vanished_mutation(pod_uid: str, places: set[Place]) -> Callable[[NodeLedger | None],
                                                                    NodeLedger]:
    def change(g: DeviceGrant) -> DeviceGrant | None:
        if place_of(g) not in places or g.mig.state != MigState.CREATED:
            return None
        return g.model_copy(update={"mig": g.mig.model_copy(update={"state": MigState.VANISHED})})

    return lambda ledger: _with_grants(ledger, pod_uid, change)


def failed_mutation(pod_uid: str, reason: str) -> Callable[[NodeLedger | None], NodeLedger]:
    """The allocation is `failed` with the reason (it holds no capacity any more), its planned
    instances `failed`, its in-flight claim dropped."""

    def mutate(ledger: NodeLedger | None) -> NodeLedger:
        allocation = ledger.allocations.get(pod_uid) if ledger else None
        if ledger is None or allocation is None or not allocation.active:
            raise bus.NoChange
        containers = [
            [g.model_copy(update={"mig": g.mig.model_copy(update={"state": MigState.FAILED})})
             if g.mig is not None and g.mig.state == MigState.PLANNED else g for g in grants]
            for grants in allocation.containers
        ]  # fmt: skip
        out = ledger.model_copy(deep=True)
        out.allocations[pod_uid] = allocation.model_copy(update={
            "containers": containers, "state": AllocationState.FAILED, "reason": reason,
            "expires_at": None, "updated_at": now(),
        })  # fmt: skip
        out.claims.pop(pod_uid, None)
        if out.claim is not None and out.claim.pod_uid == pod_uid:
            out.claim = None
        return out

    return mutate


# --- the service ------------------------------------------------------------------------------


class DynamicMig:
    """One node's dynamic MIG instances against its ledger entry (see the module doc)."""

    def __init__(
        self,
        *,
        node: str,
        reconciler: MigReconciler,
        ledger_kv: KeyValue,
        js: JetStreamContext,
        cluster: ClusterPort | None,
        log: logging.Logger,
        source: str = "",
    ) -> None:
        self.node = node
        self.reconciler = reconciler
        self.ledger_kv = ledger_kv
        self.js = js
        self.cluster = cluster
        self.log = log
        self.source = source or f"node-agent/{node}"
        self._lock = asyncio.Lock()

    async def _ledger(self) -> NodeLedger | None:
        current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        return current.value if current else None

    async def allocate(self, allocation: Allocation) -> Allocation:
        """Make the pod's instances; the allocation as recorded afterwards (grants carry their
        MIG UUIDs). MigCreateFailed (allocation marked failed, reason published) when NVML
        refuses one."""
        async with self._lock:
            out = await self.reconciler.reconcile(wanted(await self._ledger(),
                                                         [allocation.pod_uid]))  # fmt: skip
            await self._record(out, allocating=allocation.pod_uid)
            mine = [(w, why) for w, why in out.failed if w.pod_uid == allocation.pod_uid]
            if mine:
                reason = f"pod {allocation.namespace}/{allocation.name}: {mine[0][1]}"
                await self._fail(allocation, reason)
                raise MigCreateFailed(reason)
            ledger = await self._ledger()
            current = ledger.allocations.get(allocation.pod_uid) if ledger else None
            if current is None or not current.active:
                raise MigCreateFailed(f"pod {allocation.namespace}/{allocation.name}: its "
                                      "allocation is gone")  # fmt: skip
            missing = [g for g in current.mig_grants() if not g.mig.mig_uuid]  # type: ignore
            if missing:
                raise MigCreateFailed(f"pod {allocation.namespace}/{allocation.name}: MIG "
                                      f"instance {missing[0].mig.profile} on "  # type: ignore
                                      f"{missing[0].uuid} was not made")  # fmt: skip
            return current

    async def reconcile_once(self) -> Outcome:
        async with self._lock:
            out = await self.reconciler.reconcile(wanted(await self._ledger()))
            await self._record(out)
            return out

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        while not stop.is_set():
            try:
                await self.reconcile_once()
            except Exception:  # the agent keeps serving; the next pass retries
                self.log.exception("dynamic MIG reconcile failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    async def _record(self, out: Outcome, allocating: str = "") -> None:
        """Write what NVML holds into the grants: created and adopted instances' UUIDs (the
        pod being allocated, or one whose Allocate was cut short), vanished ones."""
        made: dict[str, dict[Place, str]] = {}
        for w, device in [*out.created, *out.matched]:
            if not (w.pending or w.present_before) or w.pod_uid == allocating:
                made.setdefault(w.pod_uid, {})[w.place] = device.uuid
        for pod_uid, places in made.items():
            await self._cas(created_mutation(pod_uid, places))
        gone: dict[str, set[Place]] = {}
        for w in out.vanished:
            gone.setdefault(w.pod_uid, set()).add(w.place)
        for pod_uid, places in gone.items():
            if await self._cas(vanished_mutation(pod_uid, places)):
                ledger = await self._ledger()
                allocation = ledger.allocations.get(pod_uid) if ledger else None
                if allocation is not None:
                    held = ", ".join(f"{p}@{s} on {u}" for u, p, s in sorted(places))
                    await self._pod_event(allocation, "MigInstanceVanished",
                                          f"MIG instance(s) {held} vanished (reboot or manual "
                                          "change); not remade under the running pod")

    async def _cas(self, mutation: Callable[[NodeLedger | None], NodeLedger]) -> bool:
        try:
            await bus.cas_update(self.ledger_kv, self.node, NodeLedger, mutation)
        except bus.NoChange:
            return False
        return True

    async def _fail(self, allocation: Allocation, reason: str) -> None:
        self.log.warning("MIG instance not created", extra={"reason": reason})
        await self._cas(failed_mutation(allocation.pod_uid, reason))
        event = AllocationEvent(
            event_id=f"{allocation.pod_uid}:mig-failed", action="failed", node=self.node,
            pod_uid=allocation.pod_uid, namespace=allocation.namespace, name=allocation.name,
            containers=allocation.containers, reason=reason, source=self.source,
        )
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            self.log.warning("failed event not published", extra={"err": str(exc)})
        await self._pod_event(allocation, "MigInstanceFailed", reason)

    async def _pod_event(self, allocation: Allocation, reason: str, message: str) -> None:
        if self.cluster is None:
            return
        try:
            await self.cluster.record_event(
                ObjectRef(namespace=allocation.namespace, name=allocation.name,
                          uid=allocation.pod_uid), reason, message, "Warning")  # fmt: skip
        except Exception as exc:  # best effort, as every Event
            self.log.warning("pod event not recorded", extra={"err": str(exc)})
