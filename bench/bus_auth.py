"""What per-service NATS permissions cost on the hot paths: the same operations as the scheduler
identity against a server enforcing the generated authorization block, and anonymously against
one without it. Rounds alternate between the two servers so load on the machine hits both alike.

    .venv/bin/python bench/bus_auth.py [--n 1000]

Operations: a ledger compare-and-set (read + update, what /filter's reservation does), an event
publish with Nats-Msg-Id (acknowledged), and a quota request/reply round trip (a responder on
the quota identity).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record import record_section

from tessera import bus
from tessera import bus_permissions as bp
from tessera.bus import connect, ensure_bus, publish_event
from tessera.codec import encode
from tessera.models import AllocationEvent, NodeLedger
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats
from tessera_cli.stack_auth import StackAuth

ROUNDS = 5


class Target:
    """One server and the scheduler's and quota's connections to it."""

    def __init__(self, label: str, scheduler: NatsSettings, quota: NatsSettings) -> None:
        self.label = label
        self.scheduler_settings = scheduler
        self.quota_settings = quota
        self.samples: dict[str, list[float]] = {}

    async def open(self) -> None:
        self.nc = await connect(self.scheduler_settings, name="bench-scheduler")
        self.quota_nc = await connect(self.quota_settings, name="bench-quota")
        self.js = self.nc.jetstream()
        self.buckets = await ensure_bus(self.js, TesseraSettings())

        async def answer(msg) -> None:
            await msg.respond(b"ok")

        await self.quota_nc.subscribe(bus.QUOTA_RESERVE, queue="q", cb=answer)
        await self.quota_nc.flush()
        self.node = f"bench-{uuid.uuid4().hex[:6]}"
        await self.buckets.ledger.put(self.node, encode(NodeLedger(node=self.node)))

    async def close(self) -> None:
        await self.nc.close()
        await self.quota_nc.close()

    async def cas(self) -> None:
        entry = await self.buckets.ledger.get(self.node)
        await self.buckets.ledger.update(self.node, entry.value or b"", last=entry.revision)

    async def event(self) -> None:
        await publish_event(self.js, AllocationEvent(
            action="reserved", node=self.node, pod_uid=uuid.uuid4().hex, namespace="b", name="p"))

    async def request(self) -> None:
        await self.nc.request(bus.QUOTA_RESERVE, b"x", timeout=5)

    async def time(self, name: str, op: Callable[[], Awaitable[None]], n: int) -> None:
        out = self.samples.setdefault(name, [])
        for _ in range(n):
            started = time.perf_counter()
            await op()
            out.append((time.perf_counter() - started) * 1000)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(n: int) -> str:
    auth = StackAuth.generate([])
    plain_server = EmbeddedNats().start()
    auth_server = EmbeddedNats(auth_config=auth.server_config()).start()
    try:
        targets = [
            Target("anonymous, no permissions", NatsSettings(NATS_URL=plain_server.url),
                   NatsSettings(NATS_URL=plain_server.url)),
            Target("scheduler identity, generated permissions",
                   auth.settings(auth_server.url, bp.SCHEDULER),
                   auth.settings(auth_server.url, bp.QUOTA)),
        ]
        for target in targets:
            await target.open()
        per_round = max(1, n // ROUNDS)
        for _ in range(ROUNDS):
            for target in targets:
                await target.time("ledger CAS (get + update)", target.cas, per_round)
                await target.time("event publish (acked)", target.event, per_round)
                await target.time("request/reply to quota", target.request, per_round)
        for target in targets:
            await target.close()
    finally:
        plain_server.cleanup()
        auth_server.cleanup()
    lines = [
        "Same operations, same process, rounds alternating between a nats-server without "
        "authorization (anonymous) and one enforcing the generated block "
        "(`tessera/bus_permissions.py`) as the scheduler identity. Latencies in ms.",
        "",
        "| operation | server | n | p50 | p90 | p99 | mean |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in targets[0].samples:
        for target in targets:
            values = target.samples[name]
            lines.append(
                f"| {name} | {target.label} | {len(values)} | {pct(values, 0.5):.2f} | "
                f"{pct(values, 0.9):.2f} | {pct(values, 0.99):.2f} | "
                f"{statistics.fmean(values):.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1000, help="operations of each kind per server")
    args = parser.parse_args()
    table = asyncio.run(run(args.n))
    print(table)
    record_section("bus-auth", table)


if __name__ == "__main__":
    main()
