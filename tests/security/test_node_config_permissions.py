"""Only the admin identity may change a node's device configuration on the bus
(`tessera node-config set`); only the node's own agent may serve it. NATS itself refuses the
rest (a permissions violation), against the generated authorization block."""

from __future__ import annotations

import pytest

from tessera import bus
from tessera import bus_permissions as bp
from tests.security.test_bus_permissions import (  # noqa: F401 - the fixture
    NODE_A,
    NODE_B,
    as_identity,
)


@pytest.mark.parametrize(
    "role,node",
    [(bp.SCHEDULER, None), (bp.QUOTA, None), (bp.METRICS, None), (bp.EVENTS_READER, None),
     (bp.NODE_AGENT, NODE_A), (bp.NODE_AGENT, NODE_B)],
)
async def test_only_the_admin_may_set_a_nodes_config(as_identity, role, node) -> None:  # noqa: F811
    agent_b = await as_identity(bp.NODE_AGENT, NODE_B)  # serves its own endpoints
    received: list[bytes] = []

    async def on_request(msg) -> None:
        received.append(msg.data)
        await msg.respond(b"ok")

    for subject in (bus.node_config_set_subject(NODE_B), bus.node_config_get_subject(NODE_B)):
        await agent_b.nc.subscribe(subject, cb=on_request)
    await bus.flush(agent_b.nc)

    client = await as_identity(role, node)
    await client.nc.publish(bus.node_config_set_subject(NODE_B), b"split 1000")
    await bus.flush(client.nc)
    await client.violation(bus.node_config_set_subject(NODE_B))

    admin = await as_identity(bp.ADMIN)
    for subject in (bus.node_config_set_subject(NODE_B), bus.node_config_get_subject(NODE_B)):
        assert (await admin.nc.request(subject, b"admin", timeout=5)).data == b"ok"
    assert received == [b"admin", b"admin"]


async def test_an_agent_cannot_serve_another_nodes_config(as_identity) -> None:  # noqa: F811
    agent_a = await as_identity(bp.NODE_AGENT, NODE_A)
    await agent_a.nc.subscribe(bus.node_config_set_subject(NODE_B), queue="q")
    await bus.flush(agent_a.nc)
    await agent_a.violation(bus.node_config_set_subject(NODE_B))
