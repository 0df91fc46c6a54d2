"""The driver's watch of its node's pods: a shared claim handed on the moment its pod ends.

kubelet keeps a claim reserved for several pods of the node prepared while any of them runs, and
the driver books it under the first (`driver.py`). When that pod is deleted or finishes, the
claim is handed on to the next pod (`DraDriver.pod_ended`) as soon as the API server says so,
instead of at the driver's next periodic reconcile (up to `publish_interval_s` later, during
which the slice was booked under a pod that no longer exists). The reconcile stays the fallback:
a watch that was down (API server restarted, an event missed) or a hand-on that failed (quota
service or NATS away) is done there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from tessera.cluster.port import WatchEvent

if TYPE_CHECKING:
    from .driver import DraDriver

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
RETRY_S = 1.0  # a failed watch is opened again after this, doubled while it keeps failing
RETRY_MAX_S = 30.0


def ended_uid(event: WatchEvent) -> str:
    """The uid of the pod the event says has ended (deleted, or finished): "" otherwise."""
    pod = event.object if isinstance(event.object, dict) else {}
    meta, status = pod.get("metadata"), pod.get("status")
    uid = meta.get("uid") if isinstance(meta, dict) else None
    if not isinstance(uid, str):
        return ""
    phase = status.get("phase") if isinstance(status, dict) else None
    return uid if event.type == "DELETED" or phase in FINISHED_PHASES else ""


async def watch_ended_pods(driver: DraDriver, stop: asyncio.Event, log: logging.Logger,
                           retry_s: float = RETRY_S) -> None:  # fmt: skip
    """Until `stop`: every ended pod of the node that holds a prepared claim has its shared
    claims handed on. A watch that fails is opened again after `retry_s` (doubled, up to
    RETRY_MAX_S, while it fails before its first event: an API server that is away)."""
    wait_s = retry_s
    while not stop.is_set():
        events = driver.cluster.watch_pods(node_name=driver.node)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    wait_s = retry_s
                    uid = ended_uid(event)
                    if uid and uid in driver.prepared_pods():
                        try:
                            await driver.pod_ended(uid)
                        except Exception as exc:  # the periodic reconcile retries
                            log.warning("shared claims of an ended pod not handed on yet",
                                        extra={"pod_uid": uid, "err": str(exc)})  # fmt: skip
        except Exception as exc:
            log.warning("pod watch of the DRA driver failed; opening it again",
                        extra={"err": str(exc)})  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait_s)
        wait_s = min(wait_s * 2, RETRY_MAX_S)
