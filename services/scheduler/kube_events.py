"""Kubernetes Events on the pod, as HAMi's scheduler records them, through the cluster port.

Reasons (HAMi's): `FilteringFailed` (Warning, why the nodes refused), `FilteringSucceed`,
`BindingFailed` (Warning), `BindingSucceed`; and kube-scheduler's `Preempted` (Normal, on each
victim of a preemption once it is evicted: "Preempted by pod <uid> on node <node>", kube-
scheduler's wording, then which pod that is). `kubectl describe pod` shows them.

`FilteringFailed` says every node's refusal (`node: 1/8 CardInsufficientMemory; ...`, what
`tessera describe pod` lists node by node) while that fits an event's message (`EVENT_NOTE_LIMIT`:
events.k8s.io/v1 allows a note of 1 kB, and the cluster port cuts core/v1 messages there too);
beyond it, HAMi's aggregate (its scheduler records `<N> nodes <Reason>(<nodes>)` per reason):
per reason the count and the first few nodes, read off the decision's reason ids without
building or sorting a per-node list (a refusal at 5,000 nodes was a 200 kB, ~1 ms message).

Rate-limited so a pod retried every few seconds does not flood the API server: the same reason
and message for the same pod at most once per `repeat_s`; at most `burst` events in flight (the
rest are dropped and counted). Recording never blocks or fails a scheduling call.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

from tessera.cluster.port import ClusterPort, ObjectRef

from .background import BackgroundTasks
from .node_reasons import NodeReasons, reason_names

log = logging.getLogger("tessera.scheduler")

FILTERING_FAILED = "FilteringFailed"
FILTERING_SUCCEED = "FilteringSucceed"
BINDING_FAILED = "BindingFailed"
BINDING_SUCCEED = "BindingSucceed"
PREEMPTED = "Preempted"  # kube-scheduler's reason on a preemption victim
_REMEMBERED = 10_000
EVENT_NOTE_LIMIT = 1024  # events.k8s.io/v1 `note`: at most 1 kB
_LISTED = 40  # refusals listed node by node up to this many (more never fit the limit)
_EXAMPLES = 3  # nodes named per reason in the aggregate


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

    def filtered(self, pod: dict[str, Any], passed: list[str], failed: Mapping[str, str],
                 error: str = "", unresolvable: Mapping[str, str] | None = None) -> None:
        """After a filter call: which nodes passed, or why the nodes refused."""
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not meta.get("name"):
            return
        ref = ObjectRef(kind="Pod", namespace=str(meta.get("namespace") or "default"),
                        name=str(meta["name"]), uid=str(meta.get("uid") or ""))
        if passed:
            self._record(ref, FILTERING_SUCCEED, "Normal",
                         f"{len(passed)} node(s) fit the GPU request: "
                         f"{', '.join(sorted(passed)[:10])}")
        elif failed or unresolvable or error:
            text = error or refusal_message(failed, unresolvable or {})
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


def _count(reasons: Mapping[str, str]) -> int:
    return reasons.count() if isinstance(reasons, NodeReasons) else len(reasons)


def refusal_message(failed: Mapping[str, str], unresolvable: Mapping[str, str]) -> str:
    """`FilteringFailed`'s message: every node's reason while that fits `EVENT_NOTE_LIMIT`,
    else per HAMi reason how many nodes and which first (most nodes first), within the limit.
    Its cost is bounded by the distinct reasons, not the nodes."""
    total = _count(failed) + _count(unresolvable)
    head = f"no node fits the GPU request ({total} refused): "
    if total <= _LISTED:
        merged = {**failed, **unresolvable}
        listed = head + "; ".join(f"{node}: {why}" for node, why in sorted(merged.items()))
        if len(listed) <= EVENT_NOTE_LIMIT:
            return listed
    tally: dict[str, tuple[int, list[str]]] = {}
    for reasons in (failed, unresolvable):
        if isinstance(reasons, NodeReasons):
            found = reasons.by_reason(_EXAMPLES)
        else:
            found = {}
            for node, why in reasons.items():
                for reason in reason_names(why):
                    nodes, names = found.get(reason, (0, []))
                    found[reason] = (nodes + 1, names if len(names) >= _EXAMPLES
                                     else [*names, node])  # fmt: skip
        for reason, (nodes, names) in found.items():
            before, kept = tally.get(reason, (0, []))
            tally[reason] = (before + nodes, (kept + names)[:_EXAMPLES])
    parts = []
    for reason, (nodes, names) in sorted(tally.items(), key=lambda item: (-item[1][0], item[0])):
        more = ", ..." if nodes > len(names) else ""
        parts.append(f"{nodes} nodes {reason}({', '.join(names)}{more})")
    message = head + "; ".join(parts)
    if len(message) > EVENT_NOTE_LIMIT:
        message = message[: EVENT_NOTE_LIMIT - 3] + "..."
    return message
