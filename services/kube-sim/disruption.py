"""Priority and disruption: PriorityClasses, the Priority admission step, PodDisruptionBudgets and
the Eviction subresource with graceful termination.

Facts of the Kubernetes API this follows:
- `scheduling.k8s.io/v1` PriorityClass (cluster-scoped): `value` (int32; user classes at most
  1,000,000,000), `globalDefault` (at most one class), `preemptionPolicy` (`PreemptLowerPriority`
  default, or `Never`). Built in: `system-cluster-critical` (2000000000) and
  `system-node-critical` (2000001000).
- The Priority admission plugin, on pod CREATE: `spec.priorityClassName` must name a class (403
  otherwise); without one the globalDefault class applies, else priority 0. It sets
  `spec.priority` and `spec.preemptionPolicy`; a pod that sets a different `spec.priority`
  itself is refused (403).
- `policy/v1` PodDisruptionBudget: `spec.selector`, exactly one of `minAvailable` /
  `maxUnavailable` (integer or percentage). Its status is computed from the pods it selects:
  `currentHealthy` (Running, Ready, not terminating), `desiredHealthy`, `expectedPods`,
  `disruptionsAllowed = max(0, currentHealthy - desiredHealthy)`.
- `POST pods/<name>/eviction` (policy/v1 Eviction, `deleteOptions.preconditions.uid`,
  `deleteOptions.gracePeriodSeconds`): 429 TooManyRequests when it would violate a budget,
  otherwise a graceful delete: `metadata.deletionTimestamp` and `deletionGracePeriodSeconds` are
  set, the containers get SIGTERM, and SIGKILL once the grace period (default
  `spec.terminationGracePeriodSeconds`, 30) ends; the object goes when they have stopped.

Containers without a process (kube-sim's default) stop at SIGTERM, unless the pod carries the
test annotation `kube-sim.tessera.io/on-sigterm: ignore`: then they run to the end of the grace
period, as a process that ignores SIGTERM does. Processes (`RUN_CONTAINERS`) get real signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tessera.kube_sim import protobuf, tables
from tessera.kube_sim.store import (
    KubeObject,
    ObjectStore,
    Selector,
    StoreError,
    conflict,
    now_rfc3339,
)

log = logging.getLogger("tessera.kube_sim.disruption")

PRIORITY_CLASS = "PriorityClass"
PDB = "PodDisruptionBudget"
IGNORE_SIGTERM_ANNOTATION = "kube-sim.tessera.io/on-sigterm"
DEFAULT_GRACE_S = 30
MAX_USER_PRIORITY = 1_000_000_000
SYSTEM_CLASSES = {"system-cluster-critical": 2_000_000_000, "system-node-critical": 2_000_001_000}
POLICIES = ("PreemptLowerPriority", "Never")
_PERCENT = re.compile(r"^(\d{1,3})%$")

# (node, pod uid, grace seconds) -> awaitable that stops the pod's processes; None = no processes
StopProcesses = Callable[[str, str, float], Any]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


def _error(error: StoreError) -> JSONResponse:
    return JSONResponse(_status(error.status, error.reason, str(error)), error.status)


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """metav1.LabelSelector: matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _amount(value: Any, expected: int, round_up: bool) -> int:
    """An IntOrString: an integer, or a percentage of `expected`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _PERCENT.match(str(value))
    if not match:
        raise StoreError(422, "Invalid", f"invalid value {value!r}: an integer or a percentage")
    share = int(match.group(1)) * expected / 100
    return math.ceil(share) if round_up else math.floor(share)


def pod_healthy(pod: KubeObject) -> bool:
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])  # fmt: skip


def budget_status(pdb: KubeObject, pods: list[KubeObject]) -> dict[str, Any]:
    spec = pdb.get("spec") or {}
    namespace = pdb["metadata"].get("namespace", "default")
    selected = [
        p for p in pods
        if p["metadata"].get("namespace") == namespace
        and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        and selector_matches(spec.get("selector") or {}, p["metadata"].get("labels") or {})
    ]  # fmt: skip
    expected = len(selected)
    healthy = sum(1 for p in selected if pod_healthy(p))
    if spec.get("minAvailable") is not None:
        desired = _amount(spec["minAvailable"], expected, round_up=True)
    else:
        desired = max(0, expected - _amount(spec.get("maxUnavailable", 0), expected, True))
    return {
        "observedGeneration": pdb["metadata"].get("generation", 1),
        "currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": expected,
        "disruptionsAllowed": max(0, healthy - desired),
    }  # fmt: skip


class Disruption:
    """The routes and the admission step; `stop_processes` reaches the kubelets' processes."""

    def __init__(
        self, store: ObjectStore, stop_processes: StopProcesses | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:  # fmt: skip
        self.store = store
        self.now = now  # the Tables' ages
        self.stop_processes = stop_processes
        self._terminations: set[asyncio.Task[None]] = set()
        for name, value in SYSTEM_CLASSES.items():
            self.store.create(PRIORITY_CLASS, {
                "apiVersion": "scheduling.k8s.io/v1", "kind": PRIORITY_CLASS,
                "metadata": {"name": name, "namespace": ""}, "value": value,
                "globalDefault": False, "preemptionPolicy": "PreemptLowerPriority",
            })  # fmt: skip

    def routes(self) -> list[Route]:
        pc = "/apis/scheduling.k8s.io/v1/priorityclasses"
        pdb_ns = "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
        return [
            Route(pc, self.priority_classes, methods=["GET", "POST"]),
            Route(f"{pc}/{{name}}", self.priority_class, methods=["GET", "DELETE"]),
            Route("/apis/policy/v1/poddisruptionbudgets", self.budgets, methods=["GET"]),
            Route(pdb_ns, self.budgets, methods=["GET", "POST"]),
            Route(f"{pdb_ns}/{{name}}", self.budget, methods=["GET", "DELETE"]),
            Route("/api/v1/namespaces/{namespace}/pods/{name}/eviction", self.evict,
                  methods=["POST"]),
        ]

    def _listing(
        self, request: Request, kind: str, items: list[KubeObject],
        meta: dict[str, Any] | None = None,
    ) -> Response | None:  # fmt: skip
        """The Table `kubectl get` asks for (Accept: ...;as=Table), else None."""
        if not tables.wants_table(request.headers.get("accept", "")):
            return None
        include = request.query_params.get("includeObject", "Metadata")
        return JSONResponse(tables.table(kind, items, self.now(), include, meta))

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        if "protobuf" in request.headers.get("content-type", ""):  # `kubectl create <kind>`
            body: Any = protobuf.read(await request.body())
        else:
            try:
                body = await request.json()
            except ValueError as exc:
                raise StoreError(400, "BadRequest", f"invalid JSON body: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.setdefault("metadata", {}), dict):
            raise StoreError(400, "BadRequest", "the body must be an object with metadata")
        return body

    # --- PriorityClass --------------------------------------------------------------------

    async def priority_classes(self, request: Request) -> Response:
        try:
            if request.method == "GET":
                items = self.store.list(PRIORITY_CLASS, Selector())
                meta = {"resourceVersion": str(self.store.version)}
                return self._listing(request, PRIORITY_CLASS, items, meta) or JSONResponse(
                    {"kind": "PriorityClassList", "metadata": meta,
                     "apiVersion": "scheduling.k8s.io/v1", "items": items})  # fmt: skip
            body = await self._json(request)
            name = body["metadata"].get("name")
            value = body.get("value")
            if not isinstance(name, str) or not name:
                raise StoreError(422, "Invalid", "metadata.name: Required value")
            if not isinstance(value, int) or isinstance(value, bool):
                raise StoreError(422, "Invalid", "value: Required value (an integer)")
            if value > MAX_USER_PRIORITY or value < -2_147_483_648:
                raise StoreError(422, "Invalid", f"value: Invalid value: {value}: must be at "
                                 f"most {MAX_USER_PRIORITY} (higher values are reserved for "
                                 "system classes)")  # fmt: skip
            policy = body.setdefault("preemptionPolicy", "PreemptLowerPriority")
            if policy not in POLICIES:
                raise StoreError(422, "Invalid",
                                 f"preemptionPolicy: Unsupported value: {policy!r}")
            body["globalDefault"] = bool(body.get("globalDefault", False))
            if body["globalDefault"] and self._global_default() is not None:
                raise StoreError(422, "Invalid", "globalDefault: Forbidden: PriorityClass "
                                 f"{self._global_default()['metadata']['name']} is already "
                                 "marked as default; only one default can exist")  # fmt: skip
            body["metadata"]["namespace"] = ""
            body.update(apiVersion="scheduling.k8s.io/v1", kind=PRIORITY_CLASS)
            return JSONResponse(self.store.create(PRIORITY_CLASS, body), 201)
        except StoreError as error:
            return _error(error)

    async def priority_class(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            if request.method == "GET":
                found = self.store.get(PRIORITY_CLASS, "", name)
                return self._listing(request, PRIORITY_CLASS, [found]) or JSONResponse(found)
            return JSONResponse(self.store.delete(PRIORITY_CLASS, "", name))
        except StoreError as error:
            return _error(error)

    def _global_default(self) -> KubeObject | None:
        return next((c for c in self.store.list(PRIORITY_CLASS, Selector())
                     if c.get("globalDefault")), None)  # fmt: skip

    def admit_priority(self, pod: KubeObject) -> KubeObject:
        """The Priority admission plugin (pod CREATE): resolve spec.priority."""
        spec = pod["spec"]
        class_name = spec.get("priorityClassName")
        if class_name:
            try:
                pc = self.store.get(PRIORITY_CLASS, "", str(class_name))
            except StoreError:
                raise StoreError(403, "Forbidden", f'pods "{pod["metadata"].get("name")}" is '
                                 f"forbidden: no PriorityClass with name {class_name} was found"
                                 ) from None  # fmt: skip
        else:
            pc = self._global_default()
        value = pc["value"] if pc else 0
        policy = (pc or {}).get("preemptionPolicy", "PreemptLowerPriority")
        given = spec.get("priority")
        if given is not None and given != value:
            raise StoreError(403, "Forbidden", "the integer value of priority "
                             f"({given}) must not be provided in pod spec; priority admission "
                             f"controller computed {value} from the given PriorityClass name")
        if pc is not None:
            spec["priorityClassName"] = pc["metadata"]["name"]
        spec["priority"] = value
        spec.setdefault("preemptionPolicy", policy)
        return pod

    # --- PodDisruptionBudget ------------------------------------------------------------

    def _with_status(self, pdb: KubeObject) -> KubeObject:
        pods = self.store.list("Pod", Selector(namespace=pdb["metadata"].get("namespace")))
        return {**pdb, "status": budget_status(pdb, pods)}

    async def budgets(self, request: Request) -> Response:
        namespace = request.path_params.get("namespace")
        try:
            if request.method == "GET":
                items = [self._with_status(p)
                         for p in self.store.list(PDB, Selector(namespace=namespace))]
                meta = {"resourceVersion": str(self.store.version)}
                return self._listing(request, PDB, items, meta) or JSONResponse(
                    {"kind": "PodDisruptionBudgetList", "apiVersion": "policy/v1",
                     "metadata": meta, "items": items})  # fmt: skip
            body = await self._json(request)
            spec = body.get("spec")
            if not isinstance(spec, dict) or not isinstance(spec.get("selector"), dict):
                raise StoreError(422, "Invalid", "spec.selector: Required value")
            if (spec.get("minAvailable") is None) == (spec.get("maxUnavailable") is None):
                raise StoreError(422, "Invalid", "spec: Invalid value: minAvailable and "
                                 "maxUnavailable: exactly one must be set")  # fmt: skip
            for key in ("minAvailable", "maxUnavailable"):
                if spec.get(key) is not None:
                    _amount(spec[key], 1, True)  # 422 when malformed
            body["metadata"]["namespace"] = namespace or "default"
            body["metadata"].setdefault("generation", 1)
            body.update(apiVersion="policy/v1", kind=PDB)
            return JSONResponse(self._with_status(self.store.create(PDB, body)), 201)
        except StoreError as error:
            return _error(error)

    async def budget(self, request: Request) -> Response:
        namespace, name = request.path_params["namespace"], request.path_params["name"]
        try:
            if request.method == "GET":
                found = self._with_status(self.store.get(PDB, namespace, name))
                return self._listing(request, PDB, [found]) or JSONResponse(found)
            return JSONResponse(self.store.delete(PDB, namespace, name))
        except StoreError as error:
            return _error(error)

    # --- Eviction ---------------------------------------------------------------------------

    async def evict(self, request: Request) -> Response:
        namespace, name = request.path_params["namespace"], request.path_params["name"]
        try:
            body = await self._json(request)
            options = body.get("deleteOptions") or {}
            uid = (options.get("preconditions") or {}).get("uid")
            pod = self.store.get("Pod", namespace, name)
            if uid and pod["metadata"].get("uid") != uid:
                raise conflict(f"Precondition failed: UID in precondition: {uid}, UID in object "
                               f"meta: {pod['metadata'].get('uid')}")  # fmt: skip
            if not pod["metadata"].get("deletionTimestamp"):
                self._check_budgets(pod)
            grace = options.get("gracePeriodSeconds")
            if not isinstance(grace, int) or grace < 0:
                grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
            if not isinstance(grace, int) or grace < 0:
                grace = DEFAULT_GRACE_S
            self.delete_gracefully(pod, grace)
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                 "status": "Success", "code": 201}, 201)  # fmt: skip
        except StoreError as error:
            return _error(error)

    def _check_budgets(self, pod: KubeObject) -> None:
        namespace = pod["metadata"].get("namespace", "default")
        labels = pod["metadata"].get("labels") or {}
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Pending", "Succeeded", "Failed"):
            return  # not running: evicting it disrupts nothing
        for pdb in self.store.list(PDB, Selector(namespace=namespace)):
            if not selector_matches((pdb.get("spec") or {}).get("selector") or {}, labels):
                continue
            status = self._with_status(pdb)["status"]
            if pod_healthy(pod):
                allowed = status["disruptionsAllowed"] > 0
            else:  # IfHealthyBudget: an unhealthy pod only while the budget is met
                allowed = status["currentHealthy"] >= status["desiredHealthy"]
            if not allowed:
                raise StoreError(429, "TooManyRequests", "Cannot evict pod as it would violate "
                                 f"the pod's disruption budget {pdb['metadata']['name']}.")

    def delete_gracefully(self, pod: KubeObject, grace_s: int) -> None:
        meta = pod["metadata"]
        namespace, name = meta.get("namespace", "default"), meta["name"]

        def mark(obj: KubeObject) -> None:
            obj["metadata"].setdefault("deletionTimestamp", now_rfc3339())
            obj["metadata"].setdefault("deletionGracePeriodSeconds", grace_s)

        self.store.mutate("Pod", namespace, name, mark)
        if meta.get("deletionTimestamp"):
            return  # already terminating: its termination is under way
        task = asyncio.get_running_loop().create_task(self._terminate(pod, grace_s))
        self._terminations.add(task)
        task.add_done_callback(self._terminations.discard)

    async def _terminate(self, pod: KubeObject, grace_s: int) -> None:
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName")
        started = time.monotonic()
        stopped = False
        if node and self.stop_processes is not None:
            stopped = bool(await self.stop_processes(node, meta.get("uid", ""), float(grace_s)))
        ignores = (meta.get("annotations") or {}).get(IGNORE_SIGTERM_ANNOTATION) == "ignore"
        if not stopped and ignores:
            await asyncio.sleep(max(0.0, grace_s - (time.monotonic() - started)))
        with contextlib.suppress(StoreError):
            self.store.delete("Pod", meta.get("namespace", "default"), meta["name"],
                              meta.get("uid"))
        log.info("pod terminated", extra={"pod": meta["name"], "grace_s": grace_s,
                                          "after_s": round(time.monotonic() - started, 2)})

    async def close(self) -> None:
        for task in list(self._terminations):
            task.cancel()
