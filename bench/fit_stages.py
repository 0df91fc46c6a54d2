"""The request, the options, a node's cards and the first fit, each timed apart, warm: what a
placed pod's call spends outside the candidate walk on reading the pod and on the node it lands.

The pods are `scheduler.decision_trace`'s (varied: 1-8 GPUs per container, MiB or %, binpack or
spread, some two-container pods), the cluster `scheduler.build_cluster`'s (8 GPUs a node, half
used). Per pod, µs of this thread (the best of 9 passes over all pods, so warm): the pod's request
(`hami.parse_pod_request`) read again as the next pod of its workload would be, and read for
the first time ("first read": its shape not remembered, as most of the varied trace's pods
are: 221 shapes in 400 pods), and its options (`rules.parse_pod_options`); a node's cards built
again after a write that changed one card's usage (`NodeEntry.cards` after the row was rebuilt:
`cards.recharged`), and built from its devices (the node's first fit: `cards.cards_with_usage`);
the pod's fit on a node (`fit_pod`), and of it the answer's grants alone (`placement._grant`
of each card the fit took, where the version has it).

    python bench/fit_stages.py      (BENCH_NODES, 300; BENCH_PODS, 400; ROOT, this checkout)

Two versions compare run by run, alternating (`ROOT=<the other tree>`): the pods' container
requests are read by whichever `tessera.hami` the device kinds import, so run each version
with its own tree first on PYTHONPATH.

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
    remembered = hami._remembered_requests

    def first_reads() -> None:
        for spec in specs:
            remembered[1].clear()  # (not cleared at once: the next read fills it again)
            hami.parse_pod_request(spec, settings)

    cleared = best_of(lambda: [remembered[1].clear() for _ in specs])
    first = best_of(first_reads) - cleared
    opts = best_of(lambda: [R.parse_pod_options(spec, settings) for spec in specs])
    fit = best_of(lambda: [
        PL.fit_pod(entries[i % nodes].cards, request, R.FitContext(option, R.QuotaBudget()))
        for i, (request, option) in enumerate(zip(requests, options, strict=True))
    ])
    fits = [
        PL.fit_pod(entries[i % nodes].cards, request, R.FitContext(option, R.QuotaBudget()))
        for i, (request, option) in enumerate(zip(requests, options, strict=True))
    ]
    taken = [(entries[i % nodes], request, option, fitted) for i, (request, option, fitted)
             in enumerate(zip(requests, options, fits, strict=True)) if fitted.ok]  # fmt: skip

    def grants() -> None:
        for entry, request, option, fitted in taken:
            by_uuid = {c.uuid: c for c in entry.cards}
            ctx = R.FitContext(option, R.QuotaBudget())
            for wanted, given in zip(request.all, fitted.containers, strict=True):
                for grant in given:
                    PL._grant(by_uuid[grant.uuid], wanted, ctx)  # type: ignore[arg-type]

    granted = best_of(grants) if hasattr(PL, "_grant") else 0
    given = sum(len(g) for *_, fitted in taken for g in fitted.containers)
    pods = len(specs)
    print(f"{ROOT.name}: {pods} pods, {nodes} nodes; µs per call, warm: request "
          f"{read / pods / 1e3:.2f} (first read {first / pods / 1e3:.2f}), options "
          f"{opts / pods / 1e3:.2f}, cards after a write {per_recharge / 1e3:.2f}, cards from "
          f"the devices {fresh / nodes / 1e3:.2f}, fit {fit / pods / 1e3:.2f} (of which the "
          f"grants {granted / pods / 1e3:.2f}: {given} grants for the {len(taken)} pods that "
          "fit)")


if __name__ == "__main__":
    main()
