"""DeviceTaintRule (resource.k8s.io/v1beta2, beta) in kube-sim, as the "Device Taints and
Tolerations" page describes it: an admin taints devices without their driver. The rule's
selector picks devices by driver, pool and name (none: no device); a NoSchedule rule keeps new
claims off the device, a NoExecute rule evicts the pods already using it unless they tolerate
it, `None` is a dry run that changes nothing, and deleting the rule gives the device back.
Through the whole of kube-sim in process (HTTP API, scheduler, eviction controller, kubelet)."""

from __future__ import annotations

from typing import Any

import pytest

from kube_sim.dra_cluster import DRIVER, RESOURCE, Cluster, running_cluster
from kube_sim.test_dra_cluster import CLASS, exclusive_slice, exclusive_template, pod, running

pytestmark = pytest.mark.timeout(120)
RULES = "/apis/resource.k8s.io/v1beta2/devicetaintrules"
KEY = "example.com/maintenance"


def rule(name: str, effect: str, selector: dict[str, str] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": {"key": KEY, "value": "planned", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule",
            "metadata": {"name": name}, "spec": spec}


async def device_of(cluster: Cluster, pod_name: str) -> str:
    for claim in await cluster.claims():
        if claim["metadata"]["ownerReferences"][0]["name"] == pod_name:
            return claim["status"]["allocation"]["devices"]["results"][0]["device"]
    raise AssertionError(f"no claim for {pod_name}")


async def test_the_rule_is_served_validated_and_stamped() -> None:
    async with running_cluster(["node-a"]) as cluster:
        groups = (await cluster.get("/apis/resource.k8s.io"))["versions"]
        assert [g["version"] for g in groups] == ["v1", "v1beta2"]
        listed = await cluster.get("/apis/resource.k8s.io/v1beta2")
        assert [(r["name"], r["kind"], r["namespaced"]) for r in listed["resources"]] == [
            ("devicetaintrules", "DeviceTaintRule", False)]
        bad = await cluster.create(RULES, rule("bad", "PreferNoSchedule", {}), ok=False)
        assert bad.status_code == 422 and "spec.taint.effect" in bad.text
        created = (await cluster.create(RULES, rule("dry", "None", {"driver": DRIVER}))).json()
        stamp = created["spec"]["taint"]["timeAdded"]
        assert stamp and created["apiVersion"] == "resource.k8s.io/v1beta2"
        # a new effect restarts the clock the eviction counts from; the same effect does not
        merge = {"content-type": "application/merge-patch+json"}
        same = await cluster.http.patch(f"{RULES}/dry", headers=merge,
                                        json={"spec": {"taint": {"value": "later"}}})
        assert same.json()["spec"]["taint"]["timeAdded"] == stamp
        assert same.json()["spec"]["taint"]["value"] == "later"
        old = rule("old", "None", {"driver": DRIVER})
        old["spec"]["taint"]["timeAdded"] = "2020-01-01T00:00:00Z"
        await cluster.create(RULES, old)
        changed = await cluster.http.patch(f"{RULES}/old", headers=merge,
                                           json={"spec": {"taint": {"effect": "NoSchedule"}}})
        assert changed.json()["spec"]["taint"]["timeAdded"] > "2020-01-01T00:00:00Z"


async def test_rules_keep_new_claims_off_and_evict_what_does_not_tolerate_them() -> None:
    async with running_cluster(["node-a"]) as cluster:
        await cluster.plugin("node-a")
        await cluster.create(f"{RESOURCE}/deviceclasses", CLASS)
        exclusive = exclusive_slice("node-a", gpus=2)
        await cluster.create(f"{RESOURCE}/resourceslices", exclusive)
        toleration = {"key": KEY, "operator": "Exists", "effect": "NoExecute"}
        templates = f"{RESOURCE}/namespaces/default/resourceclaimtemplates"
        await cluster.create(templates, exclusive_template("plain", []))
        await cluster.create(templates, exclusive_template("tolerant", [toleration]))

        # a rule without a selector taints nothing; NoSchedule on gpu-0 sends the pod to gpu-1
        await cluster.create(RULES, rule("nothing", "NoExecute", None))
        await cluster.create(RULES, rule("drain-0", "NoSchedule",
                                         {"driver": DRIVER, "pool": "node-a", "device": "gpu-0"}))
        await cluster.create("/api/v1/namespaces/default/pods", pod("first", "plain"))
        await running(cluster, "first")
        assert await device_of(cluster, "first") == "gpu-1"
        await cluster.create("/api/v1/namespaces/default/pods", pod("second", "plain"))
        reason = "cannot allocate all claims"

        async def refused() -> bool:
            described = await cluster.events("FailedScheduling", "second")
            return any(reason in m for m in described)

        await cluster.wait_for("second refused: gpu-0 tainted, gpu-1 taken", refused)
        assert await cluster.phase("second") == "Pending"
        assert (await cluster.http.delete(f"{RULES}/drain-0")).status_code == 200
        await running(cluster, "second")  # the device is back
        assert await device_of(cluster, "second") == "gpu-0"

        # a dry run (effect None) on the pool evicts nobody; NoExecute evicts the intolerant
        await cluster.create(RULES, rule("pool", "None", {"pool": "node-a"}))
        await cluster.create("/api/v1/namespaces/default/pods", pod("third", "tolerant"))
        assert await cluster.phase("first") == "Running"
        merge = {"content-type": "application/merge-patch+json"}
        patched = await cluster.http.patch(f"{RULES}/pool", headers=merge,
                                           json={"spec": {"taint": {"effect": "NoExecute"}}})
        assert patched.status_code == 200, patched.text

        async def gone(name: str) -> bool:
            response = await cluster.http.get(f"/api/v1/namespaces/default/pods/{name}")
            return response.status_code == 404

        await cluster.wait_for("first evicted", lambda: gone("first"))
        await cluster.wait_for("second evicted", lambda: gone("second"))
        assert "Marking for deletion" in await cluster.events("DeviceTaintManagerEviction",
                                                              "first")
        await running(cluster, "third")  # it tolerates the taint: placed, and stays
        assert await cluster.phase("third") == "Running"
