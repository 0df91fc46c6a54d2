"""kube-sim's scheduler: what kube-scheduler does for the pods of the local stack.

One scheduling cycle at a time (filter → prioritize → pick a host), bindings in the background,
as kube-scheduler runs them. Pods named for the Tessera scheduler that request a managed
resource go through the extender (filter with node names, prioritize only when more than one
node is left, bind through the extender); other pods of the Tessera or default scheduler are
bound directly to the node with the fewest pods. A pod that cannot be placed gets a
`PodScheduled=False` condition with kube-scheduler's message and a FailedScheduling event, and is
retried with exponential backoff; a pod leaving the cluster or a node changing retries every
waiting pod at once (kube-scheduler's "move all to active queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.dra.scheduling import DynamicResources, PodState
from tessera.kube_sim.events import record_event
from tessera.kube_sim.extender import ExtenderClient, ExtenderError, requests_managed_resource
from tessera.kube_sim.fit import (
    NodeUsage,
    insufficient,
    node_refusal,
    pod_requests,
    unavailable_message,
)
from tessera.kube_sim.store import Key, KubeObject, Selector, StoreError, now_rfc3339

from tessera.cancelling import cancel_and_wait

log = logging.getLogger("tessera.kube_sim.scheduler")

DEFAULT_SCHEDULER = "default-scheduler"


def unschedulable_message(total_nodes: int, failed: dict[str, str]) -> str:
    """kube-scheduler's summary: `0/3 nodes are available: 2 <reason>, 1 <reason>.`"""
    counts = Counter(failed.values())
    parts = [f"{count} {reason}" for reason, count in sorted(counts.items())]
    missing = total_nodes - sum(counts.values())
    if missing > 0:
        parts.append(f"{missing} node(s) were filtered out")
    return f"0/{total_nodes} nodes are available: {', '.join(parts)}."


def node_selector_matches(pod: KubeObject, node: KubeObject) -> bool:
    wanted = (pod.get("spec") or {}).get("nodeSelector") or {}
    labels = node.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def node_ready(node: KubeObject) -> bool:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return True


def feasible_nodes_to_find(total: int) -> int:
    """kube-scheduler's numFeasibleNodesToFind (percentageOfNodesToScore unset): all nodes
    below 100, else an adaptive share (50 % − total/125, at least 5 %), at least 100."""
    if total < 100:
        return total
    percentage = max(5, 50 - total // 125)
    return max(100, total * percentage // 100)


@dataclass
class Backoff:
    attempts: int
    ready_at: float
    bind_node: str = ""  # the node a bind to was rejected: retried when that node moves on


class SchedulingLoop:
    def __init__(
        self,
        api: ApiServer,
        scheduler_name: str,
        extender: ExtenderClient | None,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 2.0,
    ) -> None:
        self.api = api
        self.store = api.store
        self.scheduler_name = scheduler_name
        self.extender = extender
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._active: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._waiting: dict[Key, Backoff] = {}
        self._binding: set[Key] = set()
        self._bind_tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.usage = NodeUsage()  # what bound pods request per node (NodeResourcesFit)
        # kube-scheduler's DynamicResources plugin (dra/scheduling.py), when DRA is served
        self.dra: DynamicResources | None = None
        self._dra_states: dict[Key, PodState] = {}
        self._next_start = 0  # kube-scheduler's nextStartNodeIndex (DRA pods' filter order)

    # --- which pods are ours ----------------------------------------------------------------

    def responsible_for(self, pod: KubeObject) -> bool:
        spec = pod.get("spec") or {}
        if spec.get("nodeName") or (pod.get("metadata") or {}).get("deletionTimestamp"):
            return False
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return False
        return spec.get("schedulerName") in (self.scheduler_name, DEFAULT_SCHEDULER)

    def uses_extender(self, pod: KubeObject) -> bool:
        return (
            self.extender is not None
            and pod.get("spec", {}).get("schedulerName") == self.scheduler_name
            and requests_managed_resource(pod, self.extender.config.managed_resources)
        )

    # --- queues -----------------------------------------------------------------------------

    def _enqueue(self, key: Key) -> None:
        if key in self._queued or key in self._binding or key in self._waiting:
            return
        self._queued.add(key)
        self._active.put_nowait(key)

    def move_all_to_active(self) -> None:
        """Something changed that may let waiting pods fit: retry them all now."""
        waiting = list(self._waiting)
        self._waiting.clear()
        for key in waiting:
            self._enqueue(key)

    def _retry_binds_to(self, node: str) -> None:
        for key in [k for k, b in self._waiting.items() if node and b.bind_node == node]:
            del self._waiting[key]
            self._enqueue(key)

    def _back_off(self, key: Key, bind_node: str = "") -> None:
        previous = self._waiting.get(key)
        attempts = (previous.attempts if previous else 0) + 1
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (attempts - 1))
        self._waiting[key] = Backoff(attempts, time.monotonic() + delay, bind_node)
        self._wake.set()

    # --- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        watcher = self.store.watch("Pod", Selector(), self.store.version)
        node_watcher = self.store.watch("Node", Selector(), self.store.version)
        for pod in self.store.list("Pod", Selector()):
            self.usage.observe(pod)
            if self.responsible_for(pod):
                self._enqueue((pod["metadata"]["namespace"], pod["metadata"]["name"]))
        tasks = [
            asyncio.create_task(self._follow_pods(watcher.queue)),
            asyncio.create_task(self._follow_nodes(node_watcher.queue)),
            asyncio.create_task(self._release_backoffs()),
            asyncio.create_task(self._schedule_forever()),
        ]
        try:
            await stop.wait()
        finally:
            self.store.unwatch(watcher)
            self.store.unwatch(node_watcher)
            # (a cancel Python 3.11's wait_for drops is sent again)
            await cancel_and_wait(tasks + list(self._bind_tasks))

    async def _follow_pods(self, queue: asyncio.Queue[tuple[str, KubeObject]]) -> None:
        while True:
            event_type, pod = await queue.get()
            key = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
            if event_type == "DELETED" or key not in self._binding:
                self.usage.observe(pod, deleted=event_type == "DELETED")
            if event_type == "DELETED":
                self._waiting.pop(key, None)
                self._queued.discard(key)
                if pod.get("spec", {}).get("nodeName"):
                    self.move_all_to_active()  # its capacity is free again
            elif event_type == "ADDED" and self.responsible_for(pod):
                self._enqueue(key)
            elif (pod.get("status") or {}).get("phase") == "Running":
                # A pod started on its node: the node's bind-to-Allocate hand-over is done, so
                # binds rejected there (the node was busy) may go now. kube-scheduler's queueing
                # hints do the same for assigned-pod updates.
                self._retry_binds_to(pod["spec"].get("nodeName") or "")
            elif (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                self.move_all_to_active()

    async def _follow_nodes(self, queue: asyncio.Queue[tuple[str, KubeObject]]) -> None:
        while True:
            await queue.get()
            self.move_all_to_active()

    async def _release_backoffs(self) -> None:
        while True:
            now = time.monotonic()
            due = [key for key, b in self._waiting.items() if b.ready_at <= now]
            for key in due:
                # Stays in _waiting (its attempt count drives the next delay) but is not due again.
                self._waiting[key].ready_at = float("inf")
                self._queued.add(key)
                self._active.put_nowait(key)
            next_at = min((b.ready_at for b in self._waiting.values()), default=now + 1.0)
            next_at = min(next_at, now + 1.0)
            self._wake.clear()
            # (asyncio.timeout, not wait_for: on Python 3.11 a cancel racing wait_for's timeout
            # could leave this task cancelling forever, and kube-sim hung at SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.02, next_at - now)):
                    await self._wake.wait()

    async def _schedule_forever(self) -> None:
        while True:
            key = await self._active.get()
            self._queued.discard(key)
            try:
                pod = self.store.get("Pod", *key)
            except StoreError:
                self._waiting.pop(key, None)
                continue
            if not self.responsible_for(pod) or key in self._binding:
                self._waiting.pop(key, None)
                continue
            try:
                await self.schedule_one(key, pod)
            except Exception:  # one bad pod must not stop the scheduler
                log.exception("scheduling cycle failed", extra={"pod": "/".join(key)})
                self._back_off(key)

    def feasible_nodes(self, pod: KubeObject) -> tuple[list[str], dict[str, list[str]]]:
        """kube-scheduler's in-tree filters (node readiness, nodeSelector, NodeUnschedulable,
        TaintToleration, NodeResourcesFit):
        the nodes left, and each filtered node's reasons in kube-scheduler's words."""
        ignored = (
            frozenset(self.extender.config.managed_resources)
            if self.extender is not None and self.uses_extender(pod)
            else frozenset()
        )
        wanted = pod_requests(pod)
        names: list[str] = []
        failed: dict[str, list[str]] = {}
        dra = self.dra.prefilter(pod) if self.dra is not None else None
        key = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        nodes = self.store.list("Node", Selector())
        enough = len(nodes)
        if dra is not None:
            # The DRA filter allocates per node: as kube-scheduler, stop once enough nodes
            # fit, starting where the previous DRA pod stopped.
            self._dra_states[key] = dra
            enough = feasible_nodes_to_find(len(nodes))
            start = self._next_start % max(1, len(nodes))
            nodes = nodes[start:] + nodes[:start]
        for node in nodes:
            if len(names) >= enough:
                break
            name = node["metadata"]["name"]
            if not node_ready(node):
                failed[name] = ["node(s) had untolerated taint {node.kubernetes.io/not-ready: }"]
            elif not node_selector_matches(pod, node):
                failed[name] = ["node(s) didn't match Pod's node affinity/selector"]
            elif (refusal := node_refusal(pod, node)) is not None:
                failed[name] = [refusal]
            else:
                left_to_dra = dra.ignored_for(node) if dra is not None else set()
                reasons = insufficient(wanted, node, self.usage.used(name), ignored | left_to_dra)
                if reasons:
                    failed[name] = reasons
                elif dra is not None and self.dra is not None and (
                        refusal := self.dra.filter(dra, pod, node)) is not None:
                    failed[name] = [refusal]
                else:
                    names.append(name)
        if dra is not None:
            self._next_start += len(names) + len(failed)
        return names, failed

    async def schedule_one(self, key: Key, pod: KubeObject) -> None:
        names, filtered = self.feasible_nodes(pod)
        total = len(names) + len(filtered)
        if not names:
            message = (
                unavailable_message(total, filtered) if filtered
                else "0/0 nodes are available."
            )
            self._unschedulable(key, pod, message)
            return
        if not self.uses_extender(pod):
            counts = Counter(p["spec"].get("nodeName") for p in self.store.list("Pod", Selector()))
            host = min(names, key=lambda n: (counts.get(n, 0), n))
            self._start_bind(key, pod, host, via_extender=False)
            return
        assert self.extender is not None
        try:
            result = await self.extender.filter(pod, names)
            if not result.nodes:
                failed = {**result.failed, **result.unresolvable}
                reasons = {**filtered, **{n: [r] for n, r in failed.items()}}
                self._unschedulable(key, pod, unavailable_message(total, reasons))
                return
            host = result.nodes[0]
            if len(result.nodes) > 1:
                scores = await self.extender.prioritize(pod, result.nodes)
                host = max(result.nodes, key=lambda n: (scores.get(n, 0), -result.nodes.index(n)))
        except ExtenderError as error:
            self._unschedulable(key, pod, f"extender error: {error}", reason="SchedulerError")
            return
        self._start_bind(key, pod, host, via_extender=True)

    def _start_bind(self, key: Key, pod: KubeObject, host: str, via_extender: bool) -> None:
        dra = self._dra_states.pop(key, None)
        if dra is not None and self.dra is not None:
            try:  # Reserve + PreBind: the claims' allocation and reservedFor, before the bind
                self.dra.reserve(dra, pod, host)
            except StoreError as error:
                self._unschedulable(key, pod, f"running PreBind plugin \"DynamicResources\": "
                                    f"{error.message}", reason="SchedulerError")
                return
        self.usage.add(key, host, pod_requests(pod))  # assumed on the node while binding
        self._binding.add(key)
        self._waiting.pop(key, None)
        task = asyncio.create_task(self._bind(key, pod, host, via_extender))
        self._bind_tasks.add(task)
        task.add_done_callback(self._bind_tasks.discard)

    async def _bind(self, key: Key, pod: KubeObject, host: str, via_extender: bool) -> None:
        started = time.monotonic()
        try:
            if via_extender:
                assert self.extender is not None
                await self.extender.bind(pod, host)
            else:
                self.api.bind(key[0], key[1], host, pod["metadata"].get("uid"))
            record_event(
                self.store,
                pod,
                "Scheduled",
                f"Successfully assigned {key[0]}/{key[1]} to {host}",
                "Normal",
            )
            elapsed = round(time.monotonic() - started, 3)
            log.info("bound", extra={"pod": "/".join(key), "node": host, "bind_s": elapsed})
        except (ExtenderError, StoreError) as error:
            message = f"binding rejected: {error}"
            log.info("bind failed", extra={"pod": "/".join(key), "node": host, "error": str(error)})
            self._binding.discard(key)
            self.usage.remove(key)
            if self.dra is not None:
                self.dra.unreserve(pod)
            self._unschedulable(key, pod, message, reason="SchedulerError", bind_node=host)
            return
        self._binding.discard(key)
        if self.dra is not None:
            self.dra.bound(pod)

    def _unschedulable(
        self, key: Key, pod: KubeObject, message: str, reason: str = "Unschedulable",
        bind_node: str = "",
    ) -> None:
        self._dra_states.pop(key, None)
        try:
            current = self.store.get("Pod", *key)
        except StoreError:
            return
        if current["metadata"].get("uid") != pod["metadata"].get("uid") or current["spec"].get(
            "nodeName"
        ):
            return  # recreated, or bound meanwhile (a bind whose reply was lost)
        conditions = (current.get("status") or {}).get("conditions") or []
        already = any(
            c.get("type") == "PodScheduled" and c.get("message") == message for c in conditions
        )
        log.info("pod not scheduled", extra={"pod": "/".join(key), "reason": message[:300]})
        if not already:

            def set_condition(obj: KubeObject) -> None:
                status = obj.setdefault("status", {})
                kept = [
                    c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"
                ]
                kept.append(
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": reason,
                        "message": message,
                        "lastTransitionTime": now_rfc3339(),
                    }
                )
                status["conditions"] = kept

            with contextlib.suppress(StoreError):
                self.store.mutate("Pod", key[0], key[1], set_condition)
            record_event(self.store, current, "FailedScheduling", message, "Warning")
        self._back_off(key, bind_node)
