"""kube-sim's workload controllers (Deployment, ReplicaSet, Job) driven pass by pass against the
real store and API server create/delete paths; the kubelet's part (a pod Running, Succeeded,
Failed) is played by writing the pod's status, as a kubelet does."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.controllers import WorkloadControllers
from tessera.kube_sim.store import KubeObject, ObjectStore, Selector, StoreError

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def template(image: str = "cuda:12", labels: dict[str, str] | None = None,
             restart: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": image,
                                            "resources": {"limits": {"nvidia.com/gpu": 1}}}]}
    if restart:
        spec["restartPolicy"] = restart
    return {"metadata": {"labels": labels or {"app": "web"}}, "spec": spec}


def deployment(replicas: int = 3, image: str = "cuda:12") -> KubeObject:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                     "template": template(image)}}


def job(parallelism: int, completions: int | None, backoff: int = 6) -> KubeObject:
    spec: dict[str, Any] = {"parallelism": parallelism, "backoffLimit": backoff,
                            "template": template(restart="Never", labels={"app": "train"})}
    if completions is not None:
        spec["completions"] = completions
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"}, "spec": spec}


class Rig:
    def __init__(self, admit: Any = None) -> None:
        self.store = ObjectStore()
        self.api = ApiServer(self.store, admit)
        self.clock = Clock()
        self.controllers = WorkloadControllers(self.api, clock=self.clock)

    def pods(self, **labels: str) -> list[KubeObject]:
        return self.store.list("Pod", Selector(namespace="default", labels=labels))

    def set_phase(self, pod: KubeObject, phase: str) -> None:
        def apply(obj: KubeObject) -> None:
            obj["spec"]["nodeName"] = "n1"
            ready = "True" if phase == "Running" else "False"
            obj["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}

        self.store.mutate("Pod", "default", pod["metadata"]["name"], apply)

    def get(self, kind: str, name: str) -> KubeObject:
        return self.store.get(kind, "default", name)

    def events(self, reason: str) -> list[str]:
        return [e["message"] for e in self.store.list("Event", Selector())
                if e["reason"] == reason]


async def test_replicaset_keeps_its_replicas_and_drops_unready_pods_first() -> None:
    rig = Rig()
    rs = await rig.api.create_object("ReplicaSet", "default", {
        "metadata": {"name": "web-abc"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                 "template": template()},
    })
    await rig.controllers.reconcile()
    pods = rig.pods(app="web")
    assert len(pods) == 3
    for pod in pods:
        assert pod["metadata"]["name"].startswith("web-abc-")
        assert pod["metadata"]["ownerReferences"] == [{
            "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-abc",
            "uid": rs["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        # the pod went through the API server's create path: defaults and validation applied
        assert pod["spec"]["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "1"}
    rig.set_phase(pods[0], "Running")
    rig.api.delete_object("Pod", "default", pods[1]["metadata"]["name"])
    await rig.controllers.reconcile()
    names = {p["metadata"]["name"] for p in rig.pods(app="web")}
    assert len(names) == 3 and pods[1]["metadata"]["name"] not in names

    def scale(obj: KubeObject) -> None:
        obj["spec"]["replicas"] = 1

    rig.store.mutate("ReplicaSet", "default", "web-abc", scale)
    await rig.controllers.reconcile()
    assert [p["metadata"]["name"] for p in rig.pods(app="web")] == [pods[0]["metadata"]["name"]]
    status = rig.get("ReplicaSet", "web-abc")["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert len(rig.events("SuccessfulDelete")) == 2


async def test_deployment_rolls_a_new_template_and_deletes_in_cascade() -> None:
    rig = Rig()
    await rig.api.create_object("Deployment", "default", deployment(3, "cuda:12"))
    await rig.controllers.reconcile()
    await rig.controllers.reconcile()
    [first] = rig.store.list("ReplicaSet", Selector())
    digest = first["metadata"]["labels"]["pod-template-hash"]
    assert first["metadata"]["name"] == f"web-{digest}"
    assert first["spec"]["selector"]["matchLabels"] == {"app": "web", "pod-template-hash": digest}
    assert first["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "1"
    for pod in rig.pods(app="web"):
        rig.set_phase(pod, "Running")
    await rig.controllers.reconcile()
    await rig.controllers.reconcile()
    status = rig.get("Deployment", "web")["status"]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 3, 3)
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Available": "True", "Progressing": "True"}

    def new_image(obj: KubeObject) -> None:
        obj["spec"]["template"]["spec"]["containers"][0]["image"] = "cuda:13"

    rig.store.mutate("Deployment", "default", "web", new_image)
    await rig.controllers.reconcile()
    await rig.controllers.reconcile()
    sets = {r["metadata"]["name"]: r for r in rig.store.list("ReplicaSet", Selector())}
    assert len(sets) == 2 and sets[first["metadata"]["name"]]["spec"]["replicas"] == 0
    [second] = [r for r in sets.values() if r["metadata"]["name"] != first["metadata"]["name"]]
    assert second["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
    images = {p["spec"]["containers"][0]["image"] for p in rig.pods(app="web")}
    assert images == {"cuda:13"}  # recreate: the old pods are gone, the new ones made
    assert len(rig.pods(app="web")) == 3
    assert rig.get("Deployment", "web")["metadata"]["annotations"][
        "deployment.kubernetes.io/revision"] == "2"

    rig.api.delete_object("Deployment", "default", "web")  # Background: everything goes
    assert rig.store.list("ReplicaSet", Selector()) == [] and rig.pods() == []


async def test_orphan_deletion_keeps_the_pods_without_an_owner() -> None:
    rig = Rig()
    await rig.api.create_object("ReplicaSet", "default", {
        "metadata": {"name": "keep"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": template()},
    })
    await rig.controllers.reconcile()
    rig.api.delete_object("ReplicaSet", "default", "keep", policy="Orphan")
    pods = rig.pods(app="web")
    assert len(pods) == 2 and all("ownerReferences" not in p["metadata"] for p in pods)


async def test_job_runs_parallelism_pods_until_completions_succeed() -> None:
    rig = Rig()
    await rig.api.create_object("Job", "default", job(parallelism=2, completions=5))
    seen: set[str] = set()
    for _ in range(10):
        await rig.controllers.reconcile()
        running = [p for p in rig.pods(app="train")
                   if p.get("status", {}).get("phase") in ("Pending", "Running")]
        assert len(running) <= 2
        seen |= {p["metadata"]["name"] for p in rig.pods(app="train")}
        for pod in running:
            rig.set_phase(pod, "Succeeded")
    train = rig.get("Job", "train")
    assert train["status"]["succeeded"] == 5 and train["status"]["active"] == 0
    assert [c["type"] for c in train["status"]["conditions"]] == ["Complete"]
    assert "completionTime" in train["status"]
    assert len(seen) == 5  # never a pod more than the completions need
    labels = rig.pods(app="train")[0]["metadata"]["labels"]
    assert labels["job-name"] == "train"
    assert labels["batch.kubernetes.io/controller-uid"] == train["metadata"]["uid"]


async def test_job_without_completions_ends_when_one_succeeded_and_none_runs() -> None:
    rig = Rig()
    await rig.api.create_object("Job", "default", job(parallelism=3, completions=None))
    await rig.controllers.reconcile()
    pods = rig.pods(app="train")
    assert len(pods) == 3
    rig.set_phase(pods[0], "Succeeded")
    await rig.controllers.reconcile()
    assert len(rig.pods(app="train")) == 3  # no new pod once one succeeded
    assert "conditions" not in rig.get("Job", "train")["status"]
    for pod in pods[1:]:
        rig.set_phase(pod, "Succeeded")
    await rig.controllers.reconcile()
    assert rig.get("Job", "train")["status"]["conditions"][0]["type"] == "Complete"


async def test_job_fails_past_its_backoff_limit() -> None:
    rig = Rig()
    await rig.api.create_object("Job", "default", job(parallelism=1, completions=3, backoff=1))
    for _ in range(3):
        await rig.controllers.reconcile()
        for pod in rig.pods(app="train"):
            if pod.get("status", {}).get("phase") == "Pending":
                rig.set_phase(pod, "Failed")
    await rig.controllers.reconcile()
    status = rig.get("Job", "train")["status"]
    assert status["failed"] == 2
    assert [(c["type"], c.get("reason")) for c in status["conditions"]] == [
        ("Failed", "BackoffLimitExceeded")]
    await rig.controllers.reconcile()
    assert rig.get("Job", "train")["status"]["failed"] == 2  # no pod after the failure


async def test_a_refused_pod_is_an_event_and_retried_with_backoff() -> None:
    refusals = [2]

    async def admit(pod: KubeObject, operation: str) -> KubeObject:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise StoreError(400, "BadRequest", 'admission webhook "vgpu.tessera.io" denied '
                             "the request: over quota")
        return pod

    rig = Rig(admit)
    await rig.api.create_object("ReplicaSet", "default", {
        "metadata": {"name": "web-q"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": template()},
    })
    await rig.controllers.reconcile()
    assert rig.pods() == []
    assert rig.events("FailedCreate") == [
        'Error creating: admission webhook "vgpu.tessera.io" denied the request: over quota']
    await rig.controllers.reconcile()  # backing off: no second try yet
    assert len(rig.events("FailedCreate")) == 1
    rig.clock.now += 1.5
    await rig.controllers.reconcile()
    assert len(rig.events("FailedCreate")) == 2
    rig.clock.now += 5
    await rig.controllers.reconcile()
    assert len(rig.pods(app="web")) == 2


async def test_workloads_are_validated_as_the_api_server_does() -> None:
    rig = Rig()
    bad = deployment()
    bad["spec"]["template"]["metadata"]["labels"] = {"app": "other"}
    with pytest.raises(StoreError) as refused:
        await rig.api.create_object("Deployment", "default", bad)
    assert refused.value.status == 422
    assert refused.value.message == (
        'Deployment.apps "web" is invalid: spec.template.metadata.labels: Invalid value: '
        'map[string]string{"app":"other"}: `selector` does not match template `labels`')
    assert refused.value.details["causes"][0]["reason"] == "FieldValueInvalid"
    always = job(1, 1)
    always["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    with pytest.raises(StoreError) as refused:
        await rig.api.create_object("Job", "default", always)
    assert ('spec.template.spec.restartPolicy: Unsupported value: "Always": supported values: '
            '"OnFailure", "Never"') in refused.value.message


async def test_the_running_loop_converges_from_watch_events() -> None:
    rig = Rig()
    stop = asyncio.Event()
    task = asyncio.create_task(rig.controllers.run(stop))
    try:
        await rig.api.create_object("Deployment", "default", deployment(2))
        deadline = time.monotonic() + 20  # generous: a loaded machine
        while len(rig.pods(app="web")) != 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(rig.pods(app="web")) == 2
    finally:
        stop.set()
        await task
