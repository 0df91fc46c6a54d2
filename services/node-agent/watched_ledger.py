"""This node's ledger entry as the device plugin reads and writes it: followed by a KV watch, so
that kubelet's calls do not each wait for a KV read (a JetStream request through nats-server
and back, in the serialised path of every pod kubelet admits).

- `exact()`: a KV read, always: what decides which pod kubelet is admitting starts from one
  (GetPreferredAllocation's: a pod booked a moment ago may still be on its way to the watch,
  and a stale entry would let an older pod of the same shape take its place).
- `read(fresh_within)`: the newest entry known (the watch's, this agent's own last write or
  the last exact read, whichever is newer), decoded once per revision and only when asked: an
  Allocate right after the GetPreferredAllocation that read exactly (within `fresh_within`
  seconds; kubelet calls the two back to back) takes it from there. Not live (the watch not
  started yet, or restarting after the bus went away), or no exact read that recent: exact.
- `cas(mutate)`: compare-and-set starting from the entry known (no read first); a conflict, or
  a body that finds nothing to do on it, is decided again by `bus.cas_update` on fresh reads,
  so the CAS guarantees are the bus's.

The entry handed out is shared: read-only (every mutation copies first, as a CAS body must).

A store that went back (NATS lost its store and the bucket was made anew: revisions start
again at 1) shows as an exact read, or this agent's own write, older than an entry known before
it was asked: everything known had been committed by then. The entry known is then replaced by
the exact one and the watch started again from the new store's start (a watch resumes after the
last sequence it took, which the new store has not reached).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tessera import bus
from tessera.cancelling import cancel_and_wait
from tessera.codec import decode, encode
from tessera.models import NodeLedger

RETRY_S = 1.0  # a watch that could not be (re)started is tried again this often


class WatchedLedger:
    def __init__(
        self, kv: KeyValue, node: str, log: logging.Logger,
        entries: Callable[[KeyValue, str], AsyncIterator[bus.KvEntry | None]] = bus.watch_entries,
    ) -> None:  # fmt: skip
        """`entries`: the KV watch (bus.watch_entries; tests pass one that lags)."""
        self.kv, self.node, self.log = kv, node, log
        self._entries = entries
        self.live = False  # the watch has delivered the current value and is running
        self.exact_reads = 0  # KV reads made (tests, and the bench's trace)
        self.exact_at = float("-inf")  # when the last one was made (time.monotonic)
        self._revision = 0  # of the newest entry known
        self._raw: bytes | None = None  # its encoded value (None: deleted or absent)
        self._value: NodeLedger | None = None
        self._decoded = True  # _value is _raw decoded
        self._watcher: asyncio.Task[None] | None = None
        self._stopped = False
        self.restarts = 0  # watches started again after the store went back (tests)

    # --- the entry known ---------------------------------------------------------------------

    def _take(self, revision: int, raw: bytes | None, value: NodeLedger | None = None,
              decoded: bool = False, replace: bool = False) -> None:  # fmt: skip
        """Keep an entry if it is newer than the one known (`replace`: whatever it is: the
        first value of a watch, which may follow a bus that was re-created from scratch)."""
        if revision <= self._revision and not replace:
            return
        self._revision, self._raw, self._value, self._decoded = revision, raw, value, decoded

    def _decoded_value(self) -> NodeLedger | None:
        if not self._decoded:
            self._value = decode(self._raw, NodeLedger) if self._raw is not None else None
            self._decoded = True
        return self._value

    def known(self) -> bus.Versioned[NodeLedger] | None:
        """The entry known now, or None (none known, or the key is absent)."""
        value = self._decoded_value()
        return bus.Versioned(value, self._revision) if value is not None else None

    def wrote(self, result: bus.Versioned[NodeLedger], known: int = 0) -> None:
        """This agent's own write (a CAS result): known at once, before its echo comes back.
        `known`: the revision known when the write was asked (committed before it)."""
        if result.revision < known:
            self._went_back(result.revision, b"", result.value)
            return
        self._take(result.revision, b"", result.value, decoded=True)

    def _went_back(self, revision: int, raw: bytes | None, value: NodeLedger | None) -> None:
        """The store is not the one the entry known came from: start over from `revision`."""
        self.log.warning("ledger store went back: following it anew",
                         extra={"revision": revision, "known": self._revision})  # fmt: skip
        self._take(revision, raw, value, decoded=True, replace=True)
        self.live = False
        if self._watcher is not None and not self._stopped:
            self.restarts += 1
            self._watcher.cancel()
            self._watcher = asyncio.create_task(self._watch())

    # --- reads ---------------------------------------------------------------------------------

    async def read(self, fresh_within: float | None = None) -> NodeLedger | None:
        """The entry known (at least as new as the last exact read); exact while not live, or
        when no exact read was made in the last `fresh_within` seconds."""
        stale = fresh_within is not None and time.monotonic() - self.exact_at > fresh_within
        if not self.live or stale:
            return await self.exact()
        return self._decoded_value()

    async def exact(self) -> NodeLedger | None:
        """The entry as KV holds it now."""
        self.exact_reads += 1
        self.exact_at = time.monotonic()
        known = self._revision  # committed before this read is asked
        try:
            entry = await self.kv.get(self.node)
        except KeyNotFoundError:
            entry = None
        deleted = entry is None or entry.value is None or entry.operation in ("DEL", "PURGE")
        revision = entry.revision if entry is not None and entry.revision else 0
        if revision < known:  # (a key not found at all after one was known: the same)
            value = None if deleted else decode(entry.value, NodeLedger)
            self._went_back(revision, None if deleted else entry.value, value)
            return value
        if deleted:
            self._take(revision, None, None, decoded=True)
            return None
        if revision == self._revision and self._raw is not None:
            return self._decoded_value()  # known already: not decoded again
        value = decode(entry.value, NodeLedger)
        self._take(revision, entry.value, value, decoded=True)
        return value

    # --- writes --------------------------------------------------------------------------------

    async def cas(self, mutate: Callable[[NodeLedger | None], NodeLedger]
                  ) -> bus.Versioned[NodeLedger]:  # fmt: skip
        """`bus.cas_update` of this node's entry, its first attempt made on the entry known."""
        known = self._revision  # committed before this write is asked
        start = self.known() if self.live else None
        if start is not None:
            try:
                new = mutate(start.value)
            except bus.NoChange:
                pass  # nothing to do on what is known: judged again on a fresh read below
            else:
                try:
                    revision = await self.kv.update(self.node, encode(new), last=start.revision)
                except KeyWrongLastSequenceError:
                    pass  # someone wrote since: the bus's loop, from a fresh read
                else:
                    result = bus.Versioned(new, revision)
                    self.wrote(result, known)
                    return result
        result = await bus.cas_update(self.kv, self.node, NodeLedger, mutate)
        self.wrote(result, known)
        return result

    # --- the watch -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._stopped = False
        self._watcher = asyncio.create_task(self._watch())
        try:
            await stop.wait()
        finally:
            self._stopped = True
            watcher, self._watcher = self._watcher, None
            if watcher is not None:  # (a cancel Python 3.11's wait_for drops is sent again)
                await cancel_and_wait(watcher)
            self.live = False

    async def _watch(self) -> None:
        failing = False
        while not self._stopped:
            first = True
            try:
                async with contextlib.aclosing(self._entries(self.kv, self.node)) as entries:
                    async for entry in entries:
                        failing = False
                        if entry is None:  # the current value has been delivered
                            if first:  # the key holds nothing
                                self._take(0, None, None, decoded=True, replace=True)
                            self.live = True
                            continue
                        deleted = entry.value is None or entry.operation in ("DEL", "PURGE")
                        self._take(entry.revision, None if deleted else entry.value,
                                   decoded=deleted, replace=first)  # fmt: skip
                        first = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus away: exact reads until watched again
                if not failing:
                    self.log.warning("ledger watch failed: reading KV meanwhile",
                                     extra={"err": str(exc)})  # fmt: skip
                failing = True
            self.live = False
            await asyncio.sleep(RETRY_S)
