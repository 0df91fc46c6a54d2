"""Guarantees from the node's ledger, for the lease service (elastic memory, docs/elastic.md).

A pod's guarantee exists from the moment the scheduler books it on this node (its allocation in
KV `tessera-ledger[<node>]`: reserved, bound, allocated), not only once kubelet starts its
container and the agent seals its limits (PreStartContainer). Between the two a borrower could
otherwise lease the very room the new pod was placed in. `booked_guarantees` (pure) reads a
ledger into what each pod is guaranteed per GPU; `LedgerGuarantees` watches the node's key and
hands every change to `LeaseService.set_booked`, so lending stops as soon as the ledger says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from nats.js.kv import KeyValue

from tessera import bus
from tessera.cancelling import cancel_and_wait
from tessera.codec import decode
from tessera.models import NodeLedger

from .node_config_rules import usage_of

MiB = 1 << 20
RETRY_S = 1.0  # a watch that could not be (re)started is tried again this often


class Booking(Protocol):
    def set_booked(self, booked: dict[str, dict[str, int]]) -> None: ...


def booked_guarantees(ledger: NodeLedger | None) -> dict[str, dict[str, int]]:
    """GPU uuid -> pod uid -> the memory its active allocation is guaranteed there, in bytes
    (app containers and sidecars summed, init containers by the largest while they run: as the
    scheduler counts a pod's use of a card)."""
    out: dict[str, dict[str, int]] = {}
    for allocation in (ledger.allocations.values() if ledger else ()):
        if not allocation.active:
            continue
        for uuid, usage in usage_of(allocation).items():
            if usage.memory_mib > 0:
                out.setdefault(uuid, {})[allocation.pod_uid] = usage.memory_mib * MiB
    return out


class LedgerGuarantees:
    """Watches `tessera-ledger[<node>]` and keeps the lease service's booked guarantees current
    (the current value first, then every change; a delete books nothing)."""

    def __init__(self, kv: KeyValue, node: str, leases: Booking, log: logging.Logger) -> None:
        self.kv, self.node, self.leases, self.log = kv, node, leases, log
        self.revision = 0  # the last ledger revision applied (tests, metrics)

    def apply(self, ledger: NodeLedger | None, revision: int) -> None:
        self.leases.set_booked(booked_guarantees(ledger))
        self.revision = revision

    async def _watch(self, stop: asyncio.Event) -> None:
        failing = False
        while not stop.is_set():
            try:
                watch = bus.watch_entries(self.kv, self.node)
                async with contextlib.aclosing(watch) as entries:
                    async for entry in entries:
                        failing = False
                        if entry is None:
                            continue  # the current value was yielded before this marker
                        if entry.operation in ("DEL", "PURGE") or entry.value is None:
                            self.apply(None, entry.revision)
                            continue
                        try:
                            ledger = decode(entry.value, NodeLedger)
                        except Exception as exc:  # keep what was booked; say it
                            self.log.warning("ledger not readable for lending",
                                             extra={"err": str(exc)})  # fmt: skip
                            continue
                        self.apply(ledger, entry.revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus away: watch again from the start
                if not failing:
                    self.log.warning("ledger watch for lending failed", extra={"err": str(exc)})
                failing = True
            await asyncio.sleep(RETRY_S)

    async def run(self, stop: asyncio.Event) -> None:
        watcher = asyncio.create_task(self._watch(stop))
        try:
            await stop.wait()
        finally:  # (a cancel Python 3.11's wait_for drops is sent again)
            await cancel_and_wait(watcher)
