"""Kubernetes Events on the pod, as HAMi's scheduler records them, through the cluster port.

Reasons (HAMi's): `FilteringFailed` (Warning, with every node's refusal), `FilteringSucceed`,
`BindingFailed` (Warning), `BindingSucceed`; and kube-scheduler's `Preempted` (Normal, on each
victim of a preemption once it is evicted: "Preempted by pod <uid> on node <node>", kube-
scheduler's wording, then which pod that is). `kubectl describe pod` shows them.

Rate-limited so a pod retried every few seconds does not flood the API server: the same reason
and message for the same pod at most once per `repeat_s`; at most `burst` events in flight (the
rest are dropped and counted). Recording never blocks or fails a scheduling call.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

from tessera.cluster.port import ClusterPort, ObjectRef

from .background import BackgroundTasks

log = logging.getLogger("tessera.scheduler")

FILTERING_FAILED = "FilteringFailed"
FILTERING_SUCCEED = "FilteringSucceed"
BINDING_FAILED = "BindingFailed"
BINDING_SUCCEED = "BindingSucceed"
PREEMPTED = "Preempted"  # kube-scheduler's reason on a preemption victim
_REMEMBERED = 10_000


class PodEventRecorder:
    def __init__(
        self,
        cluster: ClusterPort | None,
        tasks: BackgroundTasks,
        clock: Callable[[], float],
        *,
        repeat_s: float = 60.0,
        burst: int = 64,
    ) -> None:
        self.cluster = cluster
        self.tasks = tasks
        self.clock = clock
        self.repeat_s = repeat_s
        self.burst = burst
        self.in_flight = 0
        self.dropped = 0
        self._last: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def filtered(self, pod: dict[str, Any], passed: list[str], failed: dict[str, str],
                 error: str = "") -> None:
        """After a filter call: which nodes passed, or why each node refused."""
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not meta.get("name"):
            return
        ref = ObjectRef(kind="Pod", namespace=str(meta.get("namespace") or "default"),
                        name=str(meta["name"]), uid=str(meta.get("uid") or ""))
        if passed:
            self._record(ref, FILTERING_SUCCEED, "Normal",
                         f"{len(passed)} node(s) fit the GPU request: "
                         f"{', '.join(sorted(passed)[:10])}")
        elif failed or error:
            reasons = "; ".join(f"{node}: {why}" for node, why in sorted(failed.items()))
            text = error or f"no node fits the GPU request ({len(failed)} refused): {reasons}"
            self._record(ref, FILTERING_FAILED, "Warning", text)

    def bound(self, namespace: str, name: str, uid: str, node: str, error: str) -> None:
        ref = ObjectRef(kind="Pod", namespace=namespace or "default", name=name, uid=uid)
        if error:
            self._record(ref, BINDING_FAILED, "Warning", f"binding to {node} failed: {error}")
        else:
            self._record(ref, BINDING_SUCCEED, "Normal", f"bound to node {node}")

    def preempted(self, victim: ObjectRef, preemptor: ObjectRef, node: str) -> None:
        """A victim was evicted so that `preemptor` can have its GPUs on `node`."""
        self._record(victim, PREEMPTED, "Normal",
                     f"Preempted by pod {preemptor.uid} on node {node} "
                     f"({preemptor.namespace}/{preemptor.name} needs its GPUs)")  # fmt: skip

    def _record(self, ref: ObjectRef, reason: str, kind: Literal["Normal", "Warning"],
                message: str) -> None:
        if self.cluster is None:
            return
        now = self.clock()
        key = (ref.uid or f"{ref.namespace}/{ref.name}", reason, message)
        last = self._last.get(key)
        if last is not None and now - last < self.repeat_s:
            return
        if self.in_flight >= self.burst:
            self.dropped += 1
            return
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > _REMEMBERED:
            self._last.popitem(last=False)
        self.in_flight += 1
        self.tasks.spawn(self._send(self.cluster, ref, reason, kind, message))

    async def _send(self, cluster: ClusterPort, ref: ObjectRef, reason: str,
                    kind: Literal["Normal", "Warning"], message: str) -> None:
        try:
            await cluster.record_event(ref, reason, message, kind)
        except Exception as exc:  # an event is best effort; scheduling goes on
            log.warning("pod event not recorded", extra={"reason": reason, "err": str(exc)})
        finally:
            self.in_flight -= 1
