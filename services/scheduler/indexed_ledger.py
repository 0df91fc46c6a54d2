"""The ledger writer together with the index that mirrors it.

Every CAS first tries against the revision the index holds (the hint), and every result it
returns is applied to the index at once, so this replica never waits for its own write to come
back through the watch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tessera import bus
from tessera.models import NodeLedger

from .index import ClusterIndex
from .ledger import LedgerWriter


class IndexedLedger:
    def __init__(
        self, writer: LedgerWriter, index: ClusterIndex, clock: Callable[[], float]
    ) -> None:
        self.writer = writer
        self.index = index
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, node: str) -> asyncio.Lock:
        """This replica's writes to one node's entry, one at a time: each then starts from the
        revision the previous one left in the index instead of losing the CAS to it and paying
        a re-read and decode (a burst packing one node would otherwise conflict O(n²) times)."""
        lock = self._locks.get(node)
        if lock is None:
            lock = self._locks[node] = asyncio.Lock()
        return lock

    def hint(self, node: str) -> bus.Versioned[NodeLedger] | None:
        """The node's ledger entry as the index holds it (None when it holds none)."""
        entry = self.index.entries.get(node)
        if entry is None or entry.ledger is None:
            return None
        return bus.Versioned(entry.ledger, entry.ledger_revision)

    def apply(self, node: str, result: bus.Versioned[NodeLedger] | None) -> None:
        if result is not None:
            self.index.set_ledger(node, result.value, result.revision, self.clock())

    async def read(self, node: str) -> bus.Versioned[NodeLedger] | None:
        """The node's entry as the KV holds it now (applied to the index)."""
        current = await bus.read(self.writer.kv, node, NodeLedger)
        self.apply(node, current)
        return current
