"""`python -m tessera.node_agent`: device discovery, device plugin, container regions."""

from __future__ import annotations

import socket

from tessera.node_agent.agent import NodeAgent
from tessera.node_agent.devices import source_from_settings

from tessera.cluster.factory import cluster_from_settings
from tessera.service import ServiceContext, run_service


async def agent_main(ctx: ServiceContext) -> None:
    node = ctx.settings.node_name or socket.gethostname()
    source = source_from_settings(ctx.settings, node)
    agent = NodeAgent(
        settings=ctx.settings, node=node, nc=ctx.nc, js=ctx.js, buckets=ctx.buckets,
        source=source, cluster=cluster_from_settings(ctx.settings), log=ctx.log,
        clock=ctx.clock,
    )
    ctx.metrics = agent.metrics.render  # /metrics beside the probes on TESSERA_LISTEN
    await agent.run(ctx.stop)


def main() -> None:
    run_service(
        "node-agent",
        "device discovery, device plugin, container regions",
        agent_main,
        health_probes=True,
    )


if __name__ == "__main__":
    main()
