"""The kubelet stand-in behaves like kubelet towards device plugins and pods.

A plugin that registers a moment before it serves still gets its devices used (kubelet dials
before answering Register and retries briefly; one that never serves has its Register fail);
registering again while connected changes nothing, as kubelet's connectClient; when the stream
ends the devices stop being handed out until the plugin registers again; a pod asking for a
device resource no plugin registered gets kubelet's admission error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tessera.kube_sim.kubelet import SimKubelet

from tessera.kubeapi import DEVICE_PLUGIN_VERSION, HEALTHY, UNHEALTHY, dp, dp_grpc

RESOURCE = "example.com/gpu"


class FakePlugin(dp_grpc.DevicePluginServicer):
    """Two healthy devices; Allocate hands back which IDs it got as an env variable."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()

    async def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions()

    async def ListAndWatch(self, request, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        yield dp.ListAndWatchResponse(devices=[
            dp.Device(ID=f"dev-{i}", health=HEALTHY) for i in range(2)
        ])
        await self.stop.wait()

    async def Allocate(self, request, context):
        return dp.AllocateResponse(container_responses=[
            dp.ContainerAllocateResponse(envs={"DEVICES": ",".join(r.devices_ids)})
            for r in request.container_requests
        ])


async def serve_plugin(
    socket_dir: Path, plugin: FakePlugin, socket_name: str = "late.sock"
) -> grpc.aio.Server:
    server = grpc.aio.server()
    dp_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{socket_dir / socket_name}")
    await server.start()
    return server


async def register(
    kubelet: SimKubelet, pre_start_required: bool = False, endpoint: str = "late.sock"
) -> None:
    async with grpc.aio.insecure_channel(f"unix://{kubelet.socket_path}") as channel:
        await dp_grpc.RegistrationStub(channel).Register(
            dp.RegisterRequest(
                version=DEVICE_PLUGIN_VERSION, endpoint=endpoint, resource_name=RESOURCE,
                options=dp.DevicePluginOptions(pre_start_required=pre_start_required),
            ),
            timeout=5,
        )


def pod(name: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"uid": f"uid-{name}", "namespace": "default", "name": name},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


@contextlib.asynccontextmanager
async def running_kubelet(short_dir: Path, **kw: Any) -> AsyncIterator[SimKubelet]:
    kubelet = SimKubelet(short_dir / "dp", short_dir / "pr" / "kubelet.sock", **kw)
    await kubelet.start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()


async def test_plugin_registering_before_it_serves_is_used(short_dir):
    async with running_kubelet(short_dir) as kubelet:
        registering = asyncio.create_task(register(kubelet))  # nothing listens on late.sock yet
        await asyncio.sleep(0.6)
        assert not registering.done()  # kubelet answers once it has dialled the plugin
        plugin = FakePlugin()
        server = await serve_plugin(kubelet.socket_dir, plugin)
        try:
            await registering
            connection = await kubelet.wait_registered(RESOURCE, timeout=5)
            assert sorted(connection.healthy()) == ["dev-0", "dev-1"]
            admission = await kubelet.admit_pod(pod("a", {RESOURCE: "1"}))
            assert admission.ok, admission.error
            assert admission.containers[0].envs == {"DEVICES": "dev-0"}

            # The plugin goes away: its devices stay known but are no longer handed out.
            plugin.stop.set()
            await server.stop(grace=0.5)
            await kubelet.wait_for(lambda: not kubelet.plugins[RESOURCE].streaming, timeout=5)
            devices = kubelet.plugins[RESOURCE].devices
            assert {d.health for d in devices.values()} == {UNHEALTHY}
            refused = await kubelet.allocate_pod(pod("b", {RESOURCE: "1"}))
            assert not refused.ok
            assert "no healthy devices" in refused.error and RESOURCE in refused.error
        finally:
            plugin.stop.set()
            await server.stop(grace=None)


async def test_pod_asking_for_an_unregistered_resource_is_refused(short_dir):
    async with running_kubelet(short_dir, device_resources=[RESOURCE]) as kubelet:
        refused = await kubelet.admit_pod(pod("gpu", {RESOURCE: "1", "cpu": "1"}))
        assert not refused.ok
        assert f"resource {RESOURCE} is not registered" in refused.error
        assert not refused.containers[0].started
        assert not kubelet.pod_resources.in_use(RESOURCE)
        # Extended resources no device plugin manages (HAMi's gpumem) are left alone.
        plain = await kubelet.admit_pod(pod("plain", {"example.com/gpumem": "1000", "cpu": "1"}))
        assert plain.ok, plain.error
        assert plain.containers[0].started


async def test_plugin_that_never_serves_has_its_registration_fail(short_dir):
    async with running_kubelet(short_dir, dial_timeout_s=0.5, device_resources=[RESOURCE]) \
            as kubelet:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await register(kubelet)  # kubelet gave up dialling after dial_timeout_s
        assert failed.value.code() == grpc.StatusCode.UNKNOWN
        assert "failed to dial device plugin" in (failed.value.details() or "")
        assert kubelet.registration_count(RESOURCE) == 0
        refused = await kubelet.allocate_pod(pod("c", {RESOURCE: "1"}))
        assert not refused.ok and RESOURCE in refused.error


async def test_registering_again_keeps_a_live_client_and_replaces_an_ended_one(short_dir):
    async with running_kubelet(short_dir) as kubelet:
        plugin = FakePlugin()
        server = await serve_plugin(kubelet.socket_dir, plugin)
        try:
            await register(kubelet)
            first = await kubelet.wait_registered(RESOURCE, timeout=5)
            await register(kubelet)  # kubelet: "client already connected with the same path"
            assert kubelet.plugins[RESOURCE] is first and first.connected
            assert kubelet.registration_count(RESOURCE) == 1
            other = await serve_plugin(kubelet.socket_dir, FakePlugin(), "other.sock")
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await register(kubelet, endpoint="other.sock")
                assert "different socket path late.sock" in (refused.value.details() or "")
            finally:
                await other.stop(grace=None)
            # The stream ends (the plugin restarts its server): the client is dropped, and
            # the next Register connects anew.
            plugin.stop.set()
            await server.stop(grace=0.5)
            await kubelet.wait_for(lambda: not first.connected, timeout=5)
            plugin = FakePlugin()
            server = await serve_plugin(kubelet.socket_dir, plugin)
            await register(kubelet)
            second = await kubelet.wait_registered(RESOURCE, after=1, timeout=5)
            assert second is not first and sorted(second.healthy()) == ["dev-0", "dev-1"]
        finally:
            plugin.stop.set()
            await server.stop(grace=None)


class StallingPlugin(FakePlugin):
    """Its first PreStartContainer never answers (an agent that dies mid-call); later ones do."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_starts = 0
        self.first_pre_start = asyncio.Event()

    async def PreStartContainer(self, request, context):
        self.pre_starts += 1
        if self.pre_starts == 1:
            self.first_pre_start.set()
            await self.stop.wait()
        return dp.PreStartContainerResponse()


async def test_connection_closed_during_a_call_fails_the_call_not_the_kubelet(short_dir):
    """kubelet restarting closes every plugin connection; grpc.aio then ends a call still in
    flight on it with CancelledError in the caller. That must be a failed RPC, retried once the
    plugin registered again, as kubelet's sync loop goes on: before, it escaped the admission
    loop and left every later pod of the node Pending (tests/e2e/test_crash.py, once in ~30
    runs under load)."""
    async with running_kubelet(short_dir) as kubelet:
        plugin = StallingPlugin()
        server = await serve_plugin(kubelet.socket_dir, plugin)
        again: grpc.aio.Server | None = None
        try:
            await register(kubelet, pre_start_required=True)
            await kubelet.wait_registered(RESOURCE, timeout=5)
            admission = await kubelet.allocate_pod(pod("a", {RESOURCE: "1"}))
            assert admission.ok, admission.error
            starting = asyncio.create_task(kubelet.start_pod(admission))
            await asyncio.wait_for(plugin.first_pre_start.wait(), 5)
            await kubelet.restart()  # the old channel is closed, every socket deleted
            failed = await asyncio.wait_for(starting, 5)
            assert not failed.ok and "connection was closed" in failed.error
            assert not failed.containers[0].started
            # The plugin serves and registers again; kubelet retries the start (same IDs).
            again = await serve_plugin(kubelet.socket_dir, plugin)
            await register(kubelet, pre_start_required=True)
            await kubelet.wait_registered(RESOURCE, after=1, timeout=5)
            admission.error = admission.containers[0].error = ""  # as kubelets.py retries
            retried = await kubelet.start_pod(admission)
            assert retried.ok, retried.error
            assert retried.containers[0].started and plugin.pre_starts == 2
        finally:
            plugin.stop.set()
            await server.stop(grace=None)
            if again is not None:
                await again.stop(grace=None)
