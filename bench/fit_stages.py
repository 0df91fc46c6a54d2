"""The request, the options, a node's cards and the first fit, each timed apart, warm: what a
placed pod's call spends outside the candidate walk on reading the pod and on the node it lands.

The pods are `scheduler.decision_trace`'s (varied: 1-8 GPUs per container, MiB or %, binpack or
spread, some two-container pods), the cluster `scheduler.build_cluster`'s (8 GPUs a node, half
used). Per pod, µs of this thread (the best of 9 passes over all pods, so warm): the pod's request
(`hami.parse_pod_request`) and options (`rules.parse_pod_options`), read again as the next pod of
its workload would be; a node's cards built again after a write that changed one card's usage
(`NodeEntry.cards` after the row was rebuilt: `cards.recharged`), and built from its devices
(the node's first fit: `cards.cards_with_usage`); the pod's fit on a node (`fit_pod`).

    python bench/fit_stages.py      (BENCH_NODES, 300; BENCH_PODS, 400; ROOT, this checkout)

Cold costs (a call after other work evicted the caches) are 2-4x these: see h35's per-stage
figures in bench/RESULTS.md "fitfast". Printed, not recorded.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("ROOT", Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import scheduler as bench  # noqa: E402

from services.scheduler import cards as C  # noqa: E402
from services.scheduler import index as I  # noqa: E402
from services.scheduler import placement as PL  # noqa: E402
from services.scheduler import rules as R  # noqa: E402
from tessera import hami  # noqa: E402
from tessera.models import Allocation, DeviceGrant  # noqa: E402
from tessera.settings import TesseraSettings  # noqa: E402


def best_of(run: Any, passes: int = 9) -> int:
    best = 1 << 62
    for _ in range(passes):
        started = time.thread_time_ns()
        run()
        best = min(best, time.thread_time_ns() - started)
    return best


def main() -> None:
    settings = TesseraSettings()
    nodes = int(os.environ.get("BENCH_NODES", "300"))
    specs = [spec for spec, _pool in bench.decision_trace(int(os.environ.get("BENCH_PODS", "400")))]
    registrations, ledgers = bench.build_cluster(nodes)
    index = I.ClusterIndex()
    for registration, ledger in zip(registrations, ledgers, strict=True):
        index.set_registration(registration.node, registration, 0.0)
        index.set_ledger(registration.node, ledger, 1, 0.0)
    entries = [index.entry_at(slot) for slot in range(nodes)]
    requests = [hami.parse_pod_request(spec, settings) for spec in specs]
    options = [R.parse_pod_options(spec, settings) for spec in specs]
    for entry in entries:
        entry.cards  # noqa: B018 (built once: the next are built from these)

    def written(entry: I.NodeEntry, n: int) -> None:
        """One more small pod on the node's first card (its row rebuilt, its cards not yet)."""
        ledger = entry.ledger.model_copy(deep=False)  # type: ignore[union-attr]
        ledger.allocations = dict(ledger.allocations)
        card = entry.cards[0]
        uid = f"more-{n}"
        ledger.allocations[uid] = Allocation(
            pod_uid=uid, namespace="bench", name=uid, node=entry.name,
            containers=[[DeviceGrant(uuid=card.uuid, type=card.type, memory_mib=1, cores=0)]])
        index.set_ledger(entry.name, ledger, entry.ledger_revision + 1, 0.0)

    rebuilt = [0]

    def recharged() -> None:
        for entry in entries:
            rebuilt[0] += 1
            written(entry, rebuilt[0])
        started = time.thread_time_ns()
        for entry in entries:
            entry.cards  # noqa: B018
        spent[0] += time.thread_time_ns() - started

    spent = [0]
    for _ in range(9):
        recharged()
    per_recharge = spent[0] / 9 / nodes
    fresh = best_of(lambda: [C.cards_with_usage(e.registered, *e._card_usage) for e in entries])  # type: ignore[arg-type]
    read = best_of(lambda: [hami.parse_pod_request(spec, settings) for spec in specs])
    opts = best_of(lambda: [R.parse_pod_options(spec, settings) for spec in specs])
    fit = best_of(lambda: [
        PL.fit_pod(entries[i % nodes].cards, request, R.FitContext(option, R.QuotaBudget()))
        for i, (request, option) in enumerate(zip(requests, options, strict=True))
    ])
    pods = len(specs)
    print(f"{ROOT.name}: {pods} pods, {nodes} nodes; µs per call, warm: request "
          f"{read / pods / 1e3:.2f}, options {opts / pods / 1e3:.2f}, cards after a write "
          f"{per_recharge / 1e3:.2f}, cards from the devices {fresh / nodes / 1e3:.2f}, fit "
          f"{fit / pods / 1e3:.2f}")


if __name__ == "__main__":
    main()
