"""Device health for kubelet's DRA manager (KEP-4680): a driver's `NodeWatchResources` stream
(dra-health v1, else v1alpha1) read into `(driver, pool, device) -> (health, message)`, and each
container's `allocatedResourcesStatus` computed from the devices prepared for its claims
(`name: claim:<pod claim>[/<request>]`, `resourceID: <driver>/<pool>/<device>`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc
from tessera.kube_sim.dra.claims import pod_claim_names
from tessera.kube_sim.store import KubeObject

from tessera.kubeapi import drahealth, drahealth_grpc, drahealth_v1, drahealth_v1_grpc

HEALTH_NAMES = {0: "Unknown", 1: "Healthy", 2: "Unhealthy"}
DeviceHealth = dict[tuple[str, str], tuple[str, str]]  # (pool, device) -> (health, message)


async def watch_health(channel: grpc.aio.Channel, update: Callable[[DeviceHealth], None]) -> None:
    """Follow the driver's stream, calling `update` with each full device list (an empty one
    when the stream ends: its devices are then Unknown). A driver without the service: none."""
    for stub in (drahealth_v1_grpc.DRAResourceHealthStub(channel),
                 drahealth_grpc.DRAResourceHealthStub(channel)):
        request = (drahealth_v1.NodeWatchResourcesRequest()
                   if isinstance(stub, drahealth_v1_grpc.DRAResourceHealthStub)
                   else drahealth.NodeWatchResourcesRequest())
        try:
            async for response in stub.NodeWatchResources(request):
                update({(d.device.pool_name, d.device.device_name): (
                    HEALTH_NAMES.get(d.health, "Unknown"), getattr(d, "message", "")[:1024])
                    for d in response.devices})
            update({})
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                continue
            update({})
            return


def resource_statuses(
    pod: KubeObject, prepared: Iterable[Any],
    device_health: dict[tuple[str, str, str], tuple[str, str]],
) -> dict[str, list[dict[str, Any]]]:
    """container -> allocatedResourcesStatus; `prepared`: the node's PreparedClaims."""
    found: dict[str, list[dict[str, Any]]] = {}
    entries = pod_claim_names(pod)
    namespace = pod["metadata"].get("namespace", "")
    by_name = {c.name: c for c in prepared if c.namespace == namespace}
    extended = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        wanted = [(f"claim:{ref.get('name')}" + (f"/{ref['request']}" if ref.get("request")
                                                  else ""),
                   entries.get(ref.get("name", "")) or "", ref.get("request") or "")
                  for ref in (container.get("resources") or {}).get("claims") or []]
        wanted += [(f"claim:{extended.get('resourceClaimName')}/{m.get('requestName')}",
                    extended.get("resourceClaimName") or "", m.get("requestName") or "")
                   for m in extended.get("requestMappings") or []
                   if m.get("containerName") == container.get("name")]
        statuses = []
        for status_name, claim_name, request in wanted:
            claim = by_name.get(claim_name)
            if claim is None:
                continue
            resources = []
            for driver, device in claim.devices:
                names = list(device.request_names)
                if request and names and not any(n == request or n.split("/")[0] == request
                                                  for n in names):
                    continue
                health, message = device_health.get(
                    (driver, device.pool_name, device.device_name), ("Unknown", ""))
                entry = {"resourceID": f"{driver}/{device.pool_name}/{device.device_name}",
                         "health": health}
                if message:
                    entry["message"] = message
                resources.append(entry)
            statuses.append({"name": status_name, "resources": resources})
        if statuses:
            found[container.get("name", "")] = statuses
    return found
