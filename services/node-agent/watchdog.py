"""The watchdog: what the GPUs really hold (NVML), per pod, against the sealed limits.

In-process enforcement (libvgpu) cannot be tamper-proof against code in the tenant's own
process; this loop watches from outside. Every `poll_s`: NVML's process list and per-process
utilisation → host pid → cgroup → pod → that pod's share of the GPU (its sealed limits, what its
region claims) → `BreachJudge` (watchdog_rules.py) → `limit.breached` events, and under
`TESSERA_ENFORCEMENT=kill` the pod's processes on that GPU are ended with SIGKILL. Processes of
no pod this node granted are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext

from tessera import bus
from tessera.models import Allocation, LimitBreachedEvent, NodeLedger
from tessera.region import ContainerLimits, RegionFormatError, read_device_claims, read_limits
from tessera.settings import TesseraSettings

from .containers import ContainerDir, ContainerStore
from .nvml_processes import GpuProcess, NvmlError, NvmlProcessProbe, ProcessProbe
from .watchdog_rules import (
    Breach,
    BreachJudge,
    Seen,
    Share,
    ShareKey,
    WatchdogPolicy,
    combine,
    container_share,
    pod_uid_from_cgroup,
)

LEDGER_REFRESH_S = 1.0


def read_pod_of(proc_root: Path, pid: int) -> str | None:
    """The pod uid of host pid `pid` from <proc root>/<pid>/cgroup; None when not a pod's."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None
    return pod_uid_from_cgroup(text)


def end_process(proc_root: Path, pid: int, pod_uid: str) -> bool:
    """SIGKILL `pid` if it still is a process of `pod_uid` (a pidfd pins the process between
    the check and the signal, so a recycled pid is never hit)."""
    if pid <= 1 or pid == os.getpid():
        return False
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False  # gone already
    try:
        if read_pod_of(proc_root, pid) != pod_uid:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class LimitsCache:
    """Sealed limits files, decoded again only when the file changes (stat is cheap)."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[tuple[int, int, int], ContainerLimits | None]] = {}

    def read(self, directory: Path) -> ContainerLimits | None:
        path = directory / "limits"
        try:
            st = path.stat()
        except OSError:
            self._cache.pop(path, None)
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(path)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            limits = read_limits(directory)
        except (RegionFormatError, OSError):
            limits = None  # the agent wrote it: damaged means mid-replace, try next poll
        self._cache[path] = (stamp, limits)
        return limits


@dataclass(frozen=True)
class Poll:
    shares: dict[ShareKey, Share]
    seen: dict[ShareKey, Seen]
    containers: dict[ShareKey, list[str]]  # names of the pod's containers on that GPU


class Watchdog:
    def __init__(
        self,
        *,
        node: str,
        store: ContainerStore,
        ledger: Callable[[], Awaitable[NodeLedger | None]],
        probe: ProcessProbe,
        js: JetStreamContext,
        policy: WatchdogPolicy,
        enforcement: str,
        proc_root: str | os.PathLike[str],
        log: logging.Logger,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        end: Callable[[Path, int, str], bool] = end_process,
    ) -> None:
        self.node = node
        self.store = store
        self.ledger = ledger
        self.probe = probe
        self.js = js
        self.judge = BreachJudge(policy)
        self.enforcement = enforcement
        self.proc_root = Path(proc_root)
        self.log = log
        self.poll_s = poll_s
        self.clock = clock
        self.wall = wall
        self.end = end
        self.limits = LimitsCache()
        self.stats: Counter[str] = Counter()
        self._allocations: dict[str, Allocation] = {}
        self._ledger_at: float | None = None

    async def _refresh_ledger(self) -> None:
        now = self.clock()
        if self._ledger_at is not None and now - self._ledger_at < LEDGER_REFRESH_S:
            return
        ledger = await self.ledger()
        self._allocations = {
            uid: a for uid, a in (ledger.allocations.items() if ledger else []) if a.active
        }
        self._ledger_at = now

    # ---- gathering (blocking: runs in a thread) -----------------------------------------------

    def _gather(self, allocations: dict[str, Allocation]) -> Poll:
        procs: list[GpuProcess] = self.probe.poll()
        owners: dict[int, str | None] = {}
        seen_parts: dict[ShareKey, list[GpuProcess]] = {}
        for p in procs:
            if p.pid not in owners:
                owners[p.pid] = read_pod_of(self.proc_root, p.pid)
            pod = owners[p.pid]
            if pod is None or pod not in allocations:
                self.stats["unattributed"] += 1
                continue  # not a pod this node granted: none of our business
            seen_parts.setdefault((pod, p.uuid), []).append(p)
        seen: dict[ShareKey, Seen] = {}
        for key, parts in seen_parts.items():
            sms = [p.sm_pct for p in parts]
            seen[key] = Seen(
                used_bytes=sum(p.used_bytes or 0 for p in parts),
                sm_pct=None if any(s is None for s in sms) else sum(s or 0.0 for s in sms),
                pids=tuple(sorted({p.pid for p in parts})),
            )
        shares: dict[ShareKey, Share] = {}
        names: dict[ShareKey, list[str]] = {}
        busy = {pod for pod, _ in seen}
        by_pod: dict[str, list[ContainerDir]] = {}
        for cdir in self.store.all():
            if cdir.prepared.pod_uid in busy:
                by_pod.setdefault(cdir.prepared.pod_uid, []).append(cdir)
        for key in seen:
            pod, uuid = key
            init_count = allocations[pod].init_count
            parts = []
            claimed: int | None = None
            claimed_sm: float | None = None
            for cdir in by_pod.get(pod, []):
                limits = self.limits.read(cdir.limits_dir)
                part = (container_share(limits, uuid, cdir.prepared.index < init_count)
                        if limits else None)
                if part is None:
                    continue  # not sealed yet, or not on this GPU
                parts.append(part)
                names.setdefault(key, []).append(cdir.prepared.container)
                claim = (read_device_claims(cdir.region_file) or {}).get(uuid)
                if claim is not None:
                    claimed = (claimed or 0) + claim[0]
                    if claim[1] is not None:
                        claimed_sm = (claimed_sm or 0.0) + claim[1]
            share = combine(parts, claimed, claimed_sm)
            if share is not None:
                shares[key] = share
        return Poll(shares, seen, names)

    # ---- one poll -----------------------------------------------------------------------------

    async def poll_once(self) -> list[Breach]:
        await self._refresh_ledger()
        allocations = self._allocations
        poll = await asyncio.to_thread(self._gather, allocations)
        self.stats["polls"] += 1
        breaches = self.judge.judge(self.clock(), poll.shares, poll.seen)
        for breach in breaches:
            killed: list[int] = []
            if self.enforcement == "kill" and breach.enforceable:
                killed = await asyncio.to_thread(self._end_all, breach)
            if breach.new:
                self.stats[f"breach:{breach.reason}"] += 1
                await self._publish(breach, allocations.get(breach.key[0]),
                                    poll.containers.get(breach.key, []), killed)
        return breaches

    def _end_all(self, breach: Breach) -> list[int]:
        ended = [pid for pid in breach.pids if self.end(self.proc_root, pid, breach.key[0])]
        self.stats["killed"] += len(ended)
        return ended

    async def _publish(
        self, breach: Breach, allocation: Allocation | None, containers: list[str],
        killed: list[int],
    ) -> None:
        pod_uid, uuid = breach.key
        since = self.wall() - (self.clock() - breach.since)
        kill = self.enforcement == "kill" and breach.enforceable
        unit = "percent" if breach.reason == "compute" else "bytes"
        what = {
            "memory": "holds more GPU memory than its limit",
            "compute": "used more compute than its limit, averaged over the window",
            "tampered": "its usage region claims less memory than the GPU shows",
        }[breach.reason]
        event = LimitBreachedEvent(
            event_id=f"{self.node}:{pod_uid}:{uuid}:{breach.reason}:{int(since * 1000)}",
            node=self.node, pod_uid=pod_uid,
            namespace=allocation.namespace if allocation else "",
            pod=allocation.name if allocation else "",
            container=",".join(containers), device_uuid=uuid, breach=breach.reason, unit=unit,
            limit=breach.limit, seen=breach.seen, region_claim=breach.claimed, since=since,
            policy="kill" if self.enforcement == "kill" else "observe",
            action="killed" if kill else "observed", pids=list(breach.pids),
            reason=f"{what} ({_figures(breach, unit)})"
            + (f"; ended pids {killed}" if kill else ""),
            source=f"node-agent/{self.node}",
        )
        self.log.warning("limit breached", extra={
            "pod_uid": pod_uid, "uuid": uuid, "breach": breach.reason, "action": event.action,
            "seen": breach.seen, "limit": breach.limit, "pids": list(breach.pids),
        })
        try:
            await bus.publish_event(self.js, event)
        except Exception as exc:
            self.stats["publish_failed"] += 1
            self.log.warning("limit.breached not published", extra={"err": str(exc)})

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = self.clock()
            try:
                await self.poll_once()
            except Exception as exc:
                self.stats["poll_failed"] += 1
                self.log.warning("watchdog poll failed", extra={"err": str(exc)})
            wait = max(0.0, self.poll_s - (self.clock() - started))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        await asyncio.to_thread(self.probe.close)


def _figures(breach: Breach, unit: str) -> str:
    def show(x: float | None) -> str:
        if x is None:
            return "unreadable"
        return f"{x:.1f}%" if unit == "percent" else f"{x / (1 << 20):.0f} MiB"

    return f"limit {show(breach.limit)}, seen {show(breach.seen)}, region {show(breach.claimed)}"


async def watchdog_from_settings(
    settings: TesseraSettings,
    *,
    node: str,
    probe: ProcessProbe | None,
    store: ContainerStore,
    ledger: Callable[[], Awaitable[NodeLedger | None]],
    js: JetStreamContext,
    log: logging.Logger,
) -> Watchdog | None:
    """The watchdog the settings ask for, or None. `auto` runs it on real GPUs (nvml source) or
    when a probe is given; NVML that cannot be opened is logged and the agent runs without it."""
    if settings.watchdog == "off":
        return None
    if probe is None:
        if settings.watchdog == "auto" and settings.device_source != "nvml":
            return None
        try:
            probe = await asyncio.to_thread(NvmlProcessProbe, settings.nvml_library, log)
        except (OSError, NvmlError) as exc:
            log.error("watchdog off: NVML unusable", extra={"err": str(exc)})
            return None
    policy = WatchdogPolicy(
        memory_margin_pct=settings.watchdog_memory_margin_pct,
        memory_grace_s=settings.watchdog_memory_grace_s,
        compute_margin_pct=settings.watchdog_compute_margin_pct,
        compute_window_s=settings.watchdog_compute_window_s,
        tamper_allowance_bytes=settings.watchdog_tamper_allowance_mib << 20,
    )
    log.info("watchdog on", extra={"enforcement": settings.enforcement,
                                   "poll_s": settings.watchdog_poll_s})
    return Watchdog(
        node=node, store=store, ledger=ledger, probe=probe, js=js, policy=policy,
        enforcement=settings.enforcement, proc_root=settings.watchdog_proc_root, log=log,
        poll_s=settings.watchdog_poll_s,
    )
