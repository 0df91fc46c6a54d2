"""Keeping quota usage true to the ledger: the reconcile pass and the release-event consumer.

A crash anywhere between the scheduler's reservation and its release must neither leak quota
(a charge nobody will ever release) nor count a pod twice. Two mechanisms, both idempotent:
- the durable consumer frees a pod's charge when its allocation is released on any node;
- the reconcile pass (at start and periodically) compares every namespace's charges with the
  active, quota-holding allocations in tessera-ledger (arithmetic.reconcile decides).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.kv import KeyValue
from tessera.quota import arithmetic as qa
from tessera.quota.store import QuotaStore

from tessera import bus
from tessera.codec import CodecError, Message, decode
from tessera.models import Allocation, AllocationEvent, NodeLedger, QuotaState

T = TypeVar("T", bound=Message)


async def snapshot(
    kv: KeyValue, model: type[T], log: logging.Logger
) -> dict[str, tuple[T, int]]:
    """Every current value of a bucket, by key, with its revision (undecodable ones skipped)."""

    def skip(key: str, exc: Exception) -> None:
        log.warning("undecodable value skipped", extra={"key": key, "err": str(exc)})

    values: dict[str, tuple[T, int]] = {}
    watcher = bus.watch_models(kv, model, on_error=skip)
    try:
        async for key, value, revision in watcher:
            if key == "" and value is None:  # initial sync done
                break
            if value is None:
                values.pop(key, None)
            else:
                values[key] = (value, revision)
    finally:
        await watcher.aclose()
    return values


class Reconciler:
    """One pass: charges vs. the ledger, namespace by namespace, each write a CAS."""

    def __init__(
        self,
        quota: KeyValue,
        ledger: KeyValue,
        clock: Callable[[], float],
        grace_s: float,
        log: logging.Logger,
        store: QuotaStore,
    ) -> None:
        self.quota = quota
        self.ledger = ledger
        self.clock = clock
        self.grace_s = grace_s
        self.log = log
        self.store = store
        # namespace -> when its charge keys were last listed (a pass is O(pods)).
        self._listed_at: dict[str, float] = {}

    # A namespace of N pods is listed at most every N / PODS_PER_PASS passes' worth of time, so
    # the background pass stays a small share of the service's time at 10,000 pods.
    PODS_PER_PASS = 1000

    def _due(self, namespace: str, state: tuple[QuotaState, int] | None, now: float,
             interval_s: float) -> bool:  # fmt: skip
        pods = state[0].pods() if state else 0
        every = interval_s * max(1.0, pods / self.PODS_PER_PASS)
        return now - self._listed_at.get(namespace, float("-inf")) >= every * 0.9

    async def run_once(
        self, interval_s: float = 0.0, gone: Callable[[Allocation], bool] | None = None
    ) -> int:
        """Reconcile every namespace; returns how many namespaces were rewritten. `gone`: an
        allocation whose pod the cluster no longer has (stale_charges.py): not taken as backing
        a charge, though the ledger still holds it until the scheduler releases it."""
        # Read the ledger before the quota state: a reservation made after this read is young
        # and survives the grace period, so it cannot be dropped by this pass.
        ledgers = await snapshot(self.ledger, NodeLedger, self.log)
        backed: dict[str, dict[str, Allocation]] = defaultdict(dict)
        for ledger, _revision in ledgers.values():
            for uid, alloc in ledger.allocations.items():
                if alloc.active and alloc.quota_held and not (gone and gone(alloc)):
                    backed[alloc.namespace][uid] = alloc
        states = await snapshot(self.quota, QuotaState, self.log)
        now = self.clock()
        rewritten = 0
        for namespace in sorted(set(states) | set(backed)):
            if interval_s and not self._due(namespace, states.get(namespace), now, interval_s):
                continue
            self._listed_at[namespace] = now
            try:
                rewritten += await self._namespace(
                    namespace, states.get(namespace), backed.get(namespace, {}), now
                )
            except Exception as exc:
                self.log.warning(
                    "reconcile of namespace failed", extra={"namespace": namespace, "err": str(exc)}
                )
        return rewritten

    async def _namespace(
        self, namespace: str, state: tuple[QuotaState, int] | None,
        ns_backed: dict[str, Allocation], now: float,
    ) -> int:  # fmt: skip
        keys = await self.store.list_charges(namespace)
        view = qa.full_view(state[0] if state else QuotaState(namespace=namespace), keys)
        if any(uid not in view.charges for uid in ns_backed):
            ns_backed = await self._still_backed(ns_backed, view.charges)
        try:
            target = qa.reconcile(view, namespace, ns_backed, now, self.grace_s)
        except bus.NoChange:
            target = view
        dropped = sorted(set(view.charges) - set(target.charges))
        restored = sorted(set(target.charges) - set(view.charges))
        for uid in dropped:
            await self.store.update(namespace, uid, lambda s, own, u=uid: qa.release(
                s, u, charged_before=now - self.grace_s, own_settled=own))  # fmt: skip
        if restored:
            back = [target.charges[u] for u in restored]
            with contextlib.suppress(bus.NoChange):
                await bus.cas_update(self.quota, namespace, QuotaState,
                                     lambda s: qa.restore(s, namespace, back))  # fmt: skip
        # The snapshot's revision was read before the listing: unchanged, the list still holds.
        unchanged = None if (dropped or restored or state is None) else (keys, state[1])
        healed = await self.store.recompute(namespace, unchanged) if state else False
        if dropped or restored:
            self.log.info("quota reconciled with the ledger", extra={
                "namespace": namespace, "dropped": dropped, "restored": restored,
            })  # fmt: skip
        return int(bool(dropped or restored or healed))

    async def _still_backed(
        self, backed: dict[str, Allocation], held: Mapping[str, object]
    ) -> dict[str, Allocation]:
        """Re-read the ledger of allocations whose charge is missing before giving it back: the
        pod may have ended (and been released) since the snapshot was taken."""
        confirmed = {uid: a for uid, a in backed.items() if uid in held}
        nodes = {a.node for uid, a in backed.items() if uid not in held}
        for node in nodes:
            current = await bus.read(self.ledger, node, NodeLedger)
            if current is None:
                continue
            for uid, alloc in backed.items():
                now_alloc = current.value.allocations.get(uid)
                if (
                    uid not in held
                    and alloc.node == node
                    and now_alloc is not None
                    and now_alloc.active
                    and now_alloc.quota_held
                ):
                    confirmed[uid] = now_alloc
        return confirmed


ReleaseHandler = Callable[[str, str, float | None], Awaitable[bool]]


class ReleaseConsumer:
    """Durable pull consumer of alloc.*.released, shared by every quota replica."""

    def __init__(
        self,
        js: JetStreamContext,
        durable: str,
        release: ReleaseHandler,
        log: logging.Logger,
        batch: int = 64,
        check: Callable[[AllocationEvent], Awaitable[bool]] | None = None,
    ) -> None:
        # `check`: is the event true? (False: a release the ledger contradicts; not applied.)
        self.check = check
        self.js = js
        self.durable = durable
        self.release = release
        self.log = log
        self.batch = batch

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._consume(stop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("release consumer restarting", extra={"err": str(exc)})
                await asyncio.sleep(1.0)

    async def _consume(self, stop: asyncio.Event) -> None:
        # Created once, starting with new events: what was released before the consumer existed
        # is the reconcile pass's job. Afterwards the server remembers the position.
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.NEW, ack_wait=30.0, max_ack_pending=1024
        )
        sub = await self.js.pull_subscribe(
            bus.alloc_events_filter("released"),
            durable=self.durable,
            stream=bus.EVENTS_STREAM,
            config=config,
        )
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.batch, timeout=1.0)
                except TimeoutError:
                    continue
                for msg in msgs:
                    await self._handle(msg.data)
                    await msg.ack()
        finally:
            await sub.unsubscribe()

    async def _handle(self, payload: bytes) -> None:
        try:
            event = decode(payload, AllocationEvent)
        except CodecError as exc:
            self.log.warning("undecodable release event skipped", extra={"err": str(exc)})
            return
        try:
            qa.check_namespace(event.namespace)
        except qa.QuotaInputError:
            return
        if self.check is not None and not await self.check(event):
            return
        # Only a charge made before the release: a newer reservation of the same pod stays.
        freed = await self.release(event.namespace, event.pod_uid, event.at)
        if freed:
            self.log.info(
                "quota released on allocation release",
                extra={"namespace": event.namespace, "pod_uid": event.pod_uid, "node": event.node},
            )
