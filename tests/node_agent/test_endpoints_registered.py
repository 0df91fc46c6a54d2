"""The node agent's request endpoints (limits.set; node config set/get) are registered on the
server before their start returns: a request from another connection right after start is
answered, never "no responders" — on a link where the server reads the agent's commands late
(`slow_nats_link`, as a busy server may), where a start that returned before its SUB reached
the server left exactly that window."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from slow_nats_link import SlowLink
from tessera.node_agent.containers import ContainerStore
from tessera.node_agent.limits import LimitsService
from tessera.node_agent.node_config import NodeConfigurator
from tessera.node_agent.state import DeviceState

from tessera import bus
from tessera.codec import decode
from tessera.models import LimitsSetReply
from tessera.settings import NatsSettings, TesseraSettings

LOG = logging.getLogger("test-endpoints-registered")


async def test_limits_set_is_answered_right_after_start(short_dir: Path, nc, nats_url: str,
                                                        buckets) -> None:  # fmt: skip
    link = SlowLink(nats_url, delay_s=0.05)
    slow = await bus.connect(NatsSettings(NATS_URL=await link.start()), "slow-agent")
    node = f"n-{uuid.uuid4().hex[:8]}"
    service = LimitsService(node=node, nc=slow, store=ContainerStore(short_dir / "regions"),
                            state=DeviceState(), ledger_kv=buckets.ledger, log=LOG)  # fmt: skip
    try:
        await service.start()
        reply = await nc.request(bus.node_limits_subject(node), b"junk", timeout=10)
        assert not decode(reply.data, LimitsSetReply).ok  # answered (and refused: unsigned)
    finally:
        await service.stop()
        await slow.close()
        await link.stop()


async def test_node_config_is_answered_right_after_start(short_dir: Path, nc, nats_url: str,
                                                         buckets) -> None:  # fmt: skip
    link = SlowLink(nats_url, delay_s=0.05)
    slow = await bus.connect(NatsSettings(NATS_URL=await link.start()), "slow-agent")
    node = f"n-{uuid.uuid4().hex[:8]}"
    settings = TesseraSettings(region_host_dir=str(short_dir))
    configurator = NodeConfigurator(node=node, settings=settings, state=DeviceState(), gpus=[],
                                    ledger_kv=buckets.ledger, log=LOG, nc=slow)  # fmt: skip
    try:
        await configurator.start()
        reply = await nc.request(bus.node_config_get_subject(node), b"{}", timeout=10)
        assert reply.data  # answered: the node's configuration
    finally:
        await configurator.stop()
        await slow.close()
        await link.stop()
