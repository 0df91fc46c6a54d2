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
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from tessera import bus
from tessera.codec import decode
from tessera.models import Allocation, LimitBreachedEvent, NodeLedger
from tessera.region import ContainerLimits
from tessera.settings import TesseraSettings

from .containers import ContainerDir, ContainerStore
from .nvml_processes import GpuProcess, NvmlError, NvmlProcessProbe, ProcessProbe
from .watchdog_host import Claims, LimitsCache, PodOfPid, RegionClaims, end_process
from .watchdog_rules import (
    Breach,
    BreachJudge,
    ContainerShare,
    Seen,
    Share,
    ShareKey,
    WatchdogPolicy,
    combine,
    container_share,
    over_lease,
    unattested,
)

LEDGER_REFRESH_S = 2.0  # a new pod is in the ledger long before its container starts


class CachedLedger:
    """This node's ledger from KV, decoded again only when its revision moves (the watchdog
    asks every second; a node's ledger changes only when its pods do)."""

    def __init__(self, kv: KeyValue, node: str) -> None:
        self.kv = kv
        self.node = node
        self._revision: int | None = None
        self._value: NodeLedger | None = None

    async def __call__(self) -> NodeLedger | None:
        try:
            entry = await self.kv.get(self.node)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None or entry.operation in ("DEL", "PURGE"):
            self._revision, self._value = None, None
            return None
        if entry.revision != self._revision:
            self._value = decode(entry.value, NodeLedger)
            self._revision = entry.revision
        return self._value


@dataclass(frozen=True)
class Poll:
    shares: dict[ShareKey, Share]
    seen: dict[ShareKey, Seen]
    containers: dict[ShareKey, list[str]]  # names of the pod's containers on that GPU
    leased: frozenset[ShareKey] = frozenset()  # memory limited and leased from the agent


class Attestation(Protocol):
    """What the lease service (leases.py) tells the watchdog."""

    def attested(self) -> dict[int, str]: ...  # host pid -> pod uid, live connections

    def leased_by_pod(self, pod_uid: str, uuid: str) -> int: ...

    def leases_memory(self, pod_uid: str, uuid: str) -> bool: ...  # the pod leases on uuid

    def limit_of_pod(self, pod_uid: str, uuid: str) -> int: ...


ACCEPT_GRACE_S = 0.02  # a lease connection made just before NVML listed its process
CLAIMS_FRESH_S = 0.5
LEASE_REASONS = ("unattested", "unleased")


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
        leases: Attestation | None = None,
        lease_poll_s: float = 0.25,
        lease_enforcement: str | None = None,  # for unattested / unleased; None: `enforcement`
    ) -> None:
        self.node = node
        self.store = store
        self.ledger = ledger
        self.probe = probe
        self.js = js
        self.judge = BreachJudge(policy)
        self.enforcement = enforcement
        self.lease_enforcement = enforcement if lease_enforcement is None else lease_enforcement
        self.proc_root = Path(proc_root)
        self.log = log
        self.poll_s = poll_s
        self.clock = clock
        self.wall = wall
        self.end = end
        self.leases = leases
        self.lease_poll_s = lease_poll_s
        self._lease_episodes: set[tuple[ShareKey, str]] = set()  # published, still going on
        self.limits = LimitsCache()
        self.pods_of = PodOfPid(self.proc_root)
        # What regions claim feeds only rules with a grace period (tampered: 2 s; compute: a
        # 10 s mean): read at most every 0.5 s, however fast the poll that catches bypasses.
        self.claims = RegionClaims(fresh_s=CLAIMS_FRESH_S)
        self._paths: dict[str, tuple[str, str]] = {}  # container dir -> limits dir, region
        self._share_memo: dict[tuple[str, str, bool], tuple[ContainerLimits,
                                                            ContainerShare | None]] = {}
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
        seen, owners, now = self._seen(allocations)
        return self._judged_shares(seen, owners, now)

    def _seen(
        self, allocations: dict[str, Allocation], utilization: bool = True
    ) -> tuple[dict[ShareKey, Seen], dict[int, str | None], float]:
        """What NVML shows per pod and GPU (the light part: the lease poll needs only this)."""
        procs: list[GpuProcess] = self.probe.poll(utilization)
        now = self.clock()
        owners: dict[int, str | None] = {}
        seen_parts: dict[ShareKey, list[GpuProcess]] = {}
        for p in procs:
            if p.pid not in owners:
                owners[p.pid] = self.pods_of.lookup(p.pid, now)
            pod = owners[p.pid]
            if pod is None or pod not in allocations:
                self.stats["unattributed"] += 1
                continue  # not a pod this node granted: none of our business
            seen_parts.setdefault((pod, p.uuid), []).append(p)
        seen: dict[ShareKey, Seen] = {}
        for key, parts in seen_parts.items():
            if len(parts) == 1:  # the common case: one process of the pod on that GPU
                one = parts[0]
                seen[key] = Seen(one.used_bytes or 0, one.sm_pct, (one.pid,))
                continue
            sms = [p.sm_pct for p in parts]
            seen[key] = Seen(
                used_bytes=sum(p.used_bytes or 0 for p in parts),
                sm_pct=None if any(s is None for s in sms) else sum(s or 0.0 for s in sms),
                pids=tuple(sorted({p.pid for p in parts})),
            )
        return seen, owners, now

    def _judged_shares(
        self, seen: dict[ShareKey, Seen], owners: dict[int, str | None], now: float
    ) -> Poll:
        allocations = self._allocations
        shares: dict[ShareKey, Share] = {}
        names: dict[ShareKey, list[str]] = {}
        leased: set[ShareKey] = set()
        self.pods_of.keep_only(set(owners))
        busy = {pod for pod, _ in seen}
        read: dict[str, tuple[ContainerLimits | None, Claims | None]] = {}
        by_pod: dict[str, list[tuple[str, ContainerDir]]] = {}
        for cdir in self.store.all():
            if cdir.prepared.pod_uid in busy:
                where = str(cdir.path)
                by_pod.setdefault(cdir.prepared.pod_uid, []).append((where, cdir))
                read[where] = self._read_container(where, cdir, now)
        for key in seen:
            pod, uuid = key
            init_count = allocations[pod].init_count
            parts = []
            claimed: int | None = None
            claimed_sm: float | None = None
            for where, cdir in by_pod.get(pod, []):
                limits, claims = read[where]
                part = self._share_of(where, limits, uuid, cdir.prepared.index < init_count)
                if part is None:
                    continue  # not sealed yet, or not on this GPU
                parts.append(part)
                names.setdefault(key, []).append(cdir.prepared.container)
                if limits is not None and limits.lease and part.mem_limit_bytes:
                    leased.add(key)
                claim = claims.get(uuid) if claims else None
                if claim is not None:
                    claimed = (claimed or 0) + claim[0]
                    if claim[1] is not None:
                        claimed_sm = (claimed_sm or 0.0) + claim[1]
            share = combine(parts, claimed, claimed_sm)
            if share is not None:
                shares[key] = share
        if len(read) != len(self._paths):  # (every container read this poll is in _paths)
            self._forget_all_but(read)  # containers went idle or away: drop their caches
        return Poll(shares, seen, names, frozenset(leased))

    def _forget_all_but(self, busy: dict[str, object]) -> None:
        for path in [p for p in self._paths if p not in busy]:
            del self._paths[path]
        for key in [k for k in self._share_memo if k[0] not in busy]:
            del self._share_memo[key]
        self.limits.keep_only({paths[0] for paths in self._paths.values()})
        self.claims.keep_only({paths[1] for paths in self._paths.values()})

    def _share_of(
        self, where: str, limits: ContainerLimits | None, uuid: str, init: bool
    ) -> ContainerShare | None:
        """container_share, remembered while the limits object is the same (LimitsCache hands
        out one object per file version)."""
        if limits is None:
            return None
        key = (where, uuid, init)
        cached = self._share_memo.get(key)
        if cached is not None and cached[0] is limits:
            return cached[1]
        part = container_share(limits, uuid, init)
        self._share_memo[key] = (limits, part)
        return part

    def _read_container(
        self, where: str, cdir: ContainerDir, now: float
    ) -> tuple[ContainerLimits | None, Claims | None]:
        paths = self._paths.get(where)
        if paths is None:  # as plain strings: pathlib costs more than the reads themselves
            paths = self._paths[where] = (str(cdir.limits_dir), str(cdir.region_file))
        return self.limits.read(paths[0], now), self.claims.read(paths[1], now)

    # ---- one poll -----------------------------------------------------------------------------

    async def poll_once(self) -> list[Breach]:
        await self._refresh_ledger()
        allocations = self._allocations
        poll = await asyncio.to_thread(self._gather, allocations)
        self.stats["polls"] += 1
        breaches = self.judge.judge(self.clock(), poll.shares, poll.seen)
        if self.leases is not None:
            breaches.extend(await self._lease_breaches(poll))
        await self._act(breaches, poll, allocations)
        return breaches

    async def _act(
        self, breaches: list[Breach], poll: Poll, allocations: dict[str, Allocation]
    ) -> None:
        killed: dict[int, list[int]] = {}
        if any(self._kills(b) for b in breaches):
            # every kill before any publish: a slow or absent bus never delays enforcement
            killed = await asyncio.to_thread(
                lambda: {i: self._end_all(b) for i, b in enumerate(breaches) if self._kills(b)})
        for i, breach in enumerate(breaches):
            if breach.new:
                self.stats[f"breach:{breach.reason}"] += 1
                kill = self._kills(breach)
                self.stats[f"action:{breach.reason}:{'killed' if kill else 'observed'}"] += 1
                await self._publish(breach, allocations.get(breach.key[0]),
                                    poll.containers.get(breach.key, []), killed.get(i, []))

    def _policy(self, breach: Breach) -> str:
        return self.lease_enforcement if breach.reason in LEASE_REASONS else self.enforcement

    def _kills(self, breach: Breach) -> bool:
        return breach.enforceable and self._policy(breach) == "kill"

    async def lease_poll_once(self) -> list[Breach]:
        """Between full polls: NVML's processes against the lease service alone (no region,
        no limits file is read), so that a bypass is caught within `lease_poll_s`."""
        assert self.leases is not None
        allocations = self._allocations
        seen, _owners, _now = await asyncio.to_thread(self._seen, allocations, False)
        self.stats["lease_polls"] += 1
        leases = self.leases
        leased = frozenset(k for k in seen if leases.leases_memory(*k))
        poll = Poll({}, seen, {}, leased)
        breaches = await self._lease_breaches(poll)
        await self._act(breaches, poll, allocations)
        return breaches

    async def _lease_breaches(self, poll: Poll) -> list[Breach]:
        """At first sight, no grace: a process on a leased GPU without a lease connection
        (`unattested`), a pod holding more than it leased (`unleased`)."""
        assert self.leases is not None
        keys = [k for k in poll.leased if k in poll.seen]
        attested = self.leases.attested()
        suspects = {k: unattested(poll.seen[k], k[0], attested) for k in keys}
        if any(suspects.values()):
            await asyncio.sleep(ACCEPT_GRACE_S)  # let the lease service accept what is queued
            attested = self.leases.attested()
            suspects = {k: unattested(poll.seen[k], k[0], attested) for k in keys}
        now = self.clock()
        allowance = self.judge.policy.tamper_allowance_bytes
        out: list[Breach] = []
        going_on: set[tuple[ShareKey, str]] = set()
        for key in keys:
            s = poll.seen[key]
            leased = self.leases.leased_by_pod(*key)
            found: list[tuple[str, tuple[int, ...]]] = []
            if suspects[key]:  # these first: what they hold is not the attested ones' doing
                found.append(("unattested", suspects[key]))
            elif over_lease(s, leased, allowance):
                found.append(("unleased", s.pids))
            if not found:
                continue
            share = poll.shares.get(key)
            limit = share.mem_limit_bytes if share else self.leases.limit_of_pod(*key)
            for reason, pids in found:
                going_on.add((key, reason))
                out.append(Breach(key, reason, limit, s.used_bytes, leased, pids, now,  # type: ignore[arg-type]
                                  (key, reason) not in self._lease_episodes))  # fmt: skip
        self._lease_episodes = going_on
        return out

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
        kill = self._kills(breach)
        unit = "percent" if breach.reason == "compute" else "bytes"
        what = {
            "memory": "holds more GPU memory than its limit",
            "compute": "used more compute than its limit, averaged over the window",
            "tampered": "its usage region claims less memory than the GPU shows",
            "unattested": "a process uses the GPU without libvgpu's lease (libvgpu bypassed)",
            "unleased": "holds more GPU memory than the node agent leased it",
        }[breach.reason]
        event = LimitBreachedEvent(
            event_id=f"{self.node}:{pod_uid}:{uuid}:{breach.reason}:{int(since * 1000)}",
            node=self.node, pod_uid=pod_uid,
            namespace=allocation.namespace if allocation else "",
            pod=allocation.name if allocation else "",
            container=",".join(containers), device_uuid=uuid, breach=breach.reason, unit=unit,
            limit=breach.limit, seen=breach.seen, region_claim=breach.claimed, since=since,
            policy="kill" if self._policy(breach) == "kill" else "observe",
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
        """A full poll every `poll_s`; with a lease service, light lease polls in between, every
        `lease_poll_s` (a full poll checks leases too)."""
        tick = self.poll_s if self.leases is None else min(self.poll_s, self.lease_poll_s)
        last_full: float | None = None
        while not stop.is_set():
            started = self.clock()
            try:
                if last_full is None or started - last_full >= self.poll_s - tick / 2:
                    last_full = started
                    await self.poll_once()
                else:
                    await self.lease_poll_once()
            except Exception as exc:
                self.stats["poll_failed"] += 1
                self.log.warning("watchdog poll failed", extra={"err": str(exc)})
            wait = max(0.0, tick - (self.clock() - started))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        await asyncio.to_thread(self.probe.close)
        self.claims.close()


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
    leases: Attestation | None = None,
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
                                   "lease_enforcement": settings.lease_enforcement,
                                   "poll_s": settings.watchdog_poll_s})
    return Watchdog(
        node=node, store=store, ledger=ledger, probe=probe, js=js, policy=policy,
        enforcement=settings.enforcement, proc_root=settings.watchdog_proc_root, log=log,
        poll_s=settings.watchdog_poll_s, leases=leases,
        lease_poll_s=settings.watchdog_lease_poll_s,
        lease_enforcement=settings.lease_enforcement,
    )
