"""Compute shares when containers share one GPU (issue 19, item 5).

One burning process per container, each under its own `gpucores` limit (policy force), all on
the same fake GPU timeline (tests/native/fakes: one device queue for every process; an event pair
spans the neighbours' kernels queued ahead). What each container got is read off the timeline
(the device's truth); what it published is its region's achieved %. Several runs per mix; the
worst deviation over all runs is what counts. Records the figures in bench/RESULTS.md (section
"libvgpu sharing").

    python bench/libvgpu_sharing.py [--runs N] [--seconds S]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from record import record_section  # noqa: E402

from tests.native.conftest import Cluster, build_native  # noqa: E402
from tests.native.sharing import run_sharing  # noqa: E402

MIXES = {
    "alone": [30],
    "two, 90 %": [10, 80],
    "four, 90 %": [10, 20, 25, 35],
    "eight, 90 %": [5, 5, 10, 10, 10, 15, 15, 20],
    "two, full": [10, 90],
    "four, full": [10, 20, 30, 40],
    "eight, full": [5, 5, 10, 10, 10, 15, 20, 25],
}
SHARE_TOL, PUBLISHED_TOL = 2.0, 1.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    native = build_native("")
    rows = []
    for name, limits in MIXES.items():
        got: dict[int, list[float]] = {i: [] for i in range(len(limits))}
        pub_err: list[float] = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                cluster = Cluster(native, Path(tmp))
                try:
                    shares = run_sharing(cluster, limits, seconds=args.seconds)
                finally:
                    cluster.close()
            for i, s in enumerate(shares):
                got[i].append(s.got)
                if s.published:
                    pub_err.append(abs(statistics.fmean(a for a, _ in s.published) - s.got))
        worst = max(abs(v - limits[i]) for i, vs in got.items() for v in vs)
        cells = ", ".join(f"{limits[i]} → {min(vs):.1f}–{max(vs):.1f}" for i, vs in got.items())
        ok = worst <= SHARE_TOL and max(pub_err, default=0) <= PUBLISHED_TOL
        rows.append(
            f"| {name} ({len(limits)}) | {cells} | {worst:.2f} | {max(pub_err, default=0):.2f} "
            f"| {'yes' if ok else 'NO'} |"
        )
        print(rows[-1], flush=True)
    text = (
        "Containers sharing one fake GPU, one burning process each (10 ms kernels, 4 in flight), "
        f"limits per mix; {args.runs} runs of {args.seconds:.0f} s after a 2 s warm-up; "
        "% of the device over the run, read off the device timeline. Published: the container's "
        "mean achieved % vs its share of the device over the run. Mixes of 90 % leave room to "
        "catch up after a descheduled process; full mixes leave none (a stalled process's share "
        "idles the device). Targets: each within "
        f"±{SHARE_TOL:.0f} points of its limit, published within {PUBLISHED_TOL:.0f} point.\n\n"
        "| mix | limit → got (min–max over runs) | worst share error (points) "
        "| worst published error (points) | within target |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n`python bench/libvgpu_sharing.py --runs 3` (the machine is shared: other work "
        "competes for its 2 cores while it runs)."
    )
    record_section("libvgpu sharing", text)


if __name__ == "__main__":
    main()
