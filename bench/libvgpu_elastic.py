"""Elastic compute on one fake GPU (issue 33): idle compute lent, taken back, noisy neighbour.

Three containers with shares 10/30/60, each elastic up to the whole card (limits 1.2), one burning
process each (2 ms kernels, 8 in flight), the node agent's lending tick (every 20 ms,
tessera.elastic_compute) beside them: all busy, then only the 10 % one, then the others wake.
Then a 25 % hard slice alone and beside a noisy elastic neighbour (10 % guaranteed, bursting to
the whole card). Every share is read off the fake device's timeline (the truth, per pid).
Records the figures in bench/RESULTS.md (section "libvgpu elastic").

    python bench/libvgpu_elastic.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from record import record_section  # noqa: E402

from tests.native.conftest import Cluster, build_native  # noqa: E402
from tests.native.elastic import run_lend_and_reclaim, run_noisy_neighbour  # noqa: E402

SHARES = (10, 30, 60)
SHARE_TOL = 2.0
ALONE_MIN = 90.0
SETTLE_MS = 100.0
SLOWDOWN_MAX = 5.0
BUSY_S, WARMUP_S = 5.0, 2.0  # all busy; measured after the warm-up (as bench/libvgpu_sharing.py)


def _fmt(xs, nd=1) -> str:
    return "–".join(f"{v:.{nd}f}" for v in (min(xs), max(xs))) if xs else "n/a"


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def lend_and_reclaim(cluster):
    return run_lend_and_reclaim(cluster, busy_s=BUSY_S, warmup_s=WARMUP_S)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    native = build_native("")
    load = os.getloadavg()[0]
    lends, noisies = [], []
    for i in range(args.runs):
        for fn, out in ((lend_and_reclaim, lends), (run_noisy_neighbour, noisies)):
            with tempfile.TemporaryDirectory() as tmp:
                cluster = Cluster(native, Path(tmp))
                try:
                    out.append(fn(cluster))
                finally:
                    cluster.close()
        r, n = lends[-1], noisies[-1]
        print(f"run {i + 1}: all busy {[round(x, 2) for x in r.all_busy]}, alone {r.alone:.2f}, "
              f"reaction {r.lender_reaction_ms} ms, settle {r.settle_ms}, after wake "
              f"{[round(x, 2) for x in r.after_wake]}; noisy: {n.guaranteed_alone:.2f} -> "
              f"{n.guaranteed_noisy:.2f} ({n.slowdown_pct:.2f} %), neighbour {n.noisy:.2f}",
              flush=True)
    load = max(load, os.getloadavg()[0])

    busy_err = max(abs(x - s) for r in lends for x, s in zip(r.all_busy, SHARES, strict=True))
    after_err = max(abs(x - s) for r in lends for x, s in zip(r.after_wake, SHARES, strict=True))
    alone = [r.alone for r in lends]
    reaction = [r.lender_reaction_ms for r in lends if r.lender_reaction_ms is not None]
    settle = {w: [r.settle_ms[w] for r in lends] for w in lends[0].settle_ms}
    slow = [n.slowdown_pct for n in noisies]

    def worst(xs):
        return None if any(x is None for x in xs) else max(xs)

    rows = [
        ("all busy: each vs its share (10/30/60)",
         "; ".join(f"{s} → {_fmt([r.all_busy[k] for r in lends])}" for k, s in enumerate(SHARES)),
         f"worst {busy_err:.2f} points", f"±{SHARE_TOL:.0f} points", busy_err <= SHARE_TOL),
        ("only the 10 % one busy (burst 100): its % of the card", _fmt(alone, 2),
         f"min {min(alone):.2f} %", f"≥ {ALONE_MIN:.0f} %", min(alone) >= ALONE_MIN),
        ("others wake: the agent lowers the borrower's allowance", f"{_fmt(reaction, 0)} ms",
         f"max {max(reaction):.0f} ms" if reaction else "n/a", "(one 20 ms tick)", True),
    ]
    for w, xs in settle.items():
        judged = w == "1000 ms"  # the window the sharing figures use; shorter ones: informational
        ok = worst(xs) is not None and worst(xs) <= SETTLE_MS
        rows.append((f"others wake: every share within ±2 over the {w} window from T; T =",
                     " / ".join(_ms(x) for x in xs) + " ms", f"max {_ms(worst(xs))} ms",
                     f"≤ {SETTLE_MS:.0f} ms" if judged else "(informational)",
                     ok if judged else True))
    rows += [
        ("others wake: each over [wake + 100 ms, wake + 1.1 s)",
         "; ".join(f"{s} → {_fmt([r.after_wake[k] for r in lends])}"
                   for k, s in enumerate(SHARES)),
         f"worst {after_err:.2f} points", f"±{SHARE_TOL:.0f} points", after_err <= SHARE_TOL),
        ("noisy neighbour at full burst: a 25 % slice alone → beside it",
         "; ".join(f"{n.guaranteed_alone:.2f} → {n.guaranteed_noisy:.2f}" for n in noisies),
         f"slowdown {_fmt(slow, 2)} %", f"≤ {SLOWDOWN_MAX:.0f} %", max(slow) <= SLOWDOWN_MAX),
        ("noisy neighbour (10 % guaranteed, burst 100): its %",
         _fmt([n.noisy for n in noisies], 2), "lent the rest", "(75)", True),
    ]
    table = "\n".join(f"| {a} | {b} | {c} | {d} | {'yes' if ok else 'NO'} |"
                      for a, b, c, d, ok in rows)
    bins = lends[-1].early_bins
    trace = "\n".join(f"| {k} | " + " ".join(f"{v:.0f}" for v in vs) + " |"
                      for k, vs in bins.items())
    text = (
        "Fake GPU timeline (tests/native/fakes: one device queue for every process, real time), "
        "one burning process per container (2 ms kernels, 8 in flight), the node agent's lending "
        "tick every 20 ms beside them (`tessera.elastic_compute.ComputeLender`, as "
        "`services/node-agent/lending.py` runs it). Scenario: shares 10/30/60, each elastic up "
        "to 100 %: all busy 5 s (measured after a 2 s warm-up), then only the 10 % one for "
        "3 s (measured from 0.5 s after the others stopped), then the others wake (the same "
        f"processes launch again) for 2.5 s. {args.runs} runs; each cell lists min–max or "
        "every run. Noisy "
        "neighbour: a 25 % hard slice burning alone for 3 s, then beside an elastic neighbour "
        "(10 % guaranteed, burst 100) burning as fast as it is let; slowdown = the slice's share "
        "lost. Settling time T after the wake: the first T (10 ms steps) from which every "
        "container's share over [wake + T, wake + T + window) is within ±2 points of its own "
        "(1 s windows, as the sharing figures; over 250/500 ms windows a 10 % container holds "
        "only 12/25 kernels, so one kernel more or less is ~1 point, and a launcher descheduled "
        "by the busy host shows — those rows are informational). "
        f"Host load average during the run: {load:.1f} (2 cores, shared with other work).\n\n"
        "| measure | figures | result | target | met |\n|---|---|---|---|---|\n"
        + table
        + "\n\nShares (% of the device) per 20 ms from the wake, last run — the borrower "
        "(a) is back at its share after about three bins (its queued launches drain), the "
        "others take its place:\n\n| container | per 20 ms |\n|---|---|\n"
        + trace
        + "\n\nFor comparison, HAMi-core at a 25 % slice: 14.4 % slowdown under a noisy "
        "neighbour (GPU-Virt-Bench, as quoted in issue 33; a real GPU, not this fake timeline). "
        "`python bench/libvgpu_elastic.py --runs 3`."
    )
    print(text)
    if not args.no_record:
        record_section("libvgpu elastic", text)


if __name__ == "__main__":
    main()
