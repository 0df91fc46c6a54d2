"""Victim selection at cluster scale (services/scheduler/preemption.py; run by `make bench`).

A full cluster of N nodes × 8 GPUs (80 GiB, split 10) packed with pods of 10-40 GiB and random
priorities 0-999. For each query, a pod of priority 500-1000 that fits no node asks which
lower-priority pods to evict: the vectorised bound over every allocation, then the exact search
on nodes in bound order. Timed: `select_victims` on a view built from cached per-node blocks
(what the scheduler does between ledger changes), and separately building the blocks and
concatenating them (what a cold cache costs).

    python bench/preemption.py            # 5,000 nodes; BENCH_NODES=1000,5000 for several
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import record_section
from tessera.scheduler.preemption import (
    ClusterView,
    NodeBlock,
    NodeState,
    PreemptionQuery,
    select_victims,
)
from tessera.scheduler.rules import PodOptions

from tessera.hami import ContainerRequest, PodRequest
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo, NodeRegistration

GIB = 1024
NOW = 1_000_000.0
SHAPES = {
    "1 GPU × 30 GiB": PodRequest(containers=[ContainerRequest(1, 30 * GIB, None, 0)]),
    "2 GPUs × 50 GiB": PodRequest(containers=[ContainerRequest(2, 50 * GIB, None, 0)]),
    "1 whole GPU (100 % cores)": PodRequest(containers=[ContainerRequest(1, 0, 100, 100)]),
}


def cluster(n: int, rng: random.Random) -> tuple[list[NodeState], dict[str, int]]:
    nodes, priorities = [], {}
    for i in range(n):
        name = f"node-{i:05d}"
        devices = [DeviceInfo(uuid=f"GPU-{i}-{g}", index=g, type="NVIDIA-H100",
                              memory_mib=80 * GIB, cores=100, split_count=10) for g in range(8)]
        allocations = {}
        for g, d in enumerate(devices):
            free, k = 80 * GIB, 0
            while True:
                mem = rng.choice([10, 20, 30, 40]) * GIB
                if mem > free:
                    break
                uid = f"{name}-{g}-{k}"
                allocations[uid] = Allocation(
                    pod_uid=uid, namespace="batch", name=uid, node=name,
                    state=AllocationState.ALLOCATED,
                    containers=[[DeviceGrant(uuid=d.uuid, type=d.type, memory_mib=mem, cores=10)]],
                )  # fmt: skip
                priorities[uid] = rng.randrange(1000)
                free -= mem
                k += 1
        reg = NodeRegistration(node=name, devices=devices)
        nodes.append(NodeState(name, reg, allocations))
    return nodes, priorities


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(n: int, queries: int, rng: random.Random) -> list[str]:
    nodes, priorities = cluster(n, rng)
    allocations = sum(len(x.allocations) for x in nodes)
    t0 = time.perf_counter()
    blocks = [NodeBlock.of(x, NOW) for x in nodes]
    t_blocks = time.perf_counter() - t0
    t0 = time.perf_counter()
    view = ClusterView.of_blocks(blocks)
    t_concat = time.perf_counter() - t0
    t0 = time.perf_counter()
    view.after_each()  # per view, independent of the query
    warm = PreemptionQuery("warm", SHAPES["1 GPU × 30 GiB"], PodOptions(), 0, priorities)
    view.prefix(warm)
    t_after = time.perf_counter() - t0
    rows = []
    for shape, request in SHAPES.items():
        times, cpu, victims, exact = [], [], [], 0
        for q in range(queries):
            query = PreemptionQuery(
                pod_uid=f"preemptor-{q}", request=request, options=PodOptions(),
                priority=rng.randrange(500, 1000), priorities=priorities, now=NOW,
            )  # fmt: skip
            t0, c0 = time.perf_counter(), time.process_time()
            choice = select_victims(view, query)
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
            if choice is not None:
                victims.append(len(choice.victims))
                exact += choice.exact
        p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
        cpu99 = percentile(cpu, 0.99)
        verdict = (f"{'meets' if p99 < 50 else 'misses'} (wall), "
                   f"{'meets' if cpu99 < 50 else 'misses'} (CPU)")
        rows.append(
            f"| {n:,} × 8 | {allocations:,} | {shape} | {p50:.1f} | {p99:.1f} | "
            f"{max(times):.1f} | {cpu99:.1f} | "
            f"{statistics.mean(victims) if victims else 0:.1f} | "
            f"{exact}/{len(victims)} | {verdict} |"
        )
    rows.append(
        f"| {n:,} × 8 | {allocations:,} | per view, not per query: per-node blocks "
        f"{t_blocks * 1000:.0f} ms (kept per ledger revision), concatenation "
        f"{t_concat * 1000:.0f} ms, single-eviction and priority-prefix tables "
        f"{t_after * 1000:.0f} ms | | | | | | | |"
    )
    return rows


def main() -> None:
    sizes = [int(x) for x in os.environ.get("BENCH_NODES", "5000").split(",")]
    queries = int(os.environ.get("BENCH_QUERIES", "100"))
    rng = random.Random(7)
    lines = [
        "Victim selection (`services/scheduler/preemption.py`): a full cluster (every GPU "
        "packed with 10-40 GiB pods of random priority 0-999); each query is a pod of priority "
        "500-999 that fits nowhere. Time = `select_victims` (vectorised bound over every "
        "allocation + exact search in bound order) on a view of cached per-node blocks. "
        f"{queries} queries per shape. `python bench/preemption.py`.",
        "",
        "| nodes | allocations | pod | p50 ms | p99 ms | max ms | p99 CPU ms | victims (mean) | "
        "exact | target (p99) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in sizes:
        lines += run(n, queries, rng)
    load = os.getloadavg()
    lines += ["", f"Load average during the run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
              "(2 shared cores)."]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    record_section("preemption", text)


if __name__ == "__main__":
    main()
