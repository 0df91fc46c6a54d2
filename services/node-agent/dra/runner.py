"""How the node agent starts its DRA driver (DRA mode: `TESSERA_DRA=true`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .driver import DraDriver
from .endpoint import DraEndpoint
from .quota import DraQuota
from .settings import DraSettings

if TYPE_CHECKING:
    from ..agent import NodeAgent


def driver_version(agent: NodeAgent, dra: DraSettings) -> str:
    if dra.driver_version:
        return dra.driver_version
    probe = getattr(agent.source, "driver_version", None)
    try:
        found = probe() if callable(probe) else None
    except Exception:
        found = None
    return str(found or "0.0.0")


def start_driver(agent: NodeAgent, stop: asyncio.Event,
                 dra: DraSettings | None = None) -> DraEndpoint | None:  # fmt: skip
    """The driver and its endpoint, running until `stop`; None in extender mode. Needs the
    cluster port (claims are read from the API server)."""
    dra = dra or DraSettings()
    if not dra.enabled:
        return None
    if agent.cluster is None:
        raise RuntimeError("DRA mode needs the cluster API (TESSERA_CLUSTER / a kubeconfig): "
                           "the driver reads the claims it prepares and publishes its slices")
    dra = dra.model_copy(update={"driver_version": driver_version(agent, dra)})
    assert agent.configurator is not None
    driver = DraDriver(
        settings=agent.settings, dra=dra, node=agent.node, state=agent.state, store=agent.store,
        ledger_kv=agent.buckets.ledger, js=agent.js, cluster=agent.cluster, log=agent.log,
        node_settings=agent.configurator.node_settings,
        source=f"node-agent/{agent.node}/{agent.instance}",
        quota=DraQuota(agent.nc, agent.settings, agent.clock),
    )
    endpoint = DraEndpoint(driver)
    agent.dra = endpoint
    agent.dra_task = asyncio.create_task(endpoint.run(stop))
    return endpoint
