"""The watchdog's decisions, pure: which pod a host process belongs to, what a pod may hold on a
GPU, and when what NVML shows is a breach. No I/O; the caller passes the clock.

The unit judged is a pod's share of one GPU. The cgroup of a host pid names its pod reliably
(both kubelet cgroup drivers put `pod<uid>` in the path), but not which of the pod's containers
it is; so a share is what the pod's containers sealed for that GPU together: the sum of its app
containers' limits, or the largest init container's when that is more (init containers run one
at a time, before the app containers).
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from tessera.region import CORE_POLICIES, ContainerLimits

BreachReason = Literal["memory", "compute", "tampered", "unattested", "unleased"]
ShareKey = tuple[str, str]  # (pod uid, GPU uuid)

# `pod<uid>` in a cgroup path: cgroupfs (`/kubepods/burstable/pod1f2e…/<ctr>`) and systemd
# (`kubepods-burstable-pod1f2e_…slice/cri-containerd-<ctr>.scope`) drivers; static pods have a
# 32-hex uid without dashes.
_POD_IN_CGROUP = re.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
    r"|[0-9a-fA-F]{32})(?=\.slice|/|$)"
)


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod uid in the contents of /proc/<pid>/cgroup, or None (not a pod's process).

    Every line must agree on the pod (cgroup v1 lists one path per hierarchy); the innermost
    `pod…` component of a path wins (nested runtimes put kubepods under their own tree)."""
    found: set[str] = set()
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        matches = _POD_IN_CGROUP.findall(path)
        if matches:
            found.add(matches[-1].replace("_", "-").lower())
    return found.pop() if len(found) == 1 else None


class ContainerShare(NamedTuple):  # a tuple: built for every busy pod, every poll
    """One container's sealed limits on one GPU."""

    init: bool
    mem_limit_bytes: int  # 0 = unlimited
    sm_limit_pct: int | None  # the compute limit in force now; None = not limited now


def container_share(limits: ContainerLimits, uuid: str, init: bool) -> ContainerShare | None:
    """What libvgpu enforces for this container on `uuid` right now, from its sealed limits."""
    device = limits.device(uuid)
    if device is None:
        return None
    # Elastic compute (limits 1.2): the agent lends up to the burst limit and takes it back
    # within ~100 ms, so over the watchdog's window the most it may legitimately average is the
    # burst, never more.
    sm: int | None = device.yield_sm_pct if device.yield_ else device.sm_burst_limit_pct
    policy = CORE_POLICIES.get(limits.core_policy, CORE_POLICIES["default"])
    if (
        policy == CORE_POLICIES["disable"]
        or (policy == CORE_POLICIES["default"] and not device.contended)
        or not sm
        or sm >= 100
    ):
        sm = None  # `default` limits compute only while another container is active
    # elastic memory: under leases libvgpu's cap is the burst limit (the lease service lends up
    # to it while the card has room; docs/elastic.md), without them the guarantee
    mem = device.mem_burst_limit_bytes if limits.lease else device.mem_limit_bytes
    return ContainerShare(init, mem, sm)


class Share(NamedTuple):  # a tuple: built for every busy pod, every poll
    """What a pod may hold on one GPU, and what its usage region claims it holds."""

    mem_limit_bytes: int  # 0 = unlimited
    sm_limit_pct: int | None
    claimed_bytes: int | None = None  # None: no readable region (never initialised, or damaged)
    claimed_sm_pct: float | None = None  # the achieved SM % the region publishes


def combine(
    parts: Iterable[ContainerShare],
    claimed_bytes: int | None = None,
    claimed_sm_pct: float | None = None,
) -> Share | None:
    """A pod's share of a GPU from its containers' (see the module's docstring)."""
    items = tuple(parts)
    if not items:
        return None
    mem, sm = combined_limits(items)
    return Share(mem, sm, claimed_bytes, claimed_sm_pct)


@functools.lru_cache(maxsize=4096)
def combined_limits(items: tuple[ContainerShare, ...]) -> tuple[int, int | None]:
    """(memory bytes, SM %) a pod may hold on a GPU (memoised: it is asked every poll)."""

    def total(group: list[ContainerShare]) -> tuple[int, int | None]:
        mem = 0 if any(p.mem_limit_bytes == 0 for p in group) else sum(
            p.mem_limit_bytes for p in group)
        sm_parts = [p.sm_limit_pct for p in group]
        sm = None if any(s is None for s in sm_parts) else sum(s or 0 for s in sm_parts)
        return mem, sm

    apps = [p for p in items if not p.init]
    inits = [p for p in items if p.init]
    candidates = ([total(apps)] if apps else []) + [total([p]) for p in inits]
    mem = 0 if any(m == 0 for m, _ in candidates) else max(m for m, _ in candidates)
    sms = [s for _, s in candidates]
    sm = None if any(s is None for s in sms) else max(s or 0 for s in sms)
    return mem, sm


class Seen(NamedTuple):  # a tuple: built for every busy pod, every poll
    """What NVML shows for one pod on one GPU in one poll."""

    used_bytes: int
    sm_pct: float | None  # None: per-process utilisation unavailable
    pids: tuple[int, ...]


@dataclass(frozen=True)
class WatchdogPolicy:
    memory_margin_pct: float = 5.0
    memory_grace_s: float = 2.0
    compute_margin_pct: float = 10.0  # points above the limit
    compute_window_s: float = 10.0
    tamper_allowance_bytes: int = 256 << 20  # context memory NVML counts and a region may not


@dataclass(frozen=True)
class Breach:
    key: ShareKey
    reason: BreachReason
    limit: float  # bytes, or SM %
    seen: float
    claimed: float | None
    pids: tuple[int, ...]
    since: float  # when the condition started (caller's clock)
    new: bool  # first poll on which it is confirmed (publish once per episode)

    @property
    def enforceable(self) -> bool:
        """A limit was exceeded (tampered alone harms nobody else: it is reported)."""
        return self.reason != "tampered"


def unattested(seen: Seen, pod_uid: str, attested: dict[int, str]) -> tuple[int, ...]:
    """The pids of `seen` with no live lease connection from a container of `pod_uid`
    (`attested`: host pid -> pod uid). On a GPU whose memory the pod leases, such a process is
    not running libvgpu: LD_AUDIT, another link-map namespace, a loader copy, a bind over
    /etc/ld.so.preload, or no preload at all."""
    return tuple(p for p in seen.pids if attested.get(p) != pod_uid)


def over_lease(seen: Seen, leased: int, per_process_allowance: int) -> bool:
    """NVML shows the pod holding more than the agent leased it, beyond what each process's
    own context may take uncharged: libvgpu was bypassed inside an attested process (the
    driver called by address, libvgpu's code rewritten)."""
    return seen.used_bytes > leased + per_process_allowance * max(len(seen.pids), 1)


@dataclass
class _ShareState:
    over_since: dict[str, float] = field(default_factory=dict)  # reason -> start
    reported: set[str] = field(default_factory=set)
    sm_samples: deque[tuple[float, float, int]] = field(default_factory=deque)  # t, seen, limit
    sm_sums: list[float] = field(default_factory=lambda: [0.0, 0.0])  # of seen, of limit
    sm_since: float | None = None


class BreachJudge:
    """Feed it one poll at a time; it returns the breaches confirmed at that poll."""

    def __init__(self, policy: WatchdogPolicy) -> None:
        self.policy = policy
        self._state: dict[ShareKey, _ShareState] = {}

    def judge(
        self, now: float, shares: dict[ShareKey, Share], seen: dict[ShareKey, Seen]
    ) -> list[Breach]:
        out: list[Breach] = []
        for key in [k for k in self._state if k not in seen or k not in shares]:
            del self._state[key]  # nothing runs there any more: every episode ends
        for key, s in seen.items():
            share = shares.get(key)
            if share is None:
                continue  # not a share this node granted: not ours to judge
            state = self._state.setdefault(key, _ShareState())
            out.extend(self._memory(now, key, share, s, state))
            out.extend(self._compute(now, key, share, s, state))
        return out

    def _sustained(
        self, now: float, reason: BreachReason, over: bool, state: _ShareState, grace: float
    ) -> tuple[float, bool] | None:
        """(since, new) once `over` has held for `grace`; None otherwise."""
        if not over:
            state.over_since.pop(reason, None)
            state.reported.discard(reason)
            return None
        since = state.over_since.setdefault(reason, now)
        if now - since < grace:
            return None
        new = reason not in state.reported
        state.reported.add(reason)
        return since, new

    def _memory(
        self, now: float, key: ShareKey, share: Share, s: Seen, state: _ShareState
    ) -> list[Breach]:
        p = self.policy
        out = []
        limit = share.mem_limit_bytes
        over = limit > 0 and s.used_bytes > limit * (1 + p.memory_margin_pct / 100)
        hit = self._sustained(now, "memory", over, state, p.memory_grace_s)
        if hit:
            out.append(Breach(key, "memory", limit, s.used_bytes, share.claimed_bytes, s.pids,
                              hit[0], hit[1]))
        claimed = share.claimed_bytes or 0
        allowance = max(p.tamper_allowance_bytes, limit * p.memory_margin_pct / 100)
        hit = self._sustained(now, "tampered", s.used_bytes > claimed + allowance, state,
                              p.memory_grace_s)
        if hit:
            out.append(Breach(key, "tampered", limit, s.used_bytes, share.claimed_bytes, s.pids,
                              hit[0], hit[1]))
        return out

    def _compute(
        self, now: float, key: ShareKey, share: Share, s: Seen, state: _ShareState
    ) -> list[Breach]:
        p = self.policy
        if share.sm_limit_pct is None or s.sm_pct is None:
            state.sm_samples.clear()  # not limited now, or cannot be seen: the window restarts
            state.sm_sums[:] = [0.0, 0.0]
            state.sm_since = None
            self._sustained(now, "compute", False, state, 0)
            return []
        if state.sm_since is None:
            state.sm_since = now
        samples, sums = state.sm_samples, state.sm_sums
        samples.append((now, s.sm_pct, share.sm_limit_pct))
        sums[0] += s.sm_pct
        sums[1] += share.sm_limit_pct
        while samples and samples[0][0] <= now - p.compute_window_s:
            _, old_seen, old_limit = samples.popleft()
            sums[0] -= old_seen
            sums[1] -= old_limit
        if now - state.sm_since < p.compute_window_s:
            return []  # not yet a whole window of observation
        mean_seen = sums[0] / len(samples)  # running sums: no pass over the window per poll
        mean_limit = sums[1] / len(samples)
        hit = self._sustained(now, "compute", mean_seen > mean_limit + p.compute_margin_pct,
                              state, 0)
        if not hit:
            return []
        return [Breach(key, "compute", mean_limit, round(mean_seen, 2), share.claimed_sm_pct,
                       s.pids, now - p.compute_window_s, hit[1])]
