"""Handing a shared claim on when the pod it is booked under ends (`DraDriver`'s part).

A ResourceClaim reserved for several pods of the node is prepared once, for the first, and the
driver books its slice under that pod (ledger entry, quota charge; a MIG instance made for it).
kubelet keeps it prepared while any of those pods runs. When the first pod is deleted or
finishes, the scheduler's release keeps its booking (`scheduler/dra_shared.py`) and the driver
books the claim under the next pod it is reserved for that runs here: at once from its pod watch
(`pod_watch.py`), or at its periodic reconcile (the fallback). docs/dra.md says what an
operator sees.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tessera import bus
from tessera.cluster.port import ClusterError
from tessera.models import NodeLedger

from . import accounting
from .claims import PreparedClaim, booked, handed_on, reserved_pods
from .records import ClaimRecords, PrepareError

if TYPE_CHECKING:
    from ..containers import ContainerStore


class HandOn:
    """Mixed into `DraDriver`, which provides the attributes below and the writes the hand-on
    makes: `_hold_quota`, `_ledger_body`, `_write_ledger`, `_publish` (driver.py)."""

    node: str
    cluster: Any
    ledger_kv: Any
    log: logging.Logger
    records: ClaimRecords
    store: ContainerStore
    _lock: asyncio.Lock

    async def pod_ended(self, pod_uid: str) -> None:
        """A pod of this node was deleted or finished (the driver's pod watch: `pod_watch.py`):
        the claims it shared with another pod of the node are handed on now, not at the next
        reconcile (which stays the fallback: a watch event missed or a hand-on that failed)."""
        for claim in self.records.of_pod(pod_uid):
            await self._hand_on(claim)

    def prepared_pods(self) -> set[str]:
        return {r.pod_uid for r in self.records.all()}

    async def _hand_on(self, record: PreparedClaim) -> None:
        """The claim's pod has ended, but kubelet keeps a claim prepared while any pod of the
        node still uses it (a claim reserved for several pods is prepared once, for the first):
        book it under the next pod it is reserved for that runs here. The scheduler keeps the
        ended pod's booking until then (a MIG instance stays wanted), and releases what is left
        of it as for any pod after; without this the slice a running pod holds would stay the
        ended pod's (and its directory would be collected as a gone pod's). Unprepare, when
        the last pod goes, scrubs it as ever."""
        try:
            claim = await self.cluster.get_resource_claim(record.namespace, record.name)
        except ClusterError:
            return  # gone: kubelet unprepares it; unreadable: next round
        for name, _uid in reserved_pods(claim):
            try:
                pod = await self.cluster.get_pod(record.namespace, name)
            except ClusterError:
                continue
            moved = handed_on(record, claim, pod, self.node)
            if moved is not None:
                break
        else:
            return  # no other pod of this node holds it: the ended pod's, released as ever
        async with self._lock:
            if self.records.get(record.claim_uid) != record:
                return  # unprepared or handed on meanwhile
            await self._move(record, moved, pod)

    async def _move(self, record: PreparedClaim, moved: PreparedClaim, pod: dict) -> None:
        """The scheduler keeps the ended pod's booking while the claim is reserved for a pod
        running here (scheduler/dra_shared.py), so the slice never leaves the ledger or the
        quota. Each step is one write and idempotent, in an order a restart anywhere between
        them repeats from the start (the record, last, says whose the claim is):
        1. the quota: one write holds the next pod's charge and frees exactly the handed
           claim's part of the ended pod's (shrunk to its other claims, if any): counted once at
           every moment, and a namespace at its limit hands on too;
        2. the claim's directory relabelled to the next pod;
        3. the ledger: one CAS moves the grants;
        4. the record."""
        after = [r for r in self.records.of_pod(moved.pod_uid)
                 if r.claim_uid != moved.claim_uid] + [moved]  # fmt: skip
        rest = [r for r in self.records.of_pod(record.pod_uid)
                if r.claim_uid != record.claim_uid]  # fmt: skip
        try:
            await self._hold_quota(moved, after, pod, await self._handing_from(record),
                                   rest)  # fmt: skip
        except PrepareError as exc:  # kept under the ended pod, counted once: next round
            self.log.warning("shared claim not handed on: its quota charge did not move",
                             extra={"claim": f"{record.namespace}/{record.name}",
                                    "err": str(exc)})  # fmt: skip
            return
        for cdir in self.store.for_pod(record.pod_uid):
            if cdir.prepared.device_ids == [record.cdi_device]:
                await asyncio.to_thread(self.store.relabel, cdir, cdir.prepared.model_copy(
                    update={"pod_uid": moved.pod_uid, "pod": moved.pod,
                            "container": moved.container,
                            "index": moved.container_index}))  # fmt: skip
        to_body = await self._ledger_body(moved.pod_uid, pod, after)
        from_body = (await self._ledger_body(record.pod_uid, None, rest) if booked(rest)
                     else accounting.emptied_mutation(record.pod_uid))  # fmt: skip
        try:
            await self._write_ledger(accounting.in_turn(to_body, from_body))
        except PrepareError as exc:  # the next round moves it (the quota write is done: NoChange)
            self.log.warning("shared claim's ledger entry not moved yet", extra={
                "claim": f"{record.namespace}/{record.name}", "err": str(exc)})  # fmt: skip
            return
        self.records.put(moved)
        await self._publish("allocated", moved, pod)
        self.log.info("shared claim handed on", extra={
            "claim": f"{record.namespace}/{record.name}", "from": record.pod,
            "to": moved.pod})  # fmt: skip

    async def _handing_from(self, record: PreparedClaim) -> str:
        """The ended pod whose charge the hand-on frees in its quota write: while the ledger
        still books it (the scheduler keeps it for the shared claim; the quota service checks
        it). Released already (a hand-on repeated after the scheduler saw it done): its charge
        went with its `released` event, and the next pod's is held alone (idempotent)."""
        try:
            current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        except Exception as exc:
            raise PrepareError(f"the ledger could not be read ({exc})") from exc
        held = current.value.allocations.get(record.pod_uid) if current else None
        return record.pod_uid if held is not None else ""
