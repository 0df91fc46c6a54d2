"""DRA through the whole of kube-sim (in process, real HTTP and gRPC): the resourceclaim
controller makes claims from templates, the scheduler allocates them with consumable capacity
before binding, kubelet prepares them through a registered DRA plugin (a test double) and
gives the container its CDI devices, and deleting the pod unprepares and frees the share."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kube_sim.dra_cluster import DRIVER, RESOURCE, Cluster, running_cluster

pytestmark = pytest.mark.timeout(120)

CLASS = {"metadata": {"name": DRIVER}, "spec": {"selectors": [
    {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}


def shared_slice(node: str, gpus: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": f"{node}-{DRIVER}"}, "spec": {
        "driver": DRIVER, "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": [{
            "name": f"gpu-{i}", "allowMultipleAllocations": True,
            "attributes": {"model": {"string": "A10"}, "uuid": {"string": f"GPU-{node}-{i}"}},
            "capacity": {
                "memory": {"value": "24Gi", "requestPolicy": {
                    "default": "1Gi", "validRange": {"min": "256Mi", "step": "256Mi"}}},
                "cores": {"value": "100", "requestPolicy": {
                    "default": "100", "validRange": {"min": "1", "max": "100"}}}}}
            for i in range(gpus)]}}


def exclusive_slice(node: str, gpus: int = 1) -> dict[str, Any]:
    """`shared_slice` with whole devices: no multiple allocations, memory as a plain figure."""
    exclusive = shared_slice(node, gpus)
    for device in exclusive["spec"]["devices"]:
        device.pop("allowMultipleAllocations")
        device["capacity"] = {"memory": {"value": "24Gi"}}
    return exclusive


def exclusive_template(name: str, tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    """A claim template asking one whole device of the class, with `tolerations`."""
    return {"metadata": {"name": name}, "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER,
                                    "tolerations": tolerations}}]}}}}  # fmt: skip


def template(name: str = "slice", memory: str = "4Gi", cores: str = "30") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "capacity": {
            "requests": {"memory": memory, "cores": cores}}}}]}}}}


def pod(name: str, template_name: str = "slice", claims: Any = None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {
        "resourceClaims": claims or [{"name": "gpu", "resourceClaimTemplateName": template_name}],
        "containers": [{"name": "main", "image": "cuda:12",
                        "resources": {"claims": [{"name": "gpu"}]}}]}}


async def setup(cluster: Cluster, node: str = "node-a") -> None:
    await cluster.create(f"{RESOURCE}/deviceclasses", CLASS)
    await cluster.create(f"{RESOURCE}/resourceslices", shared_slice(node))
    await cluster.create(f"{RESOURCE}/namespaces/default/resourceclaimtemplates", template())


async def running(cluster: Cluster, name: str) -> dict[str, Any]:
    await cluster.wait_for(f"{name} Running", lambda: _is_running(cluster, name))
    return await cluster.pod(name)


async def _is_running(cluster: Cluster, name: str) -> bool:
    return await cluster.phase(name) == "Running"


async def test_template_claims_share_a_gpu_and_a_pod_that_does_not_fit_pends() -> None:
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a")
        await setup(cluster)
        for i in range(3):
            await cluster.create("/api/v1/namespaces/default/pods", pod(f"p{i}"))
        pods = [await running(cluster, f"p{i}") for i in range(3)]
        assert plugin.statuses == [(True, "")]  # kubelet told the plugin it registered

        first = pods[0]
        [status] = first["status"]["resourceClaimStatuses"]
        assert status["name"] == "gpu" and status["resourceClaimName"].startswith("p0-gpu-")
        claim = next(c for c in await cluster.claims()
                     if c["metadata"]["name"] == status["resourceClaimName"])
        assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpu"
        [owner] = claim["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "Pod", "p0", first["metadata"]["uid"], True)
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (DRIVER, "node-a",
                                                                        "gpu-0")
        assert result["consumedCapacity"] == {"memory": "4Gi", "cores": "30"}
        assert result["shareID"]
        assert claim["status"]["reservedFor"] == [
            {"resource": "pods", "name": "p0", "uid": first["metadata"]["uid"]}]
        assert sorted(plugin.prepared) == sorted(
            p["status"]["resourceClaimStatuses"][0]["resourceClaimName"] for p in pods)

        # the container got the CDI devices the plugin returned, their edits applied
        seen = {c["name"]: c for c in await cluster.containers("node-a")}
        [entry] = [c for c in seen["p0"]["containers"] if c["name"] == "main"]
        assert entry["cdi_devices"] == [plugin.cdi_id(claim["metadata"]["uid"], "gpu-0")]
        assert entry["envs"]["DOUBLE_MEMORY"] == "4Gi"
        assert entry["envs"]["DOUBLE_CLAIM"] == claim["metadata"]["name"]
        assert {"container_path": "/run/double/gpu-0", "host_path": str(plugin.cdi_dir),
                "read_only": True} in entry["mounts"]

        # 3 × 30 cores taken: a fourth share of 30 does not fit the GPU's 100
        await cluster.create("/api/v1/namespaces/default/pods", pod("p3"))
        message = "0/1 nodes are available: 1 cannot allocate all claims."
        await cluster.wait_for("FailedScheduling", lambda: _has_event(cluster, "p3", message))
        assert await cluster.phase("p3") == "Pending"
        conditions = (await cluster.pod("p3"))["status"]["conditions"]
        assert {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": message}.items() <= conditions[0].items()

        # deleting a pod unprepares its claim, deletes it, and the share goes to the fourth
        response = await cluster.http.delete("/api/v1/namespaces/default/pods/p0")
        assert response.status_code == 200
        await cluster.wait_for("unprepare", lambda: claim["metadata"]["name"]
                               in plugin.unprepared)
        await running(cluster, "p3")
        names = {c["metadata"]["name"] for c in await cluster.claims()}
        assert claim["metadata"]["name"] not in names


async def _has_event(cluster: Cluster, name: str, message: str) -> bool:
    return message in await cluster.events("FailedScheduling", name)


async def test_a_pod_waits_for_its_claim_and_a_failed_prepare_is_retried() -> None:
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a", fail_prepare="device busy")
        await cluster.create(f"{RESOURCE}/deviceclasses", CLASS)
        await cluster.create(f"{RESOURCE}/resourceslices", shared_slice("node-a"))
        # no template yet: the controller cannot make the claim, the scheduler waits for it
        await cluster.create("/api/v1/namespaces/default/pods", pod("w", "later"))
        waiting = ("0/1 nodes are available: 1 waiting for dynamic resource controller to "
                   'create the resourceclaim "w-gpu".')
        await cluster.wait_for("waiting", lambda: _has_event(cluster, "w", waiting))
        await cluster.create(f"{RESOURCE}/namespaces/default/resourceclaimtemplates",
                             template("later"))
        # the claim is made and allocated; the plugin refuses to prepare: an event, retried
        await cluster.wait_for("prepare failure", lambda: _failed_prepare(cluster, "w"))
        assert await cluster.phase("w") == "Pending"
        plugin.fail_prepare = ""
        await running(cluster, "w")
        assert len(plugin.prepared) >= 2


async def _failed_prepare(cluster: Cluster, name: str) -> bool:
    return any("device busy" in m
               for m in await cluster.events("FailedPrepareDynamicResources", name))


async def test_an_extended_resource_maps_to_a_generated_claim() -> None:
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a")
        mapped = {**CLASS, "spec": {**CLASS["spec"], "extendedResourceName": "example.com/gpu"}}
        await cluster.create(f"{RESOURCE}/deviceclasses", mapped)
        exclusive = exclusive_slice("node-a", gpus=2)
        await cluster.create(f"{RESOURCE}/resourceslices", exclusive)
        body = {"metadata": {"name": "legacy"}, "spec": {"containers": [
            {"name": "main", "image": "cuda:12",
             "resources": {"limits": {"example.com/gpu": "2"}}}]}}
        await cluster.create("/api/v1/namespaces/default/pods", body)
        started = await running(cluster, "legacy")
        extended = started["status"]["extendedResourceClaimStatus"]
        assert extended["requestMappings"] == [{"containerName": "main",
                                                "resourceName": "example.com/gpu",
                                                "requestName": "container-0-request-0"}]
        [claim] = await cluster.claims()
        assert claim["metadata"]["name"] == extended["resourceClaimName"]
        assert claim["metadata"]["name"].startswith("legacy-extended-resources-")
        assert claim["metadata"]["annotations"][
            "resource.kubernetes.io/extended-resource-claim"] == "true"
        assert sorted(r["device"] for r in claim["status"]["allocation"]["devices"][
            "results"]) == ["gpu-0", "gpu-1"]
        seen = {c["name"]: c for c in await cluster.containers("node-a")}
        [entry] = seen["legacy"]["containers"]
        assert len(entry["cdi_devices"]) == 2 and entry["device_ids"] == []
        assert plugin.prepared == [claim["metadata"]["name"]]
        # a second pod asking the same finds no GPU left
        await cluster.create("/api/v1/namespaces/default/pods",
                             {**body, "metadata": {"name": "second"}})
        message = "0/1 nodes are available: 1 cannot allocate all claims."
        await cluster.wait_for("FailedScheduling", lambda: _has_event(cluster, "second",
                                                                      message))
        await cluster.http.delete("/api/v1/namespaces/default/pods/legacy")
        await running(cluster, "second")


async def test_registration_refuses_a_plugin_without_the_v1_service() -> None:
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a", versions=("v1beta1.DRAPlugin",))
        await cluster.wait_for("registration status", lambda: plugin.statuses)
        [(registered, error)] = plugin.statuses
        assert not registered and "v1.DRAPlugin" in error
        assert DRIVER not in cluster.sim.api.kubelets["node-a"].dra.plugins


async def test_a_claim_named_by_two_pods_is_shared_and_deallocated_when_both_are_gone() -> None:
    async with running_cluster(["node-a", "node-b"]) as cluster:
        plugin = await cluster.plugin("node-b")
        await cluster.create(f"{RESOURCE}/deviceclasses", CLASS)
        exclusive = exclusive_slice("node-b")
        await cluster.create(f"{RESOURCE}/resourceslices", exclusive)
        claim = {"metadata": {"name": "shared"}, "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}}
        await cluster.create(f"{RESOURCE}/namespaces/default/resourceclaims", claim)
        refs = [{"name": "gpu", "resourceClaimName": "shared"}]
        for name in ("a", "b"):
            await cluster.create("/api/v1/namespaces/default/pods", pod(name, claims=refs))
        started = [await running(cluster, name) for name in ("a", "b")]
        assert {p["spec"]["nodeName"] for p in started} == {"node-b"}  # where the device is
        assert "resourceClaimStatuses" not in started[0]["status"]  # only templates are listed
        [stored] = await cluster.claims()
        assert sorted(r["name"] for r in stored["status"]["reservedFor"]) == ["a", "b"]
        assert plugin.prepared == ["shared"]  # prepared once for both pods
        await cluster.http.delete("/api/v1/namespaces/default/pods/a")
        await cluster.wait_for("a released", lambda: _reserved_only(cluster, "b"))
        assert plugin.unprepared == [] and (await cluster.claims())[0]["status"]["allocation"]
        await cluster.http.delete("/api/v1/namespaces/default/pods/b")
        await cluster.wait_for("deallocated", lambda: _deallocated(cluster))
        assert plugin.unprepared == ["shared"]


async def _reserved_only(cluster: Cluster, name: str) -> bool:
    [stored] = await cluster.claims()
    return [r["name"] for r in stored["status"].get("reservedFor") or []] == [name]


async def _deallocated(cluster: Cluster) -> bool:
    [stored] = await cluster.claims()
    return not stored["status"].get("allocation") and not stored["status"].get("reservedFor")


async def test_device_health_streams_into_the_container_status() -> None:
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a", health={("node-a", "gpu-0"): (1, "")})
        await setup(cluster)
        await cluster.create("/api/v1/namespaces/default/pods", pod("h"))
        await running(cluster, "h")
        healthy = [{"name": "claim:gpu", "resources": [
            {"resourceID": f"{DRIVER}/node-a/gpu-0", "health": "Healthy"}]}]
        await cluster.wait_for("Healthy", lambda: _resource_status(cluster, "h", healthy))
        plugin.set_health("node-a", "gpu-0", 2, "ECC errors")  # UNHEALTHY
        sick = [{"name": "claim:gpu", "resources": [
            {"resourceID": f"{DRIVER}/node-a/gpu-0", "health": "Unhealthy",
             "message": "ECC errors"}]}]
        await cluster.wait_for("Unhealthy", lambda: _resource_status(cluster, "h", sick))


async def _resource_status(cluster: Cluster, name: str, wanted: Any) -> bool:
    statuses = (await cluster.pod(name))["status"].get("containerStatuses") or []
    return bool(statuses) and statuses[0].get("allocatedResourcesStatus") == wanted


async def test_a_restarted_plugin_registers_again() -> None:
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a")
        kubelet = cluster.sim.api.kubelets["node-a"].dra
        await kubelet.wait_registered(DRIVER)
        await plugin.stop()  # its registration socket goes: kubelet forgets the driver
        await cluster.wait_for("deregistered", lambda: DRIVER not in kubelet.plugins)
        await plugin.start()
        await kubelet.wait_registered(DRIVER)
        assert plugin.statuses == [(True, ""), (True, "")]
        await setup(cluster)  # and it prepares claims as before
        await cluster.create("/api/v1/namespaces/default/pods", pod("again"))
        await running(cluster, "again")


async def test_a_plugin_restarted_on_its_old_socket_path_registers_again() -> None:
    """A plugin killed without removing its registration socket, then restarted on the same path:
    kubelet registers it again and follows its health stream (the pod's status says what the
    new process reports)."""
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a", health={("node-a", "gpu-0"): (1, "")})
        kubelet = cluster.sim.api.kubelets["node-a"].dra
        await setup(cluster)
        await cluster.create("/api/v1/namespaces/default/pods", pod("h"))
        await running(cluster, "h")
        await plugin.crash()
        assert plugin.registration_socket.exists()  # what a SIGKILL leaves behind
        unknown = [{"name": "claim:gpu", "resources": [
            {"resourceID": f"{DRIVER}/node-a/gpu-0", "health": "Unknown"}]}]
        await cluster.wait_for("Unknown", lambda: _resource_status(cluster, "h", unknown))
        plugin.statuses.clear()
        plugin.set_health("node-a", "gpu-0", 2, "Xid 79")  # what the restarted process reports
        await plugin.start()
        await kubelet.wait_registered(DRIVER)
        await cluster.wait_for("registered again", lambda: _statuses(plugin))
        sick = [{"name": "claim:gpu", "resources": [
            {"resourceID": f"{DRIVER}/node-a/gpu-0", "health": "Unhealthy",
             "message": "Xid 79"}]}]
        await cluster.wait_for("Unhealthy", lambda: _resource_status(cluster, "h", sick))



async def test_a_pod_deleted_while_its_plugin_is_down_is_unprepared_by_the_restarted_one() -> None:
    """The driver crashes (its socket left behind) and a pod using its claim is deleted before it
    is back, as after a node agent's SIGKILL: kubelet keeps retrying NodeUnprepareResources, the
    plugin restarted on the same path gets the call, and the node's next pod runs (once, the
    first failed retry cut off by the old channel's closing ended the node's pod watch)."""
    async with running_cluster(["node-a"]) as cluster:
        plugin = await cluster.plugin("node-a")
        kubelet = cluster.sim.api.kubelets["node-a"].dra
        await setup(cluster)
        await cluster.create("/api/v1/namespaces/default/pods", pod("before"))
        await running(cluster, "before")
        [claim] = await cluster.claims()
        await plugin.crash()
        await cluster.http.delete("/api/v1/namespaces/default/pods/before")
        await asyncio.sleep(1.5)  # a restart that takes a while: several retries fail meanwhile
        await plugin.start()
        await kubelet.wait_registered(DRIVER)
        await cluster.wait_for("unprepared by the restarted plugin",
                               lambda: plugin.unprepared == [claim["metadata"]["name"]])
        await cluster.create("/api/v1/namespaces/default/pods", pod("after"))
        await running(cluster, "after")

async def _statuses(plugin: Any) -> bool:
    return plugin.statuses == [(True, "")]


async def test_a_no_execute_device_taint_evicts_pods_that_do_not_tolerate_it() -> None:
    async with running_cluster(["node-a"]) as cluster:
        await cluster.plugin("node-a")
        await cluster.create(f"{RESOURCE}/deviceclasses", CLASS)
        exclusive = exclusive_slice("node-a", gpus=2)
        await cluster.create(f"{RESOURCE}/resourceslices", exclusive)
        toleration = {"key": "gpu.example.com/unhealthy", "operator": "Exists",
                      "effect": "NoExecute"}
        for name, tolerations in (("plain", []), ("tolerant", [toleration])):
            await cluster.create(f"{RESOURCE}/namespaces/default/resourceclaimtemplates",
                                 exclusive_template(name, tolerations))
            await cluster.create("/api/v1/namespaces/default/pods", pod(name, name))
            await running(cluster, name)
        for device in exclusive["spec"]["devices"]:
            device["taints"] = [{"key": "gpu.example.com/unhealthy", "value": "ecc",
                                 "effect": "NoExecute"}]
        patched = await cluster.http.patch(
            f"{RESOURCE}/resourceslices/{exclusive['metadata']['name']}",
            json={"spec": {"devices": exclusive["spec"]["devices"]}},
            headers={"Content-Type": "application/merge-patch+json"})
        assert patched.status_code == 200, patched.text
        await cluster.wait_for("eviction", lambda: _gone(cluster, "plain"))
        assert "Marking for deletion" in await cluster.events("DeviceTaintManagerEviction",
                                                              "plain")
        assert await cluster.phase("tolerant") == "Running"

        async def claim_owners() -> list[str]:
            return [c["metadata"]["ownerReferences"][0]["name"] for c in await cluster.claims()]

        # The evicted pod's claim goes with it: the claim controller deletes it once the pod is
        # gone (asynchronously, as upstream's does; CI once read it in between).
        await cluster.wait_for("the evicted pod's claim deleted",
                               lambda: _only(claim_owners(), ["tolerant"]))


async def _only(owners: Any, wanted: list[str]) -> bool:
    return await owners == wanted


async def _gone(cluster: Cluster, name: str) -> bool:
    response = await cluster.http.get(f"/api/v1/namespaces/default/pods/{name}")
    return response.status_code == 404
