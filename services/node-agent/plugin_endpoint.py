"""Our socket in kubelet's device-plugin directory and the registration with kubelet: served,
registered, and registered again whenever kubelet's socket is recreated (kubelet deletes every
socket there when it restarts) or kubelet holds no stream of ours (it dropped our client)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Protocol

import grpc

from tessera.kubeapi import DEVICE_PLUGIN_VERSION, KUBELET_SOCKET_NAME, dp, dp_grpc

# kubelet's messages are small; a larger cap than gRPC's 4 MiB default lets an oversized request
# reach validation (INVALID_ARGUMENT with a reason) instead of dying as RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServedPlugin(Protocol):
    """A device plugin servicer the endpoint serves; one with `reconcile_sealed` is asked to
    reconcile between watch steps (DevicePluginService)."""


def socket_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class ListAndWatchStreams(grpc.aio.ServerInterceptor):
    """Counts kubelet's ListAndWatch streams open on our socket: kubelet holds one for as long
    as it holds our client, so none open well after registering means kubelet dropped us."""

    METHOD = "/v1beta1.DevicePlugin/ListAndWatch"

    def __init__(self) -> None:
        self.open = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method != self.METHOD
                or handler.unary_stream is None):
            return handler
        stream = handler.unary_stream

        async def counted(request, context):
            self.open += 1
            try:
                async for response in stream(request, context):
                    yield response
            finally:
                self.open -= 1

        return grpc.unary_stream_rpc_method_handler(
            counted, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class PluginEndpoint:
    """Our socket in kubelet's device-plugin directory, and the registration with kubelet.

    Registered but no ListAndWatch stream open for `stream_grace_s` means kubelet does not hold
    our client (it dropped it after answering Register: it still held the previous agent's
    connection, which it then saw end; or its dial of our socket failed), so we register again:
    harmless where kubelet still holds us (a no-op), and otherwise the node's devices would stay
    Unhealthy to kubelet until the next kubelet restart."""

    def __init__(
        self,
        plugin_dir: str,
        resource_name: str,
        service: ServedPlugin,
        log: logging.Logger,
        socket_name: str = "tessera-gpu.sock",
        poll_s: float = 0.25,
        stream_grace_s: float = 3.0,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.socket_path = self.plugin_dir / socket_name
        self.resource_name = resource_name
        self.service = service
        self.log = log
        self.poll_s = poll_s
        self.stream_grace_s = stream_grace_s
        self.registrations = 0
        self.streams = ListAndWatchStreams()
        self._server: grpc.aio.Server | None = None
        self._streamless_since: float | None = None
        self._own_inode: int | None = None
        self._kubelet_inode: int | None = None
        self._registered = False

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET_NAME

    async def _serve(self) -> None:
        await self._stop_server()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server(interceptors=[self.streams], options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ])  # fmt: skip
        dp_grpc.add_DevicePluginServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        self._own_inode = socket_inode(self.socket_path)

    async def _stop_server(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None

    async def _register(self) -> bool:
        request = dp.RegisterRequest(
            version=DEVICE_PLUGIN_VERSION,
            endpoint=self.socket_path.name,
            resource_name=self.resource_name,
            options=dp.DevicePluginOptions(
                pre_start_required=True, get_preferred_allocation_available=True
            ),
        )
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                await dp_grpc.RegistrationStub(channel).Register(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            self.log.warning("kubelet registration failed", extra={"err": exc.details()})
            return False
        self.registrations += 1
        self._streamless_since = time.monotonic()
        self.log.info("registered with kubelet", extra={
            "resource": self.resource_name, "endpoint": self.socket_path.name,
        })
        return True

    async def start(self) -> None:
        await self._serve()
        self._kubelet_inode = socket_inode(self.kubelet_socket)
        if self._kubelet_inode is not None:
            self._registered = await self._register()

    async def check(self) -> None:
        """One watch step: re-serve if our socket vanished, re-register if kubelet restarted."""
        if socket_inode(self.socket_path) != self._own_inode:
            self.log.info("plugin socket gone (kubelet restart?); serving again")
            await self._serve()
            self._registered = False
        kubelet = socket_inode(self.kubelet_socket)
        if kubelet != self._kubelet_inode:
            self._kubelet_inode = kubelet
            self._registered = False
        if self._registered and self._dropped_by_kubelet():
            self.log.warning("kubelet holds no ListAndWatch stream of ours; registering again",
                             extra={"resource": self.resource_name,
                                    "after_s": self.stream_grace_s})
            self._registered = False
        if not self._registered and kubelet is not None:
            self._registered = await self._register()
        reconcile = getattr(self.service, "reconcile_sealed", None)
        if reconcile is not None:  # (the MIG instances' servicers seal nothing)
            await reconcile()

    def _dropped_by_kubelet(self) -> bool:
        if self.streams.open:
            self._streamless_since = None
            return False
        now = time.monotonic()
        if self._streamless_since is None:
            self._streamless_since = now
        return now - self._streamless_since >= self.stream_grace_s

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
                if stop.is_set():
                    break
                try:
                    await self.check()
                except Exception as exc:
                    self.log.warning("plugin watch step failed", extra={"err": str(exc)})
        finally:
            await self._stop_server()
            with contextlib.suppress(FileNotFoundError):
                if socket_inode(self.socket_path) == self._own_inode:
                    self.socket_path.unlink()
