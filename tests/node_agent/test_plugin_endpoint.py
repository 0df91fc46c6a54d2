"""The agent's registration heals when kubelet drops its client without telling it.

kubelet answers a Register from a plugin it already holds on the same socket as a no-op; when
the old connection then ends (the previous agent process died a moment before), kubelet drops
the client and the node's devices turn Unhealthy, though the new agent believes it registered.
The agent sees no ListAndWatch stream open and registers again within its grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from tessera.kube_sim.kubelet import SimKubelet
from tessera.node_agent.plugin_endpoint import PluginEndpoint
from test_sim_kubelet import RESOURCE, FakePlugin, pod

from tessera.kubeapi import dp

LOG = logging.getLogger("test.plugin_endpoint")


class Plugin(FakePlugin):
    """The fake plugin, answering GetPreferredAllocation (the endpoint registers offering it)."""

    async def GetPreferredAllocation(self, request, context):
        return dp.PreferredAllocationResponse(
            container_responses=[
                dp.ContainerPreferredAllocationResponse(
                    deviceIDs=list(r.available_deviceIDs)[: r.allocation_size]
                )
                for r in request.container_requests
            ]
        )


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def endpoint_running(endpoint: PluginEndpoint) -> AsyncIterator[asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(endpoint.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_agent_registers_again_when_kubelet_drops_its_client(short_dir: Path) -> None:
    kubelet = SimKubelet(short_dir / "dp", short_dir / "pr" / "kubelet.sock")
    await kubelet.start()
    try:
        # The previous agent process: serving and registered, its stream open.
        previous = PluginEndpoint(str(kubelet.socket_dir), RESOURCE, Plugin(), LOG)
        await previous.start()
        held = await kubelet.wait_registered(RESOURCE, timeout=5)
        # The new agent starts before kubelet saw the previous one end: it takes the socket
        # path over and registers, which kubelet answers as a no-op.
        agent = PluginEndpoint(str(kubelet.socket_dir), RESOURCE, Plugin(), LOG, stream_grace_s=1.0)
        async with endpoint_running(agent):
            await until(lambda: agent.registrations >= 1)
            # (it may register again meanwhile: each is a no-op while kubelet holds the old one)
            assert kubelet.plugins[RESOURCE] is held and kubelet.registration_count(RESOURCE) == 1
            await previous._stop_server()  # the previous process is gone: kubelet drops it
            await kubelet.wait_for(lambda: not held.connected, timeout=5)
            refused = await kubelet.allocate_pod(pod("while-dropped", {RESOURCE: "1"}))
            assert "no healthy devices" in refused.error
            dropped_at = time.monotonic()
            healed = await kubelet.wait_registered(RESOURCE, after=1, timeout=10)
            assert time.monotonic() - dropped_at < 1.0 + 3.0  # grace + a loaded machine's slack
            assert healed is not held and sorted(healed.healthy()) == ["dev-0", "dev-1"]
            admitted = await kubelet.allocate_pod(pod("healed", {RESOURCE: "1"}))
            assert admitted.ok, admitted.error
            # Held again: no further registrations while the stream stays open. Counted once a
            # watch step has seen the stream: a Register it decided on before kubelet opened the
            # stream (over the 1 s grace on a busy host) may still land, and is a no-op.
            await until(lambda: agent.streams.open == 1 and agent._registered
                        and agent._streamless_since is None)  # fmt: skip
            registrations = agent.registrations
            await asyncio.sleep(2.5)
            assert agent.registrations == registrations
            assert kubelet.registration_count(RESOURCE) == 2
    finally:
        await kubelet.stop()
