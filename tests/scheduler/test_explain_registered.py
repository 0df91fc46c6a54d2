"""The scheduler's explain endpoint is registered on the server before the replica counts it as
served: a request from another connection right after start is answered, never "no
responders" — on a link where the server reads the scheduler's commands late
(`slow_nats_link`, as a busy server may)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from slow_nats_link import SlowLink

from tessera import bus
from tessera.codec import decode, encode
from tessera.models import ExplainReply, ExplainRequest

from .conftest import MakeService


@pytest.fixture
async def slow_url(nats_url: str) -> AsyncIterator[str]:
    """(Set up before make_service: closed after the replicas have stopped.)"""
    link = SlowLink(nats_url, delay_s=0.02)
    try:
        yield await link.start()
    finally:
        await link.stop()


async def test_explain_is_answered_right_after_start(slow_url: str, make_service: MakeService,
                                                     nc: Any) -> None:  # fmt: skip
    await make_service(url=slow_url)
    reply = await nc.request(bus.SCHEDULER_EXPLAIN, encode(ExplainRequest(
        namespace="default", name="nobody")), timeout=10)  # fmt: skip
    answer = decode(reply.data, ExplainReply)
    assert answer.ok and not answer.pending, answer  # answered: nothing of it waits here
