"""The node agent's ledger watches (kubelet's view, watched_ledger.py; the lease service's
booked guarantees, ledger_guarantees.py) end within a bound once stopped, even when the cancel
that ends a watch waiting for its next entry is lost (Python 3.11's wait_for drops one that
lands with a bus reply; tests/lost_cancel.py): before, the stop waited for ever."""

from __future__ import annotations

import asyncio
import logging

from lost_cancel import dropping_the_first_cancel
from tessera.node_agent.ledger_guarantees import LedgerGuarantees
from tessera.node_agent.watched_ledger import WatchedLedger

from tessera import bus

LOG = logging.getLogger("test-stop-bounded")
STOP_BOUND_S = 5.0


async def entries_waiting(kv, key, **_):
    """A KV watch waiting for its next entry, which loses the first cancel."""
    await dropping_the_first_cancel()
    yield None


class Booked:
    def __init__(self) -> None:
        self.calls = 0

    def set_booked(self, booked) -> None:
        self.calls += 1


async def stopped_within_bound(run, stop: asyncio.Event) -> None:
    task = asyncio.create_task(run(stop))
    await asyncio.sleep(0.1)  # the watch is waiting for its next entry
    assert not task.done()
    stop.set()
    done, _ = await asyncio.wait({task}, timeout=STOP_BOUND_S)
    if not done:  # (what the stop waits on takes a cancel; then the test fails)
        task.cancel()
        await asyncio.wait({task}, timeout=STOP_BOUND_S)
    assert done, f"not stopped within {STOP_BOUND_S:g} s"
    task.result()


async def test_the_ledger_guarantees_watch_ends_on_stop(monkeypatch) -> None:
    monkeypatch.setattr(bus, "watch_entries", entries_waiting)
    guarantees = LedgerGuarantees(None, "n1", Booked(), LOG)  # type: ignore[arg-type]
    await stopped_within_bound(guarantees.run, asyncio.Event())


async def test_kubelets_ledger_watch_ends_on_stop() -> None:
    ledger = WatchedLedger(None, "n1", LOG, entries=entries_waiting)  # type: ignore[arg-type]
    await stopped_within_bound(ledger.run, asyncio.Event())
