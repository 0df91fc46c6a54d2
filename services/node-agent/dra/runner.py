"""How the node agent starts its DRA driver (DRA mode: `TESSERA_DRA=true`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tessera.cluster.port import ClusterError
from tessera.dra_names import ANN_ALLOCATION_MODE

from .driver import DraDriver
from .endpoint import DraEndpoint
from .quota import DraQuota
from .settings import DraSettings

if TYPE_CHECKING:
    from ..agent import NodeAgent


def driver_version(agent: NodeAgent, dra: DraSettings) -> str:
    """The setting, else NVML's (the NVML device source has initialised it), else 0.0.0."""
    if dra.driver_version:
        return dra.driver_version
    if agent.settings.device_source == "nvml":
        try:
            import pynvml

            found = pynvml.nvmlSystemGetDriverVersion()
            return found.decode() if isinstance(found, bytes) else str(found)
        except Exception:  # no NVML, or a driver without the call: the attribute says 0.0.0
            pass
    return "0.0.0"


async def leave_dra_mode(agent: NodeAgent) -> None:
    """Drop the node's DRA-mode annotation if an earlier run in DRA mode left it."""
    try:
        node = await agent.cluster.get_node(agent.node)  # type: ignore[union-attr]
        annotations = (node.get("metadata") or {}).get("annotations") or {}
        if ANN_ALLOCATION_MODE in annotations:
            await agent.cluster.patch_node_annotations(  # type: ignore[union-attr]
                agent.node, {ANN_ALLOCATION_MODE: None}
            )
    except ClusterError as exc:
        agent.log.info("allocation-mode annotation not checked", extra={"err": str(exc)})


def start_driver(agent: NodeAgent, stop: asyncio.Event,
                 dra: DraSettings | None = None) -> DraEndpoint | None:  # fmt: skip
    """The driver and its endpoint, running until `stop`; None in extender mode. Needs the
    cluster port (claims are read from the API server)."""
    dra = dra or DraSettings()
    if not dra.enabled:
        if agent.cluster is not None:  # back in extender mode: the scheduler may place here
            agent.dra_task = asyncio.create_task(leave_dra_mode(agent))
        return None
    if agent.cluster is None:
        raise RuntimeError(
            "DRA mode needs the cluster API (TESSERA_CLUSTER / a kubeconfig): "
            "the driver reads the claims it prepares and publishes its slices"
        )
    dra = dra.model_copy(update={"driver_version": driver_version(agent, dra)})
    assert agent.configurator is not None
    driver = DraDriver(
        settings=agent.settings,
        dra=dra,
        node=agent.node,
        state=agent.state,
        store=agent.store,
        ledger_kv=agent.buckets.ledger,
        js=agent.js,
        cluster=agent.cluster,
        log=agent.log,
        node_settings=agent.configurator.node_settings,
        source=f"node-agent/{agent.node}/{agent.instance}",
        quota=DraQuota(agent.nc, agent.settings, agent.clock),
        mig=agent.dynamic_mig,
        mps=agent.mps,
        lease_ready=agent.leases.ready,
    )
    endpoint = DraEndpoint(driver)
    agent.dra = endpoint
    agent.dra_task = asyncio.create_task(endpoint.run(stop))
    return endpoint
