"""kubelet's pod-resources API (v1) for the stand-in kubelet: which container holds which devices.

`PodResourcesStore` is the record the stand-in kubelet keeps; `PodResourcesServer` serves it on a
unix socket exactly as kubelet does (List, Get, GetAllocatableResources).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tessera.kubeapi import pr, pr_grpc


@dataclass
class ContainerDevices:
    name: str
    devices: dict[str, list[str]] = field(default_factory=dict)  # resource name -> device IDs


@dataclass
class PodDevices:
    uid: str
    namespace: str
    name: str
    containers: list[ContainerDevices] = field(default_factory=list)


class PodResourcesStore:
    """What kubelet has assigned, per pod and container, in admission order."""

    def __init__(self) -> None:
        self._pods: dict[str, PodDevices] = {}

    def assign(
        self, uid: str, namespace: str, name: str, container: str, resource: str, ids: list[str]
    ) -> None:
        pod = self._pods.setdefault(uid, PodDevices(uid, namespace, name))
        entry = next((c for c in pod.containers if c.name == container), None)
        if entry is None:
            entry = ContainerDevices(container)
            pod.containers.append(entry)
        entry.devices[resource] = list(ids)

    def begin(self, uid: str, namespace: str, name: str, containers: list[str]) -> None:
        """A pod kubelet starts to admit: listed at once, its containers without devices yet
        (kubelet adds a pod to its pod manager, which List reads, before admitting it)."""
        pod = self._pods.setdefault(uid, PodDevices(uid, namespace, name))
        for container in containers:
            if all(c.name != container for c in pod.containers):
                pod.containers.append(ContainerDevices(container))

    def drop_if_empty(self, uid: str) -> None:
        pod = self._pods.get(uid)
        if pod is not None and not any(c.devices for c in pod.containers):
            del self._pods[uid]

    def remove(self, uid: str) -> None:
        self._pods.pop(uid, None)

    def in_use(self, resource: str) -> set[str]:
        return {
            device
            for pod in self._pods.values()
            for c in pod.containers
            for device in c.devices.get(resource, [])
        }

    def pods(self) -> list[PodDevices]:
        return list(self._pods.values())


def _pod_message(pod: PodDevices) -> pr.PodResources:
    return pr.PodResources(
        name=pod.name,
        namespace=pod.namespace,
        containers=[
            pr.ContainerResources(
                name=c.name,
                devices=[
                    pr.ContainerDevices(resource_name=resource, device_ids=ids)
                    for resource, ids in c.devices.items()
                ],
            )
            for c in pod.containers
        ],
    )


class PodResourcesService(pr_grpc.PodResourcesListerServicer):
    def __init__(
        self,
        store: PodResourcesStore,
        allocatable: Callable[[], dict[str, list[str]]] = dict,
    ) -> None:
        self.store = store
        self.allocatable = allocatable

    async def List(self, request, context):
        return pr.ListPodResourcesResponse(
            pod_resources=[_pod_message(p) for p in self.store.pods()]
        )

    async def Get(self, request, context):
        for pod in self.store.pods():
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=_pod_message(pod))
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"pod {request.pod_namespace}/{request.pod_name} not found",
        )

    async def GetAllocatableResources(self, request, context):
        return pr.AllocatableResourcesResponse(devices=[
            pr.ContainerDevices(resource_name=resource, device_ids=ids)
            for resource, ids in self.allocatable().items()
        ])


class PodResourcesServer:
    """The pod-resources socket (default /var/lib/kubelet/pod-resources/kubelet.sock)."""

    def __init__(self, socket_path: str | Path, service: PodResourcesService) -> None:
        self.socket_path = Path(socket_path)
        self.service = service
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
