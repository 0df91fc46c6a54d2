"""40 pods onto one node through the whole local stack (issue 35): time from the first create
until every pod is Running, with kube-sim's kubelet admitting each pod 0.5 s after it appears.

Everything is real and local, as `tessera up` runs it: NATS, kube-sim (API server, kube-scheduler
calling the extender over mutual TLS, one kubelet per node speaking device-plugin gRPC to the
node agent), the admission webhook, the scheduler, quota, metrics and the node agent. Two ways
of creating the burst, each timed from its first create request:

- `concurrent`: 40 POSTs at once (a controller creating a ReplicaSet's pods: 16 client threads);
- `apply`: `tessera apply -f` of one file holding the 40 pods (a person at the terminal; the
  CLI posts them one after the other, as `kubectl apply` does).

Pods ask for 1 GPU with gpumem (`BENCH_SHAPES` amounts in turn, default 1: a Deployment's pods;
4: four amounts, so a crossed seal would show) on a node of 4 A10s (24 GiB, split 10: the 40
replicas are the node's whole capacity). After each round every pod's grant, env and sealed
limits are checked against its own request (a crossed seal fails the run), the pods are deleted
and the ledger drained before the next round.

    python bench/one_node_burst.py                     # this tree, BENCH_ROUNDS (3) of each mode
    BENCH_BASE=main python bench/one_node_burst.py     # side by side: that commit's code too

With `BENCH_BASE=<commit>` the commit's tree is exported (`git archive`) to a scratch folder
and run through a `PYTHONPATH` overlay (its `tessera` package with each service mapped in as
the editable install maps them) in the same venv; the two codes alternate round by round, so
both see the same load. Each row records the 1-minute load average before and after the run.
`BENCH_PROFILE=dir`: every service runs under cProfile (CPU clock) and dumps its stats there.
`BENCH_NO_RECORD=1` prints without writing bench/RESULTS.md. Never run by the tests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

PODS = int(os.environ.get("BENCH_PODS", "40"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
DELAY_S = float(os.environ.get("BENCH_KUBELET_DELAY_S", "0.5"))
SHAPES = int(os.environ.get("BENCH_SHAPES", "1"))
MODES = [m for m in os.environ.get("BENCH_MODES", "concurrent,apply").split(",") if m]
GPUS, GPU_MIB, SPLIT = 4, 24576, 10
TARGET_S = 3.0
NODE = "burst-0"
SERVICE_PACKAGES = {  # tessera.<name> -> services/<folder>, as pyproject's package-dir maps them
    "admission": "admission", "scheduler": "scheduler", "quota": "quota",
    "node_agent": "node-agent", "metrics": "metrics", "kube_sim": "kube-sim",
}


def request_mib(i: int) -> int:
    return 2000 + (i % SHAPES) * 100


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def burst_pods(run: str) -> list[dict[str, Any]]:
    return [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{run}-{i}", "labels": {"burst": run}},
        "spec": {"containers": [{"name": "main", "image": "cuda:12", "resources": {"limits": {
            "nvidia.com/gpu": 1, "nvidia.com/gpumem": request_mib(i)}}}]},
    } for i in range(PODS)]  # fmt: skip


# --- one stack, several rounds (the child process: this tree's or the overlay's code) ---------


def child() -> None:
    import httpx

    from tessera_cli.stack import LocalStack, SimNode, StackPorts, default_services

    state = Path(tempfile.mkdtemp(prefix="tessera-burst-"))
    ports = StackPorts.free()
    node = SimNode(name=NODE, gpus=GPUS, gpu_memory_mib=GPU_MIB, gpu_model="NVIDIA A10")
    env = {"TESSERA_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
           "TESSERA_DEVICE_SPLIT_COUNT": str(SPLIT)}
    stack = LocalStack(state, default_services([node], state, ports, kubelet_delay_s=DELAY_S),
                       ports=ports, extra_env=env)  # fmt: skip
    kube = httpx.Client(base_url=stack.api_url, timeout=30.0)
    out: list[dict[str, Any]] = []
    try:
        stack.start()
        stack.wait_ready(120)
        wait_registered(kube)
        if os.environ.get("BENCH_TRACE"):  # what the stack burns idle, per second
            idle = cpu_by_service(stack)
            time.sleep(5)
            rates = {k: round((v - idle.get(k, 0.0)) / 5, 3)
                     for k, v in cpu_by_service(stack).items()}
            print(f"TRACE idle CPU s/s {rates}", file=sys.stderr, flush=True)
        for n in range(int(os.environ["BENCH_CHILD_ROUNDS"])):
            for mode in MODES:
                out.append(one_round(stack, kube, state, mode, f"b{n}{mode[:2]}"))
    finally:
        kube.close()
        stack.stop()
        if os.environ.get("BENCH_KEEP"):  # the stack's logs, for a look afterwards
            print(f"kept {state}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(state, ignore_errors=True)
    print("RESULT " + json.dumps(out), flush=True)


def wait_registered(kube: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in kube.get("/api/v1/nodes").json()["items"]:
            count = (node["status"].get("allocatable") or {}).get("nvidia.com/gpu", "0")
            if node["metadata"]["name"] == NODE and int(count) >= GPUS * SPLIT:
                return
        time.sleep(0.2)
    raise RuntimeError("the node agent did not register its GPUs")


def cpu_by_service(stack: Any) -> dict[str, float]:
    """CPU seconds (user + system) each service's process has used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for running in stack.running:
        try:
            fields = Path(f"/proc/{running.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[running.spec.name.split("/")[0]] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def one_round(stack: Any, kube: Any, state: Path, mode: str, run: str) -> dict[str, Any]:
    pods = burst_pods(run)
    before = load()
    cpu_before = cpu_by_service(stack)
    if os.environ.get("BENCH_PROFILE"):  # each service's profiler starts now (PROFILER)
        for running in stack.running:
            os.kill(running.proc.pid, signal.SIGUSR1)
    watch = Watch(stack.api_url, run)
    watch.started = time.monotonic()
    if mode == "concurrent":
        def create(pod: dict[str, Any]) -> None:
            reply = kube.post("/api/v1/namespaces/default/pods", json=pod)
            if reply.status_code != 201:
                raise RuntimeError(f"create refused: {reply.status_code} {reply.text}")

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            creating = [pool.submit(create, p) for p in pods]
            elapsed = watch.wait()
            for f in creating:
                f.result()
    else:
        manifest = state / f"{run}.yaml"
        manifest.write_text("\n---\n".join(json.dumps(p) for p in pods) + "\n")
        cli = subprocess.Popen(
            [sys.executable, "-m", "tessera_cli", "apply", "-f", str(manifest)],
            env={**os.environ, "TESSERA_STATE_DIR": str(state)},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        elapsed = watch.wait()
        if cli.wait(60) != 0:
            raise RuntimeError(f"tessera apply failed: {cli.stderr.read().decode()}")
    cpu = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in cpu_by_service(stack).items()}
    if os.environ.get("BENCH_TRACE"):  # each thread's CPU so far, for the busiest processes
        ticks = os.sysconf("SC_CLK_TCK")
        for running in stack.running:
            if running.spec.name.split("/")[0] not in ("node-agent", "kube-sim"):
                continue
            threads = []
            for task in Path(f"/proc/{running.proc.pid}/task").iterdir():
                text = (task / "stat").read_text()
                name = text[text.index("(") + 1:text.rindex(")")]
                fields = text.rsplit(")", 1)[1].split()
                threads.append((round((int(fields[11]) + int(fields[12])) / ticks, 2), name))
            print(f"TRACE threads {running.spec.name}: {sorted(threads, reverse=True)[:8]}",
                  file=sys.stderr, flush=True)
    crossed = check_limits(kube, run)
    drain(stack, kube, run)
    # the measure: from the first create (the first pod the watch saw created: its
    # create had returned) until every pod is Running; `seconds` counts from before the first
    # request (for `apply`, from the CLI's start: a Python process starting at this load)
    from_create = elapsed - min(v[0] for v in watch.seen.values())
    return {"mode": mode, "seconds": round(elapsed, 3), "from_create_s": round(from_create, 3),
            "load_before": before,
            "load_after": load(), "crossed": crossed, "cpu_s": cpu}  # fmt: skip


class Watch:
    """The burst's pods through one watch (as `kubectl get -w` follows them: polling lists
    would load the API server the kubelet runs in): when each was created, bound, Running."""

    def __init__(self, api_url: str, run: str) -> None:
        import httpx

        self.run = run
        self.seen: dict[str, list[float]] = {}
        self.done = threading.Event()
        self.started = time.monotonic()
        self.client = httpx.Client(base_url=api_url, timeout=None)
        listing = self.client.get("/api/v1/namespaces/default/pods",
                                  params={"labelSelector": f"burst={run}"}).json()  # fmt: skip
        self.version = listing["metadata"]["resourceVersion"]
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        params = {"watch": "1", "labelSelector": f"burst={self.run}",
                  "resourceVersion": self.version}  # fmt: skip
        with self.client.stream("GET", "/api/v1/namespaces/default/pods", params=params) as r:
            for line in r.iter_lines():
                if not line.strip():
                    continue
                pod = json.loads(line)["object"]
                now = time.monotonic() - self.started
                stages = self.seen.setdefault(pod["metadata"]["name"], [now])
                if len(stages) == 1 and pod["spec"].get("nodeName"):
                    stages.append(now)
                if len(stages) == 2 and pod["status"].get("phase") == "Running":
                    stages.append(now)
                if len(self.seen) == PODS and all(len(v) == 3 for v in self.seen.values()):
                    self.done.set()
                    return

    def wait(self, timeout_s: float = 120.0) -> float:
        """Seconds from `started` until the last pod was seen Running."""
        if not self.done.wait(timeout_s):
            raise RuntimeError(f"{self.run}: not every pod Running within {timeout_s:.0f} s")
        self.client.close()
        if os.environ.get("BENCH_TRACE"):
            for stage, label in enumerate(("created", "bound", "running")):
                times = sorted(v[stage] for v in self.seen.values())
                print(f"TRACE {self.run} {label}: first {times[0]:.2f} median "
                      f"{statistics.median(times):.2f} last {times[-1]:.2f}",
                      file=sys.stderr, flush=True)  # fmt: skip
        return max(v[2] for v in self.seen.values())


def check_limits(kube: Any, run: str) -> list[str]:
    """Pods whose grant, env or sealed limits are not their own request (should be none)."""
    from tessera.hami import ANN_DEVICES_ALLOCATED, ANN_DEVICES_TO_ALLOCATE, decode_pod_devices
    from tessera.region import read_limits

    admitted = {a["uid"]: a for a in kube.get(f"/kube-sim/v1/nodes/{NODE}/containers").json()}
    wrong = []
    items = kube.get("/api/v1/namespaces/default/pods",
                     params={"labelSelector": f"burst={run}"}).json()["items"]  # fmt: skip
    for pod in items:
        name = pod["metadata"]["name"]
        want = request_mib(int(name.rsplit("-", 1)[1]))
        notes = pod["metadata"].get("annotations") or {}
        text = notes.get(ANN_DEVICES_ALLOCATED) or notes.get(ANN_DEVICES_TO_ALLOCATE) or ""
        [[grant]] = decode_pod_devices(text)
        [main] = admitted[pod["metadata"]["uid"]]["containers"]
        mount = next(m for m in main["mounts"] if m["container_path"] == "/run/tessera/limits")
        limits = read_limits(mount["host_path"])
        sealed = [(d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices] if limits else []
        if (grant.memory_mib != want or main["envs"].get("NVIDIA_VISIBLE_DEVICES") != grant.uuid
                or sealed != [(grant.uuid, want)]):
            wrong.append(f"{name}: wants {want} MiB, granted {grant.memory_mib} on {grant.uuid}, "
                         f"sealed {sealed}")  # fmt: skip
    return wrong


def drain(stack: Any, kube: Any, run: str, timeout_s: float = 60.0) -> None:
    for i in range(PODS):
        kube.delete(f"/api/v1/namespaces/default/pods/{run}-{i}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        items = kube.get("/api/v1/namespaces/default/pods",
                         params={"labelSelector": f"burst={run}"}).json()["items"]  # fmt: skip
        if not items and not ledger_allocations(stack):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{run}: pods not gone within {timeout_s:.0f} s")


def ledger_allocations(stack: Any) -> int:
    """How many allocations the node's ledger entry still holds."""
    import asyncio

    from tessera.bus import LEDGER_BUCKET, connect
    from tessera.codec import decode
    from tessera.models import NodeLedger

    async def read() -> int:
        nc = await connect(stack.nats_settings(), name="bench-burst")
        try:
            kv = await nc.jetstream().key_value(LEDGER_BUCKET)
            entry = await kv.get(NODE)
            return len(decode(entry.value, NodeLedger).allocations) if entry.value else 0
        finally:
            await nc.close()

    return asyncio.run(read())


# --- the parent: alternate this tree and the base, record ------------------------------------


def overlay(commit: str) -> Path:
    """`commit`'s tree exported, and a package folder mapping it as the editable install maps
    this tree (PYTHONPATH puts it before the install's finder)."""
    base = Path(tempfile.mkdtemp(prefix="tessera-burst-base-"))
    tree = base / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pkg = base / "pkg" / "tessera"
    pkg.mkdir(parents=True)
    for entry in (tree / "tessera").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in SERVICE_PACKAGES.items():
        (pkg / name).symlink_to(tree / "services" / folder)
    generated = ROOT / "tessera" / "kubeapi" / "generated"  # gRPC stubs: same protos
    if generated.is_dir() and not (tree / "tessera" / "kubeapi" / "generated").exists():
        shutil.copytree(generated, tree / "tessera" / "kubeapi" / "generated")
    (base / "pkg" / "tessera_cli").symlink_to(tree / "tessera_cli")
    return base


PROFILER = """
import atexit, cProfile, os, signal, sys, time
_out = os.environ.get("BENCH_PROFILE")
if _out and "-m" in sys.orig_argv:
    _name = sys.orig_argv[sys.orig_argv.index("-m") + 1] + "." + str(os.getpid())
    _profile = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: _profile.enable())  # the bench: a round starts
    def _dump():
        _profile.disable()
        _profile.dump_stats(os.path.join(_out, _name))
    atexit.register(_dump)
"""

def run_child(code: str, pythonpath: str | None, rounds: int) -> list[dict[str, Any]]:
    env = {**os.environ, "BENCH_CHILD": "1", "BENCH_CHILD_ROUNDS": str(rounds)}
    paths = [pythonpath] if pythonpath else []
    if os.environ.get("BENCH_PROFILE"):  # every service under cProfile (a sitecustomize)
        hook = Path(tempfile.mkdtemp(prefix="tessera-burst-profile-"))
        (hook / "sitecustomize.py").write_text(PROFILER)
        Path(os.environ["BENCH_PROFILE"]).mkdir(parents=True, exist_ok=True)
        paths.append(str(hook))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    # From a folder holding no `tessera`: from the repository's root, `python -m` (every
    # service) put the root first on sys.path and imported this tree's `tessera`, whose
    # services the editable install maps in, whatever PYTHONPATH said (the base's rounds ran
    # this tree's code).
    neutral = tempfile.mkdtemp(prefix="tessera-burst-cwd-")
    try:
        proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                              text=True, timeout=900, cwd=neutral)  # fmt: skip
    finally:
        shutil.rmtree(neutral, ignore_errors=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    for line in proc.stderr.splitlines():
        if line.startswith(("TRACE", "kept")):
            print(line, flush=True)
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{code}: the run failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = json.loads(lines[-1].removeprefix("RESULT "))
    for row in rows:
        row["code"] = code
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    if os.environ.get("BENCH_CHILD"):
        child()
        return
    base = os.environ.get("BENCH_BASE", "")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    rows: list[dict[str, Any]] = []
    base_dir = overlay(base) if base else None
    try:
        for _ in range(ROUNDS):
            if base_dir is not None:
                rows += run_child(f"base {base}", str(base_dir / "pkg"), 1)
            rows += run_child(f"this tree ({head})", None, 1)
    finally:
        if base_dir is not None:
            shutil.rmtree(base_dir, ignore_errors=True)
    report(rows, head, base)


def report(rows: list[dict[str, Any]], head: str, base: str) -> None:
    lines = [
        f"{PODS} pods (1 GPU, {'one amount' if SHAPES == 1 else f'{SHAPES} amounts in turn'}) "
        f"onto one node of {GPUS} GPUs (split {SPLIT}), kubelet delay {DELAY_S} s, the whole "
        "local stack; seconds until every pod is Running, counted from before the first request "
        "(`apply`: from the CLI's start, a Python process starting at this load) and from the "
        "first create (the first pod the watch saw created: the issue's measure; target "
        f"≤ {TARGET_S:.0f} s). Rounds alternate the codes; load = 1-minute average "
        "before → after; CPU = what the services' processes used during the round (user + "
        "system), the steadier figure on a shared machine.",
        "",
        "| code | mode | runs (s) | median s | from the first create: runs (s) | median s | load "
        "| stack CPU s (median) | of which kube-sim / node agent / scheduler | crossed limits |",
        "|---|---|---|---:|---|---:|---|---:|---|---:|",
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["code"], row["mode"]), []).append(row)
    for (code, mode), group in groups.items():
        runs = ", ".join(f"{r['seconds']:.2f}" for r in group)
        loads = ", ".join(f"{r['load_before']:.1f}→{r['load_after']:.1f}" for r in group)
        median = statistics.median(r["seconds"] for r in group)
        created = [r.get("from_create_s", r["seconds"]) for r in group]
        from_create = ", ".join(f"{c:.2f}" for c in created)
        crossed = sum(len(r["crossed"]) for r in group)
        cpu = statistics.median(sum(r["cpu_s"].values()) for r in group)
        parts = " / ".join(f"{statistics.median(r['cpu_s'].get(k, 0.0) for r in group):.2f}"
                           for k in ("kube-sim", "node-agent", "scheduler"))  # fmt: skip
        lines.append(f"| {code} | {mode} | {runs} | {median:.2f} | {from_create} | "
                     f"{statistics.median(created):.2f} | {loads} | {cpu:.2f} | {parts} "
                     f"| {crossed} |")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    for row in rows:
        for wrong in row["crossed"]:
            print("CROSSED:", row["code"], wrong)
    if not os.environ.get("BENCH_NO_RECORD"):
        from record import record_section

        record_section("one-node burst", text)


if __name__ == "__main__":
    main()
