"""Per-kind object rules of kube-sim's API server: what a create fills in (namespaces, a Job's
selector, a quota's status.hard, a pod's QoS class), the `scale` view of a workload, and what an
update may not change, worded as kube-apiserver's update validation. Pure functions."""

from __future__ import annotations

import copy
from typing import Any

from tessera.kube_sim import validation
from tessera.kube_sim.dra import objects as dra_objects
from tessera.kube_sim.store import KubeObject

WORKLOADS = ("Deployment", "ReplicaSet", "Job")

def namespace_object(name: str) -> KubeObject:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }


def quota_status(quota: KubeObject) -> None:
    """status.hard follows spec.hard, as kube-controller-manager's quota controller keeps it
    (status.used is written by whoever counts: Tessera's quota service)."""
    hard = (quota.get("spec") or {}).get("hard")
    if isinstance(hard, dict):
        status = quota.setdefault("status", {})
        if isinstance(status, dict):
            status["hard"] = dict(hard)


def job_selector(job: KubeObject) -> None:
    """batch/v1 defaulting: a Job selects its pods by its own uid unless told otherwise."""
    spec = job["spec"]
    uid, name = job["metadata"]["uid"], job["metadata"]["name"]
    labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
    labels.setdefault("batch.kubernetes.io/controller-uid", uid)
    labels.setdefault("batch.kubernetes.io/job-name", name)
    labels.setdefault("controller-uid", uid)
    labels.setdefault("job-name", name)
    if not spec.get("selector"):
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}


def qos_class(spec: dict[str, Any]) -> str:
    containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    resources = [c.get("resources") or {} for c in containers if isinstance(c, dict)]
    resources = [r for r in resources if isinstance(r, dict)]  # wrong shapes: validation's
    named = [r for r in resources if r.get("requests") or r.get("limits")]
    if not named:
        return "BestEffort"
    for r in resources:
        limits, requests = r.get("limits") or {}, r.get("requests") or {}
        if not isinstance(limits, dict) or not isinstance(requests, dict):
            return "Burstable"
        for name in ("cpu", "memory"):
            if name not in limits or str(requests.get(name, limits[name])) != str(limits[name]):
                return "Burstable"
    return "Guaranteed"


def scale_of(obj: KubeObject) -> KubeObject:
    meta = obj["metadata"]
    match = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                          "creationTimestamp") if k in meta},
        "spec": {"replicas": obj["spec"].get("replicas", 1)},
        "status": {
            "replicas": (obj.get("status") or {}).get("replicas", 0),
            "selector": ",".join(f"{k}={v}" for k, v in match.items()),
        },
    }


POD_MUTABLE = (
    "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
    "`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"
)


def _without_images(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for key in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"):
        spec.pop(key, None)
    for section in ("containers", "initContainers"):
        for container in spec.get(section) or []:
            if isinstance(container, dict):
                container.pop("image", None)
    return spec


def validate_update(kind: str, old: KubeObject, new: KubeObject) -> None:
    """What an update may not change, worded as kube-apiserver's update validation."""
    name = old["metadata"]["name"]
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    if kind == "Pod" and old_spec != new_spec:
        for section in ("containers", "initContainers"):
            for container in new_spec.get(section) or []:
                if isinstance(container, dict):
                    validation.default_resources(container)
        bound = old_spec.get("nodeName")
        if bound and not new_spec.get("nodeName"):
            new_spec["nodeName"] = bound
        if _without_images(old_spec) != _without_images(new_spec):
            raise validation.invalid("Pod", name, [validation.FieldError(
                "Forbidden", "spec", f"pod updates may not change fields other than "
                f"{POD_MUTABLE}")])
    elif kind == "ResourceQuota":
        quota_status(new)
    elif kind in dra_objects.KINDS:
        dra_objects.check_update(kind, old, new)
    elif kind in WORKLOADS:
        validation.prepare_workload(kind, new)
        if old_spec.get("selector") != new_spec.get("selector"):
            raise validation.invalid(kind, name, [validation.FieldError(
                "Invalid", "spec.selector", "field is immutable", new_spec.get("selector"))])
        if kind == "Job" and old_spec.get("template") != new_spec.get("template"):
            raise validation.invalid(kind, name, [validation.FieldError(
                "Invalid", "spec.template", "field is immutable", "core.PodTemplateSpec{...}")])
        if kind == "Job" and old_spec.get("completions") != new_spec.get("completions"):
            raise validation.invalid(kind, name, [validation.FieldError(
                "Invalid", "spec.completions", "field is immutable",
                new_spec.get("completions"))])
