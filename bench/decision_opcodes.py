"""Python bytecodes and calls one version of the scheduler's code executes per placed decision:
a count that does not move with the machine's load (a shared 2-core machine's CPU times do, by
more than a small change moves them; `decision_lockstep.py` times both versions side by side).

    python bench/decision_opcodes.py REV [PODS]

REV: a git revision or `worktree` (as `decision_lockstep.py` reads it: its `services/scheduler`
and `tessera/hami.py`). The varied trace with its 10 % unschedulable backlog on 5,000 nodes × 8
GPUs (`bench/scheduler.py`); the first 50 pods untraced (warm-up); then each decision of a pod
that is placed (parse the pod, its options, decide, the first fit) traced opcode by opcode.
Printed, not recorded. Slow (the tracing): 450 pods take about a minute.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import decision_lockstep as lockstep  # noqa: E402
import scheduler as bench  # noqa: E402
from kube_lists import KubeLists  # noqa: E402

from tessera.models import Allocation  # noqa: E402
from tessera.settings import TesseraSettings  # noqa: E402

WARMUP = 50


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "worktree"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 450
    settings = TesseraSettings()
    pods = bench.with_backlog(bench.decision_trace(max(count, WARMUP)), 0.1)[:count]
    counts = [0, 0]  # opcodes, calls

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[0] += 1
        elif event == "call":
            counts[1] += 1
        return tracer

    with tempfile.TemporaryDirectory() as tmp:
        into = Path(tmp) / "v"
        into.mkdir()
        m = lockstep.load("v", lockstep.source(rev, into))
        registrations, ledgers = bench.build_cluster(5000)
        every = [r.node for r in registrations]
        members = {pool: frozenset(bench.pool_members(every, pool)) for pool in bench.POOLS}
        kube = KubeLists(every, "window")
        index = m["index"].ClusterIndex()
        for r, ledger in zip(registrations, ledgers, strict=True):
            index.set_registration(r.node, r, 0.0)
            index.set_ledger(r.node, ledger, 1, 0.0)
        del registrations, ledgers
        gc.collect()
        gc.freeze()
        placed = [0, 0, 0]  # opcodes, calls, decisions
        for i, (spec, pool) in enumerate(pods):
            window = kube.next(None if pool is None else members[pool])
            before = counts[:]
            if i >= WARMUP:
                sys.settrace(tracer)
            request = m["hami"].parse_pod_request(spec, settings)
            options = m["rules"].parse_pod_options(spec, settings)
            decision = m["decide"].decide(index, request, options, window)
            chosen = next(decision.fits(), None)
            sys.settrace(None)
            if chosen is None:
                decision.explain_rest()
                continue
            if i >= WARMUP:
                placed[0] += counts[0] - before[0]
                placed[1] += counts[1] - before[1]
                placed[2] += 1
            lockstep.tidy_between_calls(index)
            entry, fit = chosen
            ledger = entry.ledger.model_copy(deep=False)
            ledger.allocations = dict(ledger.allocations)
            uid = spec["metadata"]["uid"]
            ledger.allocations[uid] = Allocation(
                pod_uid=uid, namespace="bench", name=uid, node=entry.name,
                containers=fit.containers, init_count=len(request.init),
            )  # fmt: skip
            index.set_ledger(entry.name, ledger, entry.ledger_revision + 1, 0.0)
    opcodes, calls, n = placed
    print(f"{rev}: {n} placed decisions, {opcodes} opcodes ({opcodes / max(n, 1):.0f} each), "
          f"{calls} Python calls ({calls / max(n, 1):.1f} each)")


if __name__ == "__main__":
    main()
