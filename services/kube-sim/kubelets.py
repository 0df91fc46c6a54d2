"""One kubelet per simulated node: admit bound pods, start them, report their status.

Each `NodeKubelet` follows the pods bound to its node (the same field-selector watch a kubelet
uses), admits them one at a time through the device-plugin protocol (`SimKubelet`: Allocate per
container, init containers first), serves pod-resources, and hands each admitted pod to a worker
of its own that starts it (PreStartContainer just before each container starts) and writes its
status (Running, container states) back to the API. That is kubelet's split: `HandlePodAdditions`
admits the pods of an update one after the other (the device manager's Allocate runs in the
admit handlers), then `dispatchWork` gives each pod to its pod worker, one goroutine per pod,
whose `SyncPod` starts the containers (the device manager's PreStartContainer runs as each
container's run options are generated), so one pod's start never waits for another's.

Where a real kubelet would fail a pod whose device plugin is briefly unreachable (a node agent
restarting), this one retries admission with backoff for `admit_deadline_s` before failing the
pod with UnexpectedAdmissionError, so the local stack converges after crashes without a
ReplicaSet to recreate pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tessera.kube_sim import fit
from tessera.kube_sim.dra.kubelet import DraKubelet, without_dra_resources
from tessera.kube_sim.events import record_event
from tessera.kube_sim.kubelet import PodAdmission, SimKubelet
from tessera.kube_sim.oci import OciContainers, OciSettings
from tessera.kube_sim.processes import ContainerProcesses
from tessera.kube_sim.store import KubeObject, ObjectStore, Selector, StoreError, now_rfc3339

from tessera.cancelling import cancel_and_wait

log = logging.getLogger("tessera.kube_sim.kubelets")


def pod_uses(pod: KubeObject, resources: list[str]) -> bool:
    spec = pod.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        limits = (container.get("resources") or {}).get("limits") or {}
        requests = (container.get("resources") or {}).get("requests") or {}
        if any(r in limits or r in requests for r in resources):
            return True
    return False


def running_status(pod: KubeObject, node: str, started: str) -> dict[str, Any]:
    """The status kubelet reports once every container has started."""
    spec = pod.get("spec") or {}
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": started}
        for t in (
            "PodReadyToStartContainers",
            "Initialized",
            "Ready",
            "ContainersReady",
            "PodScheduled",
        )
    ]
    return {
        "phase": "Running",
        "conditions": conditions,
        "hostIP": "10.0.0.1",
        "podIP": "10.244.0.1",
        "startTime": started,
        "qosClass": (pod.get("status") or {}).get("qosClass", "BestEffort"),
        "initContainerStatuses": [
            {
                "name": c.get("name", ""),
                "image": c.get("image", ""),
                "ready": True,
                "restartCount": 0,
                "started": False,
                "state": {
                    "terminated": {
                        "exitCode": 0,
                        "reason": "Completed",
                        "startedAt": started,
                        "finishedAt": started,
                    }
                },
            }
            for c in spec.get("initContainers") or []
        ],
        "containerStatuses": [
            {
                "name": c.get("name", ""),
                "image": c.get("image", ""),
                "ready": True,
                "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": started}},
            }
            for c in spec.get("containers") or []
        ],
    }


class NodeKubelet:
    def __init__(
        self,
        store: ObjectStore,
        node: str,
        root: Path,
        gpu_resources: list[str],
        processes: ContainerProcesses | OciContainers | None = None,
        admit_deadline_s: float = 60.0,
        allocate_delay_s: float = 0.0,
        allocate_jitter_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self.gpu_resources = gpu_resources
        self.processes = processes
        self.admit_deadline_s = admit_deadline_s
        # A real kubelet sees a bound pod 0.1-1 s after the bind (watch, sync loop); this
        # models it: each pod is admitted delay ± jitter seconds after it appears.
        self.allocate_delay_s = allocate_delay_s
        self.allocate_jitter_s = allocate_jitter_s
        self.rng = rng or random.Random()
        self._arrivals: set[asyncio.Task[None]] = set()
        self.device_kubelet = SimKubelet(
            root / node / "device-plugins",
            root / node / "pod-resources" / "kubelet.sock",
            on_change=self._plugins_changed,
            device_resources=gpu_resources,
            node=node,
        )
        self.admissions: dict[str, PodAdmission] = {}  # by pod uid
        # Pod workers: pods admitted (their devices allocated) whose containers are starting.
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._queue: asyncio.Queue[KubeObject] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._capacity_dirty = asyncio.Event()
        # kubelet's DRA manager (dra/kubelet.py): plugins_registry, NodePrepareResources
        self.dra: DraKubelet | None = None

    async def start(self) -> None:
        await self.device_kubelet.start()
        if self.dra is not None:
            await self.dra.start()
        watcher = self.store.watch("Pod", Selector(node_name=self.node), self.store.version)
        for pod in self.store.list("Pod", Selector(node_name=self.node)):
            self._arrive(pod)
        self._tasks = [
            asyncio.create_task(self._follow(watcher)),
            asyncio.create_task(self._admit_forever()),
            asyncio.create_task(self._publish_capacity()),
        ]

    def delay(self) -> float:
        jitter = self.rng.uniform(-self.allocate_jitter_s, self.allocate_jitter_s)
        return max(0.0, self.allocate_delay_s + jitter)

    def _arrive(self, pod: KubeObject) -> None:
        """Queue a pod for admission after the modelled delay (at once when there is none)."""
        wait = self.delay()
        if wait <= 0:
            self._queue.put_nowait(pod)
            return

        async def later() -> None:
            await asyncio.sleep(wait)
            self._queue.put_nowait(pod)

        task = asyncio.create_task(later())
        self._arrivals.add(task)
        task.add_done_callback(self._arrivals.discard)

    async def stop(self) -> None:
        # (a cancel Python 3.11's wait_for drops is sent again)
        await cancel_and_wait([*self._tasks, *self._arrivals, *self._workers.values()])
        if self.processes is not None:
            await self.processes.stop_all()
        await self.device_kubelet.stop()
        if self.dra is not None:
            await self.dra.stop()

    def _plugins_changed(self) -> None:
        self._capacity_dirty.set()

    async def _publish_capacity(self) -> None:
        """Node capacity/allocatable = the devices each plugin advertises, as kubelet reports."""
        while True:
            await self._capacity_dirty.wait()
            self._capacity_dirty.clear()
            counts = {r: str(len(p.healthy())) for r, p in self.device_kubelet.plugins.items()}

            def update(node: KubeObject, counts: dict[str, str] = counts) -> None:
                status = node.setdefault("status", {})
                for field in ("capacity", "allocatable"):
                    status.setdefault(field, {}).update(counts)

            with contextlib.suppress(StoreError):
                self.store.mutate("Node", "", self.node, update)
            await asyncio.sleep(0.5)  # coalesce bursts of ListAndWatch updates

    async def _follow(self, watcher: Any) -> None:
        """The node's pods, for as long as the kubelet runs: one event that fails to apply is
        logged, and never ends the watch (every later pod of the node would wait forever)."""
        try:
            while True:
                event_type, pod = await watcher.queue.get()
                try:
                    if event_type == "ADDED":
                        self._arrive(pod)
                    elif event_type == "DELETED":
                        await self._remove(pod)
                except Exception:
                    log.exception("pod event not applied", extra={
                        "node": self.node, "event": event_type,
                        "pod": (pod.get("metadata") or {}).get("name")})
        finally:
            self.store.unwatch(watcher)

    async def _remove(self, pod: KubeObject) -> None:
        uid = pod["metadata"].get("uid", "")
        worker = self._workers.pop(uid, None)
        if worker is not None and worker is not asyncio.current_task():
            await cancel_and_wait(worker)
        self.admissions.pop(uid, None)
        self.device_kubelet.remove_pod(uid)
        if self.processes is not None:
            await self.processes.stop_pod(uid)
        if self.dra is not None and self.dra.uses(pod):
            await self.dra.unprepare(pod)  # then its claims are released

    async def _admit_forever(self) -> None:
        # kubelet admits pods one at a time (its sync loop: every Allocate of a pod before the
        # next pod's), which the node agent relies on; starting them is each pod's worker's.
        while True:
            pod = await self._queue.get()
            try:
                await self._admit(pod)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # kube-sim stopping
                # Something awaited inside was cancelled, not this loop: the node's admissions
                # must go on (a dead loop leaves every later pod of the node Pending forever).
                log.exception("pod admission cancelled", extra={"pod": pod["metadata"]["name"]})
            except Exception:
                log.exception("pod admission crashed", extra={"pod": pod["metadata"]["name"]})

    def _current(self, pod: KubeObject) -> KubeObject | None:
        meta = pod["metadata"]
        try:
            current = self.store.get("Pod", meta["namespace"], meta["name"])
        except StoreError:
            return None
        if current["metadata"].get("uid") != meta.get("uid"):
            return None
        return current

    async def _admit(self, pod: KubeObject) -> None:
        uid = pod["metadata"].get("uid", "")
        if (uid in self.admissions or uid in self._workers
                or (pod.get("status") or {}).get("phase") != "Pending"):
            return
        if (refusal := self._missing_resource(pod)) is not None:
            self._reject(pod, *refusal)
            return
        if self.dra is not None and self.dra.uses(pod) and not await self._prepare_claims(pod):
            return
        admission: PodAdmission | None = None
        devices_pod = without_dra_resources(pod)  # what DRA serves is not the device plugins'
        # the GPU resources, and any other a device plugin registered (MIG instances, ...)
        if pod_uses(devices_pod, self.gpu_resources + list(self.device_kubelet.plugins)):
            deadline = time.monotonic() + self.admit_deadline_s
            admission = await self._allocate_devices(devices_pod, deadline)
            if admission is None:
                return
        else:
            deadline = time.monotonic() + self.admit_deadline_s
            admission = PodAdmission(uid, pod["metadata"]["namespace"], pod["metadata"]["name"])
        worker = asyncio.create_task(self._pod_worker(pod, admission, deadline))
        self._workers[uid] = worker

    async def _prepare_claims(self, pod: KubeObject) -> bool:
        """NodePrepareResources for the pod's claims (and its CDI specs resolvable); False: not
        yet, retried in a second with a FailedPrepareDynamicResources event, as kubelet does."""
        assert self.dra is not None
        current = self._current(pod) or pod
        error = await self.dra.prepare(current)
        if error is None:
            try:
                self.dra.apply(current, PodAdmission("", "", ""))
            except ValueError as exc:  # cdi.CdiError: a runtime would not create the container
                error = str(exc)
        if error is None:
            return True
        if self._current(pod) is None:
            return False
        record_event(self.store, current, "FailedPrepareDynamicResources",
                     f"Failed to prepare dynamic resources: {error}", "Warning",
                     component="kubelet")

        async def later() -> None:
            await asyncio.sleep(1.0)
            self._queue.put_nowait(pod)

        task = asyncio.create_task(later())
        self._arrivals.add(task)
        task.add_done_callback(self._arrivals.discard)
        return False

    async def _pod_worker(self, pod: KubeObject, admission: PodAdmission, deadline: float) -> None:
        """Start an admitted pod (PreStartContainer per container, retried on the same device
        IDs until `deadline`), then report it Running."""
        uid = admission.uid
        try:
            started = await self._start_devices(pod, admission, deadline)
            if started is None:
                return
            if self.dra is not None:
                self.dra.apply(pod, started)  # the CDI devices' env, mounts, device nodes
            self.admissions[uid] = started
            at = now_rfc3339()
            if self.processes is not None:
                await self.processes.start_pod(pod, started, self._container_exited)
            current = self._current(pod)
            if current is None:
                await self._remove(pod)
                return
            self._set_status(current, running_status(current, self.node, at))
            record_event(self.store, current, "Started", f"Started pod on {self.node}", "Normal",
                         component="kubelet")  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod start crashed", extra={"pod": pod["metadata"]["name"]})
        finally:
            if self._workers.get(uid) is asyncio.current_task():
                del self._workers[uid]

    async def _allocate_devices(self, pod: KubeObject, deadline: float) -> PodAdmission | None:
        """Allocate for every container that asks a device (retried until `deadline` while the
        plugin is away); None: gave up (the pod failed), or the pod is gone."""
        uid = pod["metadata"].get("uid", "")
        # A real kubelet fails the pod on an Allocate error (UnexpectedAdmissionError) and its
        # controller makes a new one; kube-sim retries the same pod instead, which is what the
        # crash tests need while a node agent restarts.
        delay = 0.02
        last_error = ""
        while True:
            if self._current(pod) is None:
                self.device_kubelet.remove_pod(uid)
                return None
            # SimKubelet refuses a pod whose device resource has no registered plugin or too
            # few healthy devices (its stream ended), so no container starts without them.
            allocated = await self.device_kubelet.allocate_pod(pod)
            if allocated.ok:
                if last_error:
                    log.info("pod allocated after retries", extra={"pod": pod["metadata"]["name"]})
                return allocated
            self.device_kubelet.remove_pod(uid)  # a failed Allocate holds no devices
            error = allocated.error
            if error != last_error:
                log.warning("pod admission failed, retrying",
                            extra={"pod": pod["metadata"]["name"], "error": error})
                last_error = error
            if time.monotonic() >= deadline:
                self._fail(pod, error)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _start_devices(
        self, pod: KubeObject, admission: PodAdmission, deadline: float
    ) -> PodAdmission | None:
        """PreStartContainer per container. As in kubelet, a recorded allocation is never
        redone: when starting fails (the plugin restarting), only the start (same device IDs)
        is retried; a fresh Allocate would be attributed by the plugin to whichever pod is in
        flight by then. None: gave up (the pod failed), or the pod is gone."""
        if not admission.containers:
            return admission
        uid = admission.uid
        delay = 0.02
        last_error = ""
        while True:
            if self._current(pod) is None:
                self.device_kubelet.remove_pod(uid)
                return None
            admission.error = ""
            for entry in admission.containers:
                entry.error = ""
            started = await self.device_kubelet.start_pod(admission)
            if started.ok:
                if last_error:
                    log.info("pod admitted after retries", extra={"pod": pod["metadata"]["name"]})
                return started
            error = started.error
            if error != last_error:
                log.warning("pod start failed, retrying",
                            extra={"pod": pod["metadata"]["name"], "error": error})
                last_error = error
            if time.monotonic() >= deadline:
                self._fail(pod, error)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _missing_resource(self, pod: KubeObject) -> tuple[str, str] | None:
        """kubelet's own admission check for a pod no scheduler placed (`spec.nodeName` set by
        its author): an extended resource this node does not offer at all rejects it, as
        kubelet does (`OutOf<resource>`), instead of running it without the device. Scheduled
        pods are left to the device plugins (a plugin restarting must not reject them)."""
        conditions = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conditions):
            return None
        try:
            node = self.store.get("Node", "", self.node)
        except StoreError:
            return None
        offered = fit.allocatable(node)
        for name, amount in sorted(fit.pod_requests(pod).items()):
            if "/" in name and fit.checked(name) and amount > 0 and not offered.get(name):
                return (f"OutOf{name}", f"Node didn't have enough resource: {name}, requested: "
                        f"{amount}, used: 0, capacity: 0")
        return None

    def _reject(self, pod: KubeObject, reason: str, message: str) -> None:
        """A pod kubelet will not run: Failed with kubelet's reason and a Warning event."""
        current = self._current(pod)
        if current is None:
            return
        status = dict(current.get("status") or {})
        status.update(phase="Failed", reason=reason, message=f"Pod was rejected: {message}")
        self._set_status(current, status)
        record_event(self.store, current, reason, message, "Warning", component="kubelet")

    def _fail(self, pod: KubeObject, error: str) -> None:
        current = self._current(pod)
        if current is None:
            return
        status = dict(current.get("status") or {})
        status.update(phase="Failed", reason="UnexpectedAdmissionError",
                      message=f"Allocate failed: {error}")
        self._set_status(current, status)
        record_event(self.store, current, "UnexpectedAdmissionError", error, "Warning",
                     component="kubelet")

    def _set_status(self, pod: KubeObject, status: dict[str, Any]) -> None:
        def apply(obj: KubeObject) -> None:
            for kept in ("resourceClaimStatuses", "extendedResourceClaimStatus"):
                if kept in (obj.get("status") or {}) and kept not in status:
                    status[kept] = obj["status"][kept]  # the controller's and scheduler's
            if self.dra is not None:  # the DRA devices' health (allocatedResourcesStatus)
                self.dra.annotate(obj, status)
            obj["status"] = status

        with contextlib.suppress(StoreError):
            self.store.mutate("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"], apply)

    def _container_exited(
        self, pod: KubeObject, phase: str, statuses: list[dict[str, Any]]
    ) -> None:
        """A pod whose processes all ended: Succeeded or Failed, with the exit codes."""
        current = self._current(pod)
        if current is None:
            return
        status = dict(current.get("status") or {})
        status["phase"] = phase
        status["containerStatuses"] = statuses
        self._set_status(current, status)
        if self.dra is not None and self.dra.uses(current):  # a finished pod's claims go back
            task = asyncio.create_task(self.dra.unprepare(current))
            self._arrivals.add(task)
            task.add_done_callback(self._arrivals.discard)

    def describe(self) -> list[dict[str, Any]]:
        """What each admitted container received (env, mounts, devices): for tests and demos."""
        return [asdict(a) for a in self.admissions.values()]


def container_runtime(
    settings: Any, log_dir: Path, node: str
) -> ContainerProcesses | OciContainers | None:
    """How this node runs containers: OCI containers, local processes, or not at all."""
    if settings.container_runtime == "podman":
        return OciContainers(log_dir, node, OciSettings(
            image=settings.container_image, user=settings.container_user,
            driver_dir=settings.container_driver_dir,
            devices=tuple(d for d in settings.container_devices.split(",") if d),
        ), kubelet=f"{Path(settings.kubelet_root).resolve()}/{node}")
    return ContainerProcesses(log_dir) if settings.run_containers else None


async def start_kubelets(sim: Any) -> list[NodeKubelet]:
    settings = sim.settings
    root = Path(settings.kubelet_root)
    log_dir = Path(settings.container_log_dir or root / "logs")
    kubelets = []
    for node in sim.nodes:
        processes = container_runtime(settings, log_dir / node.name, node.name)
        if isinstance(processes, OciContainers):
            await processes.remove_leftovers()
        kubelet = NodeKubelet(
            sim.store, node.name, root, [sim.tessera.resource_name], processes,
            allocate_delay_s=settings.kubelet_delay_s, allocate_jitter_s=settings.kubelet_jitter_s,
        )
        dra = getattr(sim, "claims", None)
        if dra is not None:  # kubelet's DRA manager; it releases a deleted pod's claims
            kubelet.dra = DraKubelet(
                sim.store, node.name, root / node.name,
                [Path(d) for d in settings.cdi_spec_dirs.split(":") if d], dra.release)
            dra.kubelet_nodes.add(node.name)
        await kubelet.start()
        kubelets.append(kubelet)
    sim.api.kubelets = {k.node: k for k in kubelets}
    return kubelets
