"""kubelet's pod-resources List over one kept channel per socket (and event loop).

The device plugin asks kubelet's pod-resources service which pod holds which devices two or
three times per pod it admits; a fresh gRPC channel each time (connect, HTTP/2 handshake,
close) cost more than the List itself under a burst. The channel is kept and made anew when
kubelet recreated its socket (a kubelet restart: another inode) or a call on it failed at the
transport, so a restarted kubelet is asked on its new socket exactly as a fresh channel would.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import grpc

from tessera.kubeapi import pr, pr_grpc

POD_RESOURCES_TIMEOUT_S = 5.0


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


@dataclass
class _Kept:
    loop: asyncio.AbstractEventLoop
    inode: int | None
    channel: grpc.aio.Channel
    stub: pr_grpc.PodResourcesListerStub


class PodResourcesLister:
    """`await lister(socket_path)`: kubelet's pod-resources List, on a kept channel."""

    def __init__(self, timeout_s: float = POD_RESOURCES_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._kept: dict[str, _Kept] = {}
        self.channels_made = 0  # (for tests: how many channels were opened)

    def _channel(self, socket_path: str) -> _Kept:
        loop = asyncio.get_running_loop()
        inode = _inode(socket_path)
        kept = self._kept.get(socket_path)
        if kept is not None and kept.loop is loop and kept.inode == inode:
            return kept
        if kept is not None:
            self._drop(socket_path, kept)
        channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        kept = _Kept(loop, inode, channel, pr_grpc.PodResourcesListerStub(channel))
        self._kept[socket_path] = kept
        self.channels_made += 1
        return kept

    def _drop(self, socket_path: str, kept: _Kept) -> None:
        if self._kept.get(socket_path) is kept:
            del self._kept[socket_path]
        if kept.loop is asyncio.get_running_loop():  # (another loop's channel is left to it)
            task = kept.loop.create_task(kept.channel.close())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def __call__(self, socket_path: str) -> list[pr.PodResources]:
        for attempt in (1, 2):
            kept = self._channel(socket_path)
            try:
                reply = await kept.stub.List(pr.ListPodResourcesRequest(), timeout=self.timeout_s)
                return list(reply.pod_resources)
            except grpc.aio.AioRpcError as exc:
                self._drop(socket_path, kept)  # the next call dials afresh
                # A kept channel to a socket kubelet has since replaced fails as UNAVAILABLE:
                # once more on a new channel, as a fresh dial would have gone.
                if attempt == 2 or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for path, kept in list(self._kept.items()):
            if kept.loop is asyncio.get_running_loop():
                del self._kept[path]
                await kept.channel.close()
