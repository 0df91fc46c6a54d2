"""What a backlog of unschedulable pods takes of the scheduler, with and without its bound.

kube-scheduler keeps retrying a pod the extender refused, after its backoff (1 s doubling to
10 s), for as long as it is pending. Here its loop runs against the scheduler's own decision
code and `backlog.BacklogGovernor` (the filter's admit/charge, as `filtering.PodFilter` calls
them) on a clock advanced by each call's CPU time (this thread's: the scheduler's one event
loop is what a backlog competes for): whenever no backlog retry is due, the next pod of a
stream of placeable ones is decided and placed; a retry that is due is decided (or deferred,
`BacklogDeferred`). A pod's first try is always evaluated, so the bound is judged once every
backlog pod was tried ("the backlog's retries"). The backlog's pods all ask differently
(their memos cannot be shared) and a third have several containers. Printed: the backlog's
share of the CPU, the placed pods per second of that clock, how many retries were deferred,
and the longest time a backlog pod went without an evaluation, for each
`TESSERA_BACKLOG_SHARE` given.

    python bench/backlog_share.py            # BENCH_NODES (5000), BENCH_BACKLOG (300),
                                             # BENCH_SECONDS (8), BENCH_SHARES ("1,0.25")
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import scheduler as bench  # noqa: E402
import scheduler_scale  # noqa: E402

from services.scheduler.backlog import BacklogGovernor  # noqa: E402
from services.scheduler.decide import decide  # noqa: E402
from services.scheduler.index import ClusterIndex  # noqa: E402
from services.scheduler.rules import parse_pod_options  # noqa: E402
from tessera.hami import parse_pod_request  # noqa: E402
from tessera.models import Allocation  # noqa: E402
from tessera.settings import TesseraSettings  # noqa: E402

MIB = 1
GIB = 1024 * MIB
BACKOFF_MAX_S = 10.0  # kube-scheduler's podMaxBackoffSeconds


def backlog_pods(count: int) -> list[dict[str, Any]]:
    """Pods no node of the bench cluster takes, each asking a little differently: one card of
    48+ GiB, 9 cards, or two containers of 5 cards with 60 % of their cores each (the first
    fits many nodes alone; together they need 10 cards)."""
    pods = []
    for i in range(count):
        if i % 3 == 0:
            containers = [{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 48 * GIB + i}]
        elif i % 3 == 1:
            containers = [{"nvidia.com/gpu": 9, "nvidia.com/gpumem": GIB + i}]
        else:
            containers = [{"nvidia.com/gpu": 5, "nvidia.com/gpumem": GIB + i,
                           "nvidia.com/gpucores": 60}] * 2  # fmt: skip
        uid = f"backlog-{i}"
        pods.append({
            "metadata": {"name": uid, "namespace": "bench", "uid": uid, "annotations": {}},
            "spec": {"containers": [{"name": f"c{n}", "resources": {"limits": dict(limits)}}
                                    for n, limits in enumerate(containers)]},
        })  # fmt: skip
    return pods


def run(share: float, nodes: int, backlog: int, seconds: float) -> dict[str, float]:
    settings = TesseraSettings()
    registrations, ledgers = bench.build_cluster(nodes)
    index = ClusterIndex()
    for r, ledger in zip(registrations, ledgers, strict=True):
        index.set_registration(r.node, r, 0.0)
        index.set_ledger(r.node, ledger, 1, 0.0)
    names = [r.node for r in registrations]
    del registrations, ledgers
    gc.collect()
    governor = BacklogGovernor(share=share)
    stream = iter(pods for pods, _pool in bench.decision_trace(100_000))
    pending = {p["metadata"]["uid"]: p for p in backlog_pods(backlog)}
    due = {uid: i * 1.0 / backlog for i, uid in enumerate(pending)}  # first tries in 1 s
    attempts = dict.fromkeys(pending, 0)
    last_evaluated: dict[str, float] = {}
    longest_gap = 0.0
    now = 0.0
    spent = {"refused": 0.0, "placed": 0.0}
    # after every backlog pod's first evaluation (always made: `BacklogGovernor.admit`):
    # the backlog's own calls' CPU and every call's
    steady = {"backlog": 0.0, "all": 0.0}
    placed = deferred = evaluated = 0
    window = max(100, int(nodes * max(5, 50 - nodes / 125) / 100))  # adaptive percentage
    start = 0

    def call(spec: dict[str, Any]) -> tuple[bool, float]:
        nonlocal start
        listed = (names + names)[start : start + window]  # kube-scheduler's rotating window
        start = (start + window) % len(names)
        began = time.thread_time()
        request = parse_pod_request(spec, settings)
        options = parse_pod_options(spec, settings)
        decision = decide(index, request, options, listed)
        chosen = next(decision.fits(), None)
        if chosen is None:
            decision.explain_rest()
            decision.failed.to_json()
        cpu = time.thread_time() - began
        index.tidy_orders()
        if chosen is not None:
            entry, fit = chosen
            ledger = entry.ledger.model_copy(deep=False)
            ledger.allocations = dict(ledger.allocations)
            uid = spec["metadata"]["uid"]
            ledger.allocations[uid] = Allocation(
                pod_uid=uid, namespace="bench", name=uid, node=entry.name,
                containers=fit.containers, init_count=len(request.init),
            )  # fmt: skip
            index.set_ledger(entry.name, ledger, entry.ledger_revision + 1, 0.0)
        return chosen is not None, cpu

    while now < seconds:
        uid = min(due, key=due.__getitem__)
        if due[uid] <= now:
            if governor.admit(uid, now):
                ok, cpu = call(pending[uid])
                governor.charge(uid, cpu, not ok, now + cpu)
                spent["refused" if not ok else "placed"] += cpu
                if len(last_evaluated) == len(pending):
                    steady["backlog"] += cpu
                    steady["all"] += cpu
                evaluated += 1
                if uid in last_evaluated:
                    longest_gap = max(longest_gap, now - last_evaluated[uid])
                last_evaluated[uid] = now
                now += cpu
            else:
                deferred += 1
            attempts[uid] += 1
            due[uid] = now + min(BACKOFF_MAX_S, 2.0 ** (attempts[uid] - 1))
            continue
        spec = next(stream)
        ok, cpu = call(spec)
        governor.charge(spec["metadata"]["uid"], cpu, not ok, now + cpu)
        spent["refused" if not ok else "placed"] += cpu
        if len(last_evaluated) == len(pending):
            steady["all"] += cpu
        placed += ok
        now += cpu
    total = spent["refused"] + spent["placed"]
    return {"share": share, "backlog_cpu_share": spent["refused"] / total,
            "steady_share": steady["backlog"] / max(steady["all"], 1e-9),
            "placed_per_s": placed / now, "evaluated": evaluated, "deferred": deferred,
            "longest_gap_s": longest_gap, "clock_s": now}


def main() -> None:
    nodes = int(os.environ.get("BENCH_NODES", "5000"))
    backlog = int(os.environ.get("BENCH_BACKLOG", "300"))
    seconds = float(os.environ.get("BENCH_SECONDS", "8"))
    shares = [float(s) for s in os.environ.get("BENCH_SHARES", "1,0.25").split(",")]
    for share in shares:
        load = scheduler_scale.loadavg()
        got = run(share, nodes, backlog, seconds)
        print(f"{nodes} nodes, backlog {backlog} pods, {seconds:g} s of scheduler CPU, "
              f"TESSERA_BACKLOG_SHARE {share:g}: refused calls took "
              f"{got['backlog_cpu_share'] * 100:.1f} % of the CPU (the backlog's retries, once "
              f"each was tried: {got['steady_share'] * 100:.1f} %), placed "
              f"{got['placed_per_s']:.0f} pods/s, backlog evaluations {got['evaluated']}, "
              f"deferred {got['deferred']}, longest gap between a pod's evaluations "
              f"{got['longest_gap_s']:.1f} s (load {load} -> {scheduler_scale.loadavg()})",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
