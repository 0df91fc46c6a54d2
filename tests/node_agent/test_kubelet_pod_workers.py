"""kube-sim's kubelet starts a node's pods as kubelet does: Allocate one pod after the other
(`HandlePodAdditions` admits the pods of an update in turn; the device manager's Allocate runs in
its admit handler), then each pod's start in its own worker (`podWorkers`: PreStartContainer as
each container's run options are generated), so a slow start of one pod holds up no other.

A device plugin over real gRPC whose PreStartContainer takes 0.4 s and whose Allocate records
how many calls overlap; four pods bound to the node in kube-sim's store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from tessera.kube_sim.kubelets import NodeKubelet
from tessera.kube_sim.store import ObjectStore

from tessera.kubeapi import DEVICE_PLUGIN_VERSION, HEALTHY, dp, dp_grpc

RESOURCE = "example.com/gpu"
PRE_START_S = 0.4


class SlowStartPlugin(dp_grpc.DevicePluginServicer):
    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.active = {"Allocate": 0, "PreStartContainer": 0}
        self.most = {"Allocate": 0, "PreStartContainer": 0}
        self.allocated: list[str] = []

    def _enter(self, rpc: str) -> None:
        self.active[rpc] += 1
        self.most[rpc] = max(self.most[rpc], self.active[rpc])

    async def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions(pre_start_required=True)

    async def ListAndWatch(self, request, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        yield dp.ListAndWatchResponse(devices=[
            dp.Device(ID=f"dev-{i}", health=HEALTHY) for i in range(8)
        ])
        await self.stop.wait()

    async def Allocate(self, request, context):
        self._enter("Allocate")
        try:
            await asyncio.sleep(0.05)
            self.allocated.extend(i for r in request.container_requests for i in r.devices_ids)
            return dp.AllocateResponse(container_responses=[
                dp.ContainerAllocateResponse() for _ in request.container_requests
            ])
        finally:
            self.active["Allocate"] -= 1

    async def PreStartContainer(self, request, context):
        self._enter("PreStartContainer")
        try:
            await asyncio.sleep(PRE_START_S)
            return dp.PreStartContainerResponse()
        finally:
            self.active["PreStartContainer"] -= 1


def bound_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": "n1", "containers": [
            {"name": "main", "image": "x", "resources": {"limits": {RESOURCE: "1"}}},
        ]},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True"},
        ]},
    }  # fmt: skip


async def test_pods_are_allocated_in_turn_and_started_concurrently(short_dir: Path) -> None:
    store = ObjectStore()
    kubelet = NodeKubelet(store, "n1", short_dir, [RESOURCE])
    await kubelet.start()
    plugin = SlowStartPlugin()
    server = grpc.aio.server()
    dp_grpc.add_DevicePluginServicer_to_server(plugin, server)
    socket_dir = kubelet.device_kubelet.socket_dir
    server.add_insecure_port(f"unix://{socket_dir / 'slow.sock'}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{kubelet.device_kubelet.socket_path}") as ch:
            await dp_grpc.RegistrationStub(ch).Register(dp.RegisterRequest(
                version=DEVICE_PLUGIN_VERSION, endpoint="slow.sock", resource_name=RESOURCE,
                options=dp.DevicePluginOptions(pre_start_required=True),
            ), timeout=5)  # fmt: skip
        await kubelet.device_kubelet.wait_registered(RESOURCE, timeout=10)
        for i in range(4):
            store.create("Pod", bound_pod(f"p{i}"))

        def phases() -> list[str]:
            return [(store.get("Pod", "default", f"p{i}").get("status") or {}).get("phase", "")
                    for i in range(4)]  # fmt: skip

        deadline = time.monotonic() + 30
        while phases() != ["Running"] * 4:
            assert time.monotonic() < deadline, f"not all Running: {phases()}"
            await asyncio.sleep(0.02)
        assert plugin.most["Allocate"] == 1, "kubelet admits one pod at a time"
        assert sorted(plugin.allocated) == sorted(set(plugin.allocated))  # no device twice
        assert len(plugin.allocated) == 4
        # The four starts overlap (pod workers): one after the other they take 4 × 0.4 s.
        assert plugin.most["PreStartContainer"] > 1
        assert {a.uid for a in kubelet.admissions.values()} == {
            store.get("Pod", "default", f"p{i}")["metadata"]["uid"] for i in range(4)
        }
    finally:
        plugin.stop.set()
        await server.stop(grace=0.2)
        await kubelet.stop()
