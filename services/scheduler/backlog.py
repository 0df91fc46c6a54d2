"""How much of the scheduler a backlog of unschedulable pods may take (pure: no I/O, no clock).

kube-scheduler retries a pod the extender refused after its backoff (1 s, doubling, at most
10 s), for as long as the pod is pending; GPU clusters routinely hold many pods that fit
nowhere. Each retry words every candidate's reason (cheap for most requests: per node shape,
`refusal_shapes.py`; but pods of several fitted containers, or nodes changing faster than the
memos catch up, still fit node by node). So that such a backlog cannot crowd out the pods that
do fit, the CPU the filter spends on refused calls is metered against a budget:

- credit accrues at `share` CPU-seconds per second of wall time (`TESSERA_BACKLOG_SHARE`,
  0.25: a quarter of the scheduler's one event-loop thread), up to `burst_s`
  (`TESSERA_BACKLOG_BURST_S`, 0.25 s of CPU); every refused call's CPU (first refusals
  included) is charged to it, so a flood of new unschedulable pods spends it too;
- while the credit is spent (below zero), a *retry* (a pod this replica refused at its last
  evaluation) is not evaluated: the call answers at once with an `error` naming why
  (`BacklogDeferred: ...`), which kube-scheduler treats as a failed attempt and retries after
  the pod's backoff; a pod seen for the first time, or placed last time, is always evaluated;
- work-conserving: a retry is deferred only while other pods are being placed (a placement
  within the last `busy_s`, 1 s): a scheduler with nothing else to do spends what it has on
  the backlog;
- no pod waits forever: a retry is evaluated whatever the credit once `max_defer_s`
  (`TESSERA_BACKLOG_MAX_DEFER_S`, 30 s) have passed since its last evaluation, so a pod that
  became schedulable is placed within that bound plus one backoff.

So the backlog's share of the scheduler's CPU while it also places other pods is at most
`share`, plus `burst_s`, plus one call per pod per `max_defer_s` (`tests/scheduler/
test_backlog.py` drives it with a clock). `share` 1 (or more) turns the bound off.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

_REMEMBERED = 20_000  # pods remembered as refused (oldest forgotten: then evaluated)

DEFERRED = "BacklogDeferred"


@dataclass
class BacklogGovernor:
    share: float = 0.25
    burst_s: float = 0.25
    max_defer_s: float = 30.0
    busy_s: float = 1.0

    def __post_init__(self) -> None:
        self.credit = self.burst_s
        self._at: float | None = None  # when the credit was last brought up to date
        self._placed_at = float("-inf")  # the last placement (others are being served)
        self.refused: OrderedDict[str, float] = OrderedDict()  # pod uid -> last evaluated at
        self.deferred = 0  # calls answered without an evaluation
        self.spent_s = 0.0  # CPU charged to refused calls in all

    @property
    def bounded(self) -> bool:
        return self.share < 1.0

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self.credit = min(self.burst_s, self.credit + (now - self._at) * self.share)
        self._at = now if self._at is None else max(self._at, now)

    def admit(self, uid: str, now: float) -> bool:
        """Whether to evaluate this pod's call now (False: answer `deferral`)."""
        if not self.bounded or not uid:
            return True
        last = self.refused.get(uid)
        if last is None:
            return True  # never refused here (or placed since): always evaluated
        self._refill(now)
        if self.credit > 0 or now - self._placed_at > self.busy_s or now - last >= self.max_defer_s:
            return True
        self.deferred += 1
        return False

    def charge(self, uid: str, cpu_s: float, refused: bool, now: float) -> None:
        """After an evaluated call: its CPU and whether the pod was refused."""
        if not self.bounded:
            return
        if not refused:
            self._placed_at = now
            if uid:
                self.refused.pop(uid, None)
            return
        self._refill(now)
        self.credit -= cpu_s
        self.spent_s += cpu_s
        if uid:
            self.refused[uid] = now
            self.refused.move_to_end(uid)
            while len(self.refused) > _REMEMBERED:
                self.refused.popitem(last=False)

    def forget(self, uid: str) -> None:
        """The pod is gone (deleted): nothing to remember."""
        self.refused.pop(uid, None)

    def deferral(self, uid: str, now: float) -> str:
        """The error a deferred call answers (kube-scheduler retries after its backoff)."""
        waited = now - self.refused.get(uid, now)
        return (f"{DEFERRED}: refused {waited:.0f}s ago; retries of unschedulable pods are over "
                f"their share ({self.share:g}) of the scheduler while other pods are placed; "
                f"evaluated again at the latest {self.max_defer_s:g}s after the last time")
