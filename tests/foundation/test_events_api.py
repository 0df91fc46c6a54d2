"""The event stream as an outside consumer (billing, audit) uses it."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tessera.bus import alloc_event_subject, connect, publish_event
from tessera.events import subscribe
from tessera.events_doc import render
from tessera.models import AllocationEvent, DeviceGrant, QuotaEvent
from tessera.settings import NatsSettings

ROOT = Path(__file__).resolve().parents[2]


def alloc(node: str, action: str, pod: str) -> AllocationEvent:
    grant = DeviceGrant(uuid="GPU-1", type="NVIDIA-H200", memory_mib=3000, cores=30)
    return AllocationEvent(
        action=action, node=node, pod_uid=f"uid-{pod}", namespace="team-a", name=pod,
        containers=[[grant]],
    )


async def take(stream, count: int, timeout: float = 5.0) -> list:
    out = []
    for _ in range(count):
        out.append(await asyncio.wait_for(anext(stream), timeout))
    return out


async def test_durable_consumer_resumes_after_its_last_ack(nc, buckets) -> None:
    node = f"billing-{uuid.uuid4().hex[:6]}"
    js = nc.jetstream()
    subject = alloc_event_subject(node, "*")
    for i in range(3):
        await publish_event(js, alloc(node, "bound", f"p{i}"))
    durable = f"billing{uuid.uuid4().hex[:6]}"
    stream = subscribe(nc, subject, durable=durable)
    first = await take(stream, 2)
    for received in first:
        await received.ack()
    await stream.aclose()
    # The consumer goes away; more events happen meanwhile.
    await publish_event(js, alloc(node, "released", "p0"))
    consumer = await connect(NatsSettings(NATS_URL=nc.connected_url.geturl()), name="billing")
    try:
        stream = subscribe(consumer, subject, durable=durable)
        rest = await take(stream, 2)
        await stream.aclose()
    finally:
        await consumer.close()
    names = [(r.event.name, r.event.action) for r in first + rest]
    assert names == [("p0", "bound"), ("p1", "bound"), ("p2", "bound"), ("p0", "released")]
    assert isinstance(rest[0].event, AllocationEvent)
    assert rest[0].event.containers[0][0].memory_mib == 3000


async def test_ephemeral_consumer_starts_at_a_sequence_or_a_time(nc, buckets) -> None:
    node = f"audit-{uuid.uuid4().hex[:6]}"
    js = nc.jetstream()
    subject = alloc_event_subject(node, "*")
    await publish_event(js, alloc(node, "reserved", "early"))
    await asyncio.sleep(0.05)
    cut = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.05)
    await publish_event(js, alloc(node, "bound", "late"))
    everything = subscribe(nc, subject)
    all_events = await take(everything, 2)
    await everything.aclose()
    assert [r.event.name for r in all_events] == ["early", "late"]
    from_seq = subscribe(nc, subject, start_sequence=all_events[1].sequence)
    assert [r.event.name for r in await take(from_seq, 1)] == ["late"]
    await from_seq.aclose()
    from_time = subscribe(nc, subject, start_time=cut)
    assert [r.event.name for r in await take(from_time, 1)] == ["late"]
    await from_time.aclose()


async def test_garbage_on_the_stream_is_skipped(nc, buckets) -> None:
    node = f"junk-{uuid.uuid4().hex[:6]}"
    js = nc.jetstream()
    await js.publish(alloc_event_subject(node, "bound"), b"\x00garbage")
    await publish_event(js, alloc(node, "bound", "good"))
    stream = subscribe(nc, alloc_event_subject(node, "*"))
    (received,) = await take(stream, 1)
    await stream.aclose()
    assert received.event.name == "good"


async def test_cli_prints_events_as_json_lines(nats_url: str, nc, buckets) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:6]}"
    await publish_event(
        nc.jetstream(), QuotaEvent(action="exceeded", namespace=namespace, reason="over gpumem")
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tessera_cli", "events", f"tessera.events.quota.{namespace}.>",
        "--json", "--no-follow",
        env={**os.environ, "NATS_URL": nats_url}, stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert proc.returncode == 0
    assert len(lines) == 1
    assert lines[0]["schema"] == "QuotaEvent" and lines[0]["version"] == 1
    assert lines[0]["namespace"] == namespace and lines[0]["reason"] == "over gpumem"


def test_events_doc_matches_the_models() -> None:
    assert (ROOT / "docs" / "events.md").read_text() == render(), "run `make docs`"


def test_readable_cli_line_names_the_pod(nats_url: str) -> None:
    from tessera_cli.events import describe

    line = describe(alloc("node-1", "bound", "trainer"))
    assert line == "team-a/trainer bound on node-1 [GPU-1(3000MiB,30%)]"
    assert subprocess.run(
        [sys.executable, "-m", "tessera_cli", "events", "--help"], capture_output=True, text=True
    ).returncode == 0
