"""The node agent asks kubelet's pod-resources List on one kept channel, and still reaches a
restarted kubelet (a new socket at the same path) and says so clearly when kubelet is away."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from tessera.kube_sim.podresources import PodResourcesServer, PodResourcesService, PodResourcesStore
from tessera.node_agent.pod_resources_client import PodResourcesLister

RESOURCE = "nvidia.com/gpu"


def holders(pods) -> dict[str, list[str]]:
    return {p.name: [i for c in p.containers for d in c.devices for i in d.device_ids]
            for p in pods}  # fmt: skip


async def kubelet(socket: Path, pod: str, ids: list[str]) -> PodResourcesServer:
    store = PodResourcesStore()
    store.assign(f"uid-{pod}", "default", pod, "main", RESOURCE, ids)
    server = PodResourcesServer(socket, PodResourcesService(store))
    await server.start()
    return server


async def test_one_channel_serves_every_list_and_a_restarted_kubelet_is_reached(
    short_dir: Path,
) -> None:
    socket = short_dir / "kubelet.sock"
    lister = PodResourcesLister(timeout_s=5.0)
    server = await kubelet(socket, "first", ["gpu-0::0"])
    try:
        for _ in range(5):
            assert holders(await lister(str(socket))) == {"first": ["gpu-0::0"]}
        assert lister.channels_made == 1
        await server.stop()  # kubelet restarts: its socket is made anew, with its new record
        server = await kubelet(socket, "second", ["gpu-1::3"])
        # (the kept channel reconnects, or a new one is dialled: either way kubelet's new word)
        assert holders(await lister(str(socket))) == {"second": ["gpu-1::3"]}
    finally:
        await server.stop()
        await lister.close()


async def test_kubelet_away_is_an_error_not_a_hang(short_dir: Path) -> None:
    socket = short_dir / "kubelet.sock"
    lister = PodResourcesLister(timeout_s=2.0)
    server = await kubelet(socket, "first", ["gpu-0::0"])
    assert holders(await lister(str(socket)))
    await server.stop()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await lister(str(socket))
        assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                       grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        await lister.close()
