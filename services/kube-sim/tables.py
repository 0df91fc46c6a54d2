"""Server-side printing: `meta.k8s.io/v1` Tables, what `kubectl get` asks for.

kubectl sends `Accept: application/json;as=Table;v=v1;g=meta.k8s.io`; the server answers with
column definitions and one row of cells per object, the columns kube-apiserver's printers use for
each kind (priority 1 columns appear with `-o wide`), and each row's object as
PartialObjectMetadata (or the full object with `includeObject=Object`). Ages are written as
apimachinery's HumanDuration writes them. Pure functions; `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

KubeObject = dict[str, Any]
Column = tuple[str, str, int]  # name, type, priority
Row = list[Any]


def wants_table(accept: str) -> bool:
    return any(
        "as=Table" in part and "g=meta.k8s.io" in part for part in accept.split(",")
    )


def parse_time(stamp: str | None) -> datetime | None:
    if not stamp:
        return None
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """apimachinery's duration.HumanDuration."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def age(stamp: str | None, now: datetime) -> str:
    when = parse_time(stamp)
    return "<unknown>" if when is None else human_duration((now - when).total_seconds())


def _containers(obj: KubeObject) -> tuple[str, str]:
    spec = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    containers = spec.get("containers") or []
    return (
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
    )


def _selector_text(obj: KubeObject) -> str:
    selector = (obj.get("spec") or {}).get("selector") or {}
    terms = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    for e in selector.get("matchExpressions") or []:
        terms.append(f"{e.get('key')} {e.get('operator', '').lower()} "
                     f"({','.join(e.get('values') or [])})")
    return ",".join(terms) or "<none>"


# --- per kind ----------------------------------------------------------------------------------


def pod_status_text(pod: KubeObject) -> str:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    reason = status.get("reason") or status.get("phase") or "Unknown"
    for c in status.get("containerStatuses") or []:
        state = c.get("state") or {}
        if "waiting" in state and state["waiting"].get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state and state["terminated"].get("reason"):
            reason = state["terminated"]["reason"]
    if status.get("phase") == "Pending" and not (pod.get("spec") or {}).get("nodeName"):
        return "Pending"
    if status.get("phase") == "Pending":
        return "ContainerCreating" if reason == "Pending" else reason
    return reason


def _pod(pod: KubeObject, now: datetime) -> Row:
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
    nominated = status.get("nominatedNodeName") or "<none>"
    return [
        pod["metadata"]["name"],
        f"{ready}/{len(spec.get('containers') or [])}",
        pod_status_text(pod),
        restarts,
        age(pod["metadata"].get("creationTimestamp"), now),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        nominated,
        "<none>",
    ]


def _node(node: KubeObject, now: datetime) -> Row:
    status = node.get("status") or {}
    ready = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {}
    )
    state = "Ready" if ready.get("status", "True") == "True" else "NotReady"
    if (node.get("spec") or {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = node["metadata"].get("labels") or {}
    roles = sorted(
        k.rsplit("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/")
    )
    info = status.get("nodeInfo") or {}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    return [
        node["metadata"]["name"],
        state,
        ",".join(roles) or "<none>",
        age(node["metadata"].get("creationTimestamp"), now),
        info.get("kubeletVersion", ""),
        addresses.get("InternalIP") or "<none>",
        addresses.get("ExternalIP") or "<none>",
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _namespace(ns: KubeObject, now: datetime) -> Row:
    phase = (ns.get("status") or {}).get("phase") or "Active"
    return [ns["metadata"]["name"], phase, age(ns["metadata"].get("creationTimestamp"), now)]


def _event(event: KubeObject, now: datetime) -> Row:
    involved = event.get("involvedObject") or {}
    last = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get(
        "creationTimestamp"
    )
    first = event.get("firstTimestamp") or last
    return [
        age(last, now),
        event.get("type", ""),
        event.get("reason", ""),
        f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
        involved.get("fieldPath", ""),
        event.get("message", ""),
        (event.get("source") or {}).get("component", ""),
        age(first, now),
        event.get("count", 1),
        event["metadata"]["name"],
    ]


def _quota(quota: KubeObject, now: datetime) -> Row:
    status = quota.get("status") or {}
    hard = status.get("hard") or (quota.get("spec") or {}).get("hard") or {}
    used = status.get("used") or {}
    requests = [f"{k}: {used.get(k, '0')}/{v}" for k, v in sorted(hard.items())
                if not k.startswith("limits.")]
    limits = [f"{k}: {used.get(k, '0')}/{v}" for k, v in sorted(hard.items())
              if k.startswith("limits.")]
    return [
        quota["metadata"]["name"],
        age(quota["metadata"].get("creationTimestamp"), now),
        ", ".join(requests),
        ", ".join(limits),
    ]


def _deployment(d: KubeObject, now: datetime) -> Row:
    spec, status = d.get("spec") or {}, d.get("status") or {}
    names, images = _containers(d)
    return [
        d["metadata"]["name"],
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        status.get("updatedReplicas", 0),
        status.get("availableReplicas", 0),
        age(d["metadata"].get("creationTimestamp"), now),
        names,
        images,
        _selector_text(d),
    ]


def _replicaset(rs: KubeObject, now: datetime) -> Row:
    spec, status = rs.get("spec") or {}, rs.get("status") or {}
    names, images = _containers(rs)
    return [
        rs["metadata"]["name"],
        spec.get("replicas", 1),
        status.get("replicas", 0),
        status.get("readyReplicas", 0),
        age(rs["metadata"].get("creationTimestamp"), now),
        names,
        images,
        _selector_text(rs),
    ]


def job_state(job: KubeObject) -> str:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            return str(condition["type"])
    if (job.get("spec") or {}).get("suspend"):
        return "Suspended"
    return "Running"


def _job(job: KubeObject, now: datetime) -> Row:
    spec, status = job.get("spec") or {}, job.get("status") or {}
    completions = spec.get("completions")
    succeeded = status.get("succeeded", 0)
    shown = f"{succeeded}/{completions}" if completions is not None else f"{succeeded}/1 of " \
        f"{spec.get('parallelism', 1)}"
    start = parse_time(status.get("startTime"))
    end = parse_time(status.get("completionTime")) or now
    duration = human_duration((end - start).total_seconds()) if start else ""
    names, images = _containers(job)
    return [
        job["metadata"]["name"],
        job_state(job),
        shown,
        duration,
        age(job["metadata"].get("creationTimestamp"), now),
        names,
        images,
        _selector_text(job),
    ]


def _priority_class(pc: KubeObject, now: datetime) -> Row:
    return [pc["metadata"]["name"], pc.get("value", 0), bool(pc.get("globalDefault", False)),
            age(pc["metadata"].get("creationTimestamp"), now),
            pc.get("preemptionPolicy") or "PreemptLowerPriority"]  # fmt: skip


def _budget(pdb: KubeObject, now: datetime) -> Row:
    spec = pdb.get("spec") or {}

    def amount(key: str) -> str:
        value = spec.get(key)
        return "N/A" if value is None else str(value)

    allowed = (pdb.get("status") or {}).get("disruptionsAllowed", 0)
    return [pdb["metadata"]["name"], amount("minAvailable"), amount("maxUnavailable"), allowed,
            age(pdb["metadata"].get("creationTimestamp"), now)]  # fmt: skip


def _default(obj: KubeObject, now: datetime) -> Row:
    return [obj["metadata"]["name"], age(obj["metadata"].get("creationTimestamp"), now)]


S, INT = "string", "integer"
PRINTERS: dict[str, tuple[list[Column], Callable[[KubeObject, datetime], Row]]] = {
    "Pod": (
        [("Name", S, 0), ("Ready", S, 0), ("Status", S, 0), ("Restarts", S, 0), ("Age", S, 0),
         ("IP", S, 1), ("Node", S, 1), ("Nominated Node", S, 1), ("Readiness Gates", S, 1)],
        _pod,
    ),
    "Node": (
        [("Name", S, 0), ("Status", S, 0), ("Roles", S, 0), ("Age", S, 0), ("Version", S, 0),
         ("Internal-IP", S, 1), ("External-IP", S, 1), ("OS-Image", S, 1),
         ("Kernel-Version", S, 1), ("Container-Runtime", S, 1)],
        _node,
    ),
    "Namespace": ([("Name", S, 0), ("Status", S, 0), ("Age", S, 0)], _namespace),
    "Event": (
        [("Last Seen", S, 0), ("Type", S, 0), ("Reason", S, 0), ("Object", S, 0),
         ("Subobject", S, 1), ("Message", S, 0), ("Source", S, 1), ("First Seen", S, 1),
         ("Count", INT, 1), ("Name", S, 1)],
        _event,
    ),
    "ResourceQuota": (
        [("Name", S, 0), ("Age", S, 0), ("Request", S, 0), ("Limit", S, 0)], _quota
    ),
    "Deployment": (
        [("Name", S, 0), ("Ready", S, 0), ("Up-to-date", INT, 0), ("Available", INT, 0),
         ("Age", S, 0), ("Containers", S, 1), ("Images", S, 1), ("Selector", S, 1)],
        _deployment,
    ),
    "ReplicaSet": (
        [("Name", S, 0), ("Desired", INT, 0), ("Current", INT, 0), ("Ready", INT, 0), ("Age", S, 0),
         ("Containers", S, 1), ("Images", S, 1), ("Selector", S, 1)],
        _replicaset,
    ),
    "Job": (
        [("Name", S, 0), ("Status", S, 0), ("Completions", S, 0), ("Duration", S, 0),
         ("Age", S, 0), ("Containers", S, 1), ("Images", S, 1), ("Selector", S, 1)],
        _job,
    ),
}
PRINTERS["PriorityClass"] = (
    [("Name", S, 0), ("Value", INT, 0), ("Global-Default", "boolean", 0), ("Age", S, 0),
     ("PreemptionPolicy", S, 0)],
    _priority_class,
)
PRINTERS["PodDisruptionBudget"] = (
    [("Name", S, 0), ("Min Available", S, 0), ("Max Unavailable", S, 0),
     ("Allowed Disruptions", INT, 0), ("Age", S, 0)],
    _budget,
)
DEFAULT_PRINTER: tuple[list[Column], Callable[[KubeObject, datetime], Row]] = (
    [("Name", S, 0), ("Age", S, 0)], _default
)


def row_object(obj: KubeObject, include: str) -> KubeObject | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj.get("metadata", {})}


def table(
    kind: str, objects: list[KubeObject], now: datetime, include: str = "Metadata",
    list_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    columns, printer = PRINTERS.get(kind, DEFAULT_PRINTER)
    definitions = [
        {"name": name, "type": kind_, "format": "name" if name == "Name" else "",
         "description": "", "priority": priority}
        for name, kind_, priority in columns
    ]
    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": printer(obj, now)}
        shown = row_object(obj, include)
        if shown is not None:
            row["object"] = shown
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta or {},
        "columnDefinitions": definitions,
        "rows": rows,
    }
