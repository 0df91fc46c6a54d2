"""Quota service latency over NATS: reserve (reserving and check-only), release, contention.

Runs an embedded nats-server and the real service processes (`python -m tessera.quota`), then
times request/reply round trips from a client process. Records its section in RESULTS.md.

    .venv/bin/python bench/quota.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record import record_section

from tessera import bus
from tessera.bus import connect
from tessera.codec import decode, encode, peek_schema
from tessera.models import (
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.nats_embedded import EmbeddedNats
from tessera.settings import NatsSettings


def start_replica(url: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "NATS_"))}
    env.update({"NATS_URL": url, "TESSERA_CLUSTER": "none", "TESSERA_LOG_LEVEL": "WARNING"})
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.quota"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50": q[49], "p90": q[89], "p99": q[98], "max": ms[-1]}


async def request(nc, subject: str, body) -> QuotaReply:  # type: ignore[no-untyped-def]
    msg = await nc.request(subject, encode(body), timeout=10)
    schema, _ = peek_schema(msg.data)
    if schema != "QuotaReply":
        raise RuntimeError(f"unexpected reply {schema}: {msg.data[:200]!r}")
    return decode(msg.data, QuotaReply)


async def timed(
    calls: list[Callable[[], Awaitable[object]]], concurrency: int
) -> tuple[list[float], float]:
    """Run the calls with `concurrency` in flight; per-call latencies and total wall time."""
    latencies: list[float] = []
    queue = list(reversed(calls))

    async def worker() -> None:
        while queue:
            call = queue.pop()
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - began


async def wait_serving(nc) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            await nc.request(bus.QUOTA_STATUS, encode(QuotaStatusRequest()), timeout=1)
            return
        except Exception:
            await asyncio.sleep(0.1)
    raise TimeoutError("quota service did not start")


async def scenario(url: str, n: int, replicas: int) -> list[tuple[str, dict[str, float], float]]:
    nc = await connect(NatsSettings(NATS_URL=url), name="bench-quota")
    rows: list[tuple[str, dict[str, float], float]] = []
    try:
        await wait_serving(nc)
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        limits = QuotaAmount(memory_mib=10**9, cores=10**7, gpus=10**6)
        await request(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=limits))

        def reserve(uid: str, check_only: bool = False, namespace: str = ns):  # type: ignore[no-untyped-def]
            body = QuotaRequest(namespace=namespace, pod_uid=uid, memory_mib=2000, cores=30,
                                gpus=1, check_only=check_only)
            return lambda: request(nc, bus.QUOTA_RESERVE, body)

        # Warm up (connections, JIT-free Python still has caches to fill).
        await timed([reserve(f"warm{i}", True) for i in range(100)], 1)

        lat, wall = await timed([reserve(f"a{i}") for i in range(n)], 1)
        rows.append(("reserve (hold), sequential", percentiles(lat), n / wall))
        lat, wall = await timed([reserve(f"a{i}") for i in range(n)], 1)
        rows.append(("reserve retry (already held), sequential", percentiles(lat), n / wall))
        lat, wall = await timed([reserve(f"c{i}", True) for i in range(n)], 1)
        rows.append(("reserve check-only (admission), sequential", percentiles(lat), n / wall))
        releases = [
            (lambda b: (lambda: request(nc, bus.QUOTA_RELEASE, b)))(
                QuotaRequest(namespace=ns, pod_uid=f"a{i}"))
            for i in range(n)
        ]
        lat, wall = await timed(releases, 1)
        rows.append(("release, sequential", percentiles(lat), n / wall))

        hot = f"{ns}-hot"
        await request(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=hot, limits=limits))
        lat, wall = await timed([reserve(f"h{i}", namespace=hot) for i in range(n)], 16)
        rows.append((f"reserve, 16 in flight, one namespace growing to {n} pods",
                     percentiles(lat), n / wall))
        spread = [reserve(f"s{i}", namespace=f"{ns}-{i % 16}") for i in range(n)]
        lat, wall = await timed(spread, 16)
        rows.append(("reserve, 16 in flight, 16 namespaces", percentiles(lat), n / wall))
    finally:
        await nc.close()
    return [(f"{name} ({replicas} replica{'s' if replicas > 1 else ''})", p, rate)
            for name, p, rate in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    rows: list[tuple[str, dict[str, float], float]] = []
    for replicas in (1, 2):
        with EmbeddedNats() as server:
            procs = [start_replica(server.url) for _ in range(replicas)]
            try:
                rows += asyncio.run(scenario(server.url, args.requests, replicas))
            finally:
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()

    lines = [
        "Round trips from one client process to `python -m tessera.quota` over a local "
        "nats-server (JetStream file storage); every reserve that holds quota is a KV read and "
        "a compare-and-set write. Latencies in ms.",
        "",
        "| operation | n | p50 | p90 | p99 | max | req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p, rate in rows:
        lines.append(
            f"| {name} | {p['n']:.0f} | {p['p50']:.2f} | {p['p90']:.2f} | {p['p99']:.2f} | "
            f"{p['max']:.2f} | {rate:.0f} |"
        )
    text = "\n".join(lines)
    print(text)
    record_section("quota", text)


if __name__ == "__main__":
    main()
