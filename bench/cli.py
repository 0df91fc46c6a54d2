"""CLI start-up: wall and CPU time of `tessera --help` and `tessera get pods` (issue 16 targets:
under 0.15 s and 0.3 s wall on the 2-core development machine).

`get pods` asks a real kube-sim (started here alone, no webhook, holding --pods pods), through
the console script the project installs, so what is timed is what a user waits for. Each
command runs --runs times; min is the figure on a quiet moment of a shared machine, median and
CPU (user+sys of the child) show the load.

    .venv/bin/python bench/cli.py [--runs 15] [--pods 40] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import record_section

from tessera_cli.nats_embedded import free_port

TARGETS = {"tessera --help": 0.15, "tessera get pods": 0.30}


def tessera_binary() -> str:
    here = Path(sys.executable).with_name("tessera")
    return str(here) if here.exists() else shutil.which("tessera") or "tessera"


def timed(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(args, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {result.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def start_kube_sim(root: Path, pods: int) -> tuple[subprocess.Popen[bytes], Path]:
    port = free_port()
    env = {**os.environ, "TESSERA_KUBE_SIM_LISTEN": f"127.0.0.1:{port}",
           "TESSERA_KUBE_SIM_KUBECONFIG": str(root / "kubeconfig"),
           "TESSERA_KUBE_SIM_NODES": "[]", "TESSERA_KUBE_SIM_WEBHOOK_URL": "",
           "TESSERA_KUBE_SIM_EXTENDER_URL": "", "TESSERA_KUBE_SIM_KUBELET_ROOT": str(root / "kl")}
    proc = subprocess.Popen([sys.executable, "-m", "tessera.kube_sim"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1):
                if (root / "kubeconfig").is_file():
                    break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("kube-sim did not start") from None
            time.sleep(0.1)
    for i in range(pods):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"bench-{i}"},
               "spec": {"containers": [{"name": "main", "image": "cuda"}]}}
        request = urllib.request.Request(f"{url}/api/v1/namespaces/default/pods",
                                         data=json.dumps(pod).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
    return proc, root / "kubeconfig"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--pods", type=int, default=40)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--binary", help="another `tessera` to time (an older checkout's venv)")
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tessera-bench-cli-"))
    load_before = os.getloadavg()
    proc, kubeconfig = start_kube_sim(root, options.pods)
    binary = options.binary or tessera_binary()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "NATS_"))}
    # As on a user's machine: Python caches compiled modules (this sandbox sets
    # PYTHONDONTWRITEBYTECODE, which would time a compile of every module on every call).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")  # written here, not into any checkout
    commands = {
        "tessera --help": [binary, "--help"],
        "tessera get pods": [binary, "get", "pods", "--kubeconfig", str(kubeconfig)],
    }
    rows = []
    try:
        for name, args in commands.items():
            timed(args, env)  # warm the file cache
            samples = [timed(args, env) for _ in range(options.runs)]
            walls = sorted(w for w, _ in samples)
            cpus = sorted(c for _, c in samples)
            rows.append((name, min(walls), statistics.median(walls), walls[-1],
                         statistics.median(cpus), TARGETS[name]))
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    lines = [
        f"Console script `{Path(binary).name}` run {options.runs} times per command after one "
        f"warm-up (bytecode cached, as Python does by default); `get pods` lists "
        f"{options.pods} pods from a real kube-sim on loopback. Wall "
        "seconds (min = a quiet moment of the shared machine) and CPU seconds (user+sys, median)."
        " Commands are imported when they run; `get` uses the standard library's HTTP client "
        "and no pydantic/rich/httpx (tests/cli/test_startup.py checks the imports).",
        "",
        "| command | wall min | wall median | wall max | CPU median | target (wall) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, low, mid, high, cpu, target in rows:
        lines.append(f"| `{name}` | {low:.3f} | {mid:.3f} | {high:.3f} | {cpu:.3f} | "
                     f"< {target:.2f} |")
    lines += ["", f"Load average (1/5/15 min) before: "
              f"{' / '.join(f'{x:.2f}' for x in load_before)}; after: "
              f"{' / '.join(f'{x:.2f}' for x in load_after)} (`bench/cli.py --runs "
              f"{options.runs} --pods {options.pods}`)."]
    text = "\n".join(lines)
    print(text)
    if not options.no_record:
        record_section("cli", text)


if __name__ == "__main__":
    main()
