"""Scheduler at scale (issue 14, Scale): pods/s end to end, restart to ready and RSS at 5,000 to
20,000 nodes × 8 GPUs, and the placement decision's p99 at 5,000 nodes.

The end-to-end run is `bench/scheduler.py`'s (filter, then bind, 32 pods in flight, the real NATS
ledger, a fake agent releasing each claim as Allocate does), called as kube-scheduler calls the
extender (`kube_lists.py`): `BENCH_LISTS=window` (default: its rotating percentageOfNodesToScore
window), `full` (a fresh full list per call) or `same` (the identical full list every call: the
best case, labelled so), with `BENCH_UNSCHEDULABLE` (0.1) of the pods fitting no node, retried
with kube-scheduler's backoff (1 s doubling to 10 s). Around it:

- start to ready: the scheduler process spawned against the populated KV until /readyz answers
  200 (imports, syncing the nodes and ledger buckets, the rebuild from pods);
- restart to ready: after the run the scheduler is terminated and started again over the ledger
  the run wrote; spawn to /readyz 200 (polled every 20 ms);
- RSS: the scheduler's VmRSS once ready and after the run (VmHWM: the peak).

    python bench/scheduler_scale.py                       # 5,000 and 20,000 nodes, recorded
    BENCH_SIZES=5000 BENCH_REPEAT=3 python bench/scheduler_scale.py   # medians of 3

`BENCH_NO_RECORD=1` prints without writing bench/RESULTS.md. `BENCH_DECISION_ONLY=1` only measures
the placement decision at 5,000 nodes (`fit_p99`, BENCH_REPEAT runs of each trace; printed).
`BENCH_RESTART_ONLY=1` only spawns
the scheduler BENCH_REPEAT times over one populated KV (restart to ready, its CPU, RSS; printed).
With `BENCH_RESTART_PODS=1` the cluster it restarts in also lists the bound GPU pod behind every
allocation of that KV (80,000 at 5,000 nodes, HAMi's annotations, as the API server would
answer), so the rebuild from pods before ready reads them as in a real restart (through the
slim listing, `tessera.cluster.slim_pods`, as the Kubernetes adapter reads a page;
`BENCH_PODS_SLIM=0`: the whole file decoded with `json.load`, as before it); without it the
bench's cluster lists no pod. `BENCH_RESTART_WATCH=1` (with it): the scheduler's pod watch also
lists them (decoded in full and replayed as ADDED events, as the Kubernetes adapter's watch
starts; the bench's watch otherwise lists nothing): what a real restart pays besides.
`BENCH_JSON=path` also writes the raw figures. The "before" columns come from
`scheduler_scale_before.json` (the same script run on the code before the Scale work; its commit
and load are recorded in it).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import record_section
from scheduler import SERVER as BENCH_SERVER
from scheduler import (
    LeanClient,
    build_cluster,
    cpu_seconds,
    drive,
    fake_agent,
    free_port,
    trace,
    unfit_pods,
    with_backlog,
)

from tessera.bus import connect, ensure_bus
from tessera.codec import encode
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats

SIZES = tuple(int(s) for s in os.environ.get("BENCH_SIZES", "5000,20000").split(",") if s)
REPEAT = int(os.environ.get("BENCH_REPEAT", "1"))
PODS = int(os.environ.get("BENCH_PODS", "1000"))
# kube-scheduler's candidate lists (bench/kube_lists.py): `window` (default, its rotating
# percentageOfNodesToScore window), `full` (a fresh full list per call), `same` (the identical
# full list every call: the best case, labelled as such).
LISTS = os.environ.get("BENCH_LISTS", "window")
# Unschedulable pods: this share of the pods no node takes, retried with kube-scheduler's backoff.
UNSCHEDULABLE = float(os.environ.get("BENCH_UNSCHEDULABLE", "0.1"))
BEFORE = Path(__file__).with_name("scheduler_scale_before.json")
TARGETS = {"pods_per_s": {5000: 300, 20000: 200}, "ready_s": {5000: 2.0},
           "rss_mib": {5000: 250}, "fit_p99_ms": {5000: 1.0}}  # fmt: skip


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


# The scheduler as `python -m tessera.scheduler` runs it: the extender listens at once (/readyz
# answers 503 until ready), the GC and BLAS threads are handled as its `main` (off before the
# service is imported) and `freeze_when_ready` handle them. `# BENCH_CLUSTER` becomes
# bench/scheduler.py's BenchCluster (the API server stand-in) as text: the spawned scheduler
# imports no bench module (whose own imports were part of every measured start).
SERVER = """
import gc
gc.disable()
import asyncio, sys
from tessera.scheduler.__main__ import freeze_when_ready, one_blas_thread
one_blas_thread()
from tessera.bus import connect, ensure_bus
from tessera.scheduler.config import SchedulerSettings
from tessera.scheduler.runtime import SchedulerService
from tessera.settings import NatsSettings, TesseraSettings
# BENCH_CLUSTER

async def main(url, port):
    settings = TesseraSettings(quota_enabled=False, node_ttl_s=36000, reservation_ttl_s=60)
    nc = await connect(NatsSettings(NATS_URL=url), name="bench-scheduler")
    js = nc.jetstream()
    buckets = await ensure_bus(js, settings)
    # The stand-in cluster lists no pod unless BENCH_PODS_FILE names them: only then is the
    # release of allocations whose pods it does not list meaningful (and its cost measured).
    config = SchedulerSettings(reconcile_interval_s=36000, sweep_interval_s=1.0,
                               release_missing_pods=bool(_os.environ.get("BENCH_PODS_FILE")))
    service = SchedulerService(settings, config, nc, js, buckets, BenchCluster(), instance="bench")
    await service.start()
    freezer = asyncio.create_task(freeze_when_ready(service))
    await service.serve_http("127.0.0.1", port)

import uvloop
asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

# BENCH_PROFILE=prefix: the scheduler processes run under cProfile (the first from SIGUSR1, sent
# after the warm-up, the restarted one from its start), the stats written to <prefix>.<pid> when
# terminated. For finding hot spots, not for figures.
PROFILED = """
import cProfile, os, signal, sys, time
# BENCH_PROFILE_CLOCK=cpu: this thread's CPU time, not the wall clock (on a loaded machine a
# socket write that wakes the peer is charged the peer's run time by the wall clock).
_profile = (cProfile.Profile(time.thread_time) if os.environ.get("BENCH_PROFILE_CLOCK") == "cpu"
            else cProfile.Profile())
def _dump(*_):
    _profile.disable()
    _profile.dump_stats(os.environ["BENCH_PROFILE"] + "." + str(os.getpid()))
    os._exit(0)
signal.signal(signal.SIGTERM, _dump)
signal.signal(signal.SIGUSR1, lambda *_: _profile.enable())
if os.environ.get("BENCH_PROFILE_START") == "1":
    _profile.enable()
"""


# `BENCH_PODS_FILE` (BENCH_RESTART_PODS=1): the spawned scheduler's cluster lists these pods (JSON,
# parsed in the scheduler as the real cluster client parses the API server's answer).
LISTED_PODS = """
import os as _os
if _os.environ.get("BENCH_PODS_FILE"):
    class BenchCluster(BenchCluster):
        async def list_pods(self, namespace=None, node_name=None):
            import json
            with open(_os.environ["BENCH_PODS_FILE"], "rb") as listed:
                return json.load(listed)
        if _os.environ.get("BENCH_PODS_SLIM", "1") == "1":  # 0: the rebuild lists in full
            async def list_pods_slim(self, need=None):  # as the real client reads a page
                from tessera.cluster.slim_pods import Listed, SlimReader, decode_pods
                with open(_os.environ["BENCH_PODS_FILE"], "rb") as listed:
                    reader = SlimReader(need)
                    return Listed(reader.take(decode_pods(listed.read())), reader.skipped)
        if _os.environ.get("BENCH_RESTART_WATCH") == "1":  # the pod watch lists them too
            async def watch_pods_marked(self, namespace=None, node_name=None):
                import asyncio, json
                from tessera.cluster.port import WatchEvent
                def read():
                    with open(_os.environ["BENCH_PODS_FILE"], "rb") as listed:
                        return json.load(listed)
                for item in await asyncio.to_thread(read):  # as the adapter's list replays
                    item.setdefault("kind", "Pod")
                    item.setdefault("apiVersion", "v1")
                    yield WatchEvent(type="ADDED", object=item)
                yield None  # the listing is replayed (the adapter's mark)
                await asyncio.Event().wait()

            async def watch_pods(self, namespace=None, node_name=None):
                async for event in self.watch_pods_marked(namespace, node_name):
                    if event is not None:
                        yield event
"""


def bound_pods(ledgers: list[Any]) -> list[dict[str, Any]]:
    """The bound, running pod behind every allocation of `ledgers`, with HAMi's annotations."""
    from tessera import hami

    pods = []
    for ledger in ledgers:
        for a in ledger.allocations.values():
            annotations = {hami.ANN_DEVICES_TO_ALLOCATE: hami.encode_pod_devices(a.containers),
                           hami.ANN_VGPU_NODE: a.node, hami.ANN_BIND_PHASE: "success"}  # fmt: skip
            pods.append({
                "metadata": {"uid": a.pod_uid, "name": a.name, "namespace": a.namespace,
                             "annotations": annotations},
                "spec": {"nodeName": a.node,
                         "containers": [{"name": f"c{i}"} for i in range(len(a.containers))]},
                "status": {"phase": "Running"},
            })  # fmt: skip
    return pods


async def ready_after_spawn(url: str, port: int, env: dict[str, str]) -> tuple[Any, float]:
    """Spawn a scheduler; seconds until its /readyz answers 200."""
    started = time.perf_counter()
    cluster = BENCH_SERVER.split("async def main")[0] + LISTED_PODS
    server = SERVER.replace("# BENCH_CLUSTER\n", cluster)
    code = (PROFILED + server) if os.environ.get("BENCH_PROFILE") else server
    paths = [str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.Popen([sys.executable, "-c", code, url, str(port)], env=env)
    request = b"GET /readyz HTTP/1.1\r\nHost: scheduler\r\nConnection: close\r\n\r\n"
    while time.perf_counter() - started < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"scheduler exited with {proc.returncode}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return proc, time.perf_counter() - started
        except OSError:
            pass
        await asyncio.sleep(0.02)
    proc.kill()
    raise RuntimeError("scheduler did not become ready")


async def populate(url: str, registrations: list[Any], ledgers: list[Any]) -> Any:
    """bench/scheduler.py's populate, with patience for a loaded machine (acks may be slow)."""
    nc = await connect(NatsSettings(NATS_URL=url), name="bench-client")
    buckets = await ensure_bus(nc.jetstream(timeout=120), TesseraSettings(node_ttl_s=36000))
    for start in range(0, len(registrations), 100):
        chunk = range(start, min(start + 100, len(registrations)))
        await asyncio.gather(*(buckets.nodes.put(registrations[i].node, encode(registrations[i]))
                               for i in chunk))  # fmt: skip
        await asyncio.gather(*(buckets.ledger.put(ledgers[i].node, encode(ledgers[i]))
                               for i in chunk))  # fmt: skip
    return nc, buckets


async def one_run(nodes: int) -> dict[str, Any]:
    server = EmbeddedNats(data_dir=tempfile.mkdtemp(prefix="tessera-bench-scale-"))
    server.start()
    registrations, ledgers = build_cluster(nodes)
    nc, buckets = await populate(server.url, registrations, ledgers)
    del ledgers
    env = {**os.environ, "TESSERA_LOG_LEVEL": "WARNING"}
    names = [r.node for r in registrations]
    stop = asyncio.Event()
    agent = asyncio.create_task(fake_agent(nc, buckets, stop))
    procs: list[Any] = []
    clients: list[LeanClient] = []
    result: dict[str, Any] = {"nodes": nodes, "load_before": loadavg()}
    try:
        port = free_port()
        proc, result["start_s"] = await ready_after_spawn(server.url, port, env)
        result["start_cpu_s"] = cpu_seconds(proc.pid)
        procs.append(proc)
        result["rss_ready_mib"] = memory_mib(proc.pid)[0]
        client = LeanClient(port)
        clients.append(client)
        rng = random.Random(5)
        await drive([client], trace(20, seed=99), names, rng)  # warm-up: pools, caches
        if os.environ.get("BENCH_PROFILE"):
            proc.send_signal(signal.SIGUSR1)
            env = {**env, "BENCH_PROFILE_START": "1"}
        before = cpu_seconds(proc.pid)
        nats_pid = server._proc.pid  # type: ignore[union-attr]  # bench-only peek
        nats_before, client_before = cpu_seconds(nats_pid), time.process_time()
        unfit = unfit_pods(round(PODS * UNSCHEDULABLE / (1 - UNSCHEDULABLE)))
        result.update(await drive([client], trace(PODS, seed=3), names, rng, LISTS, unfit))
        result["scheduler_cpu_ms_per_pod"] = (cpu_seconds(proc.pid) - before) * 1000 / PODS
        # nats-server, and this process (kube-scheduler's stand-in and the fake agent)
        result["nats_cpu_ms_per_pod"] = (cpu_seconds(nats_pid) - nats_before) * 1000 / PODS
        result["client_cpu_ms_per_pod"] = (time.process_time() - client_before) * 1000 / PODS
        result["rss_mib"], result["hwm_mib"] = memory_mib(proc.pid)
        await client.close()
        proc.terminate()
        proc.wait(10)
        procs.remove(proc)
        port = free_port()
        proc, result["ready_s"] = await ready_after_spawn(server.url, port, env)
        result["ready_cpu_s"] = cpu_seconds(proc.pid)
        procs.append(proc)
        result["rss_restarted_mib"] = memory_mib(proc.pid)[0]
        result["load_after"] = loadavg()
        return result
    finally:
        stop.set()
        agent.cancel()
        for client in clients:
            await client.close()
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        await nc.close()
        server.cleanup()


async def restarts(nodes: int) -> list[dict[str, float]]:
    """`BENCH_RESTART_ONLY=1`: the scheduler spawned BENCH_REPEAT times over one populated KV
    (no run in between): seconds and CPU seconds to ready, RSS once ready, the load average."""
    server = EmbeddedNats(data_dir=tempfile.mkdtemp(prefix="tessera-bench-restart-"))
    server.start()
    registrations, ledgers = build_cluster(nodes)
    nc, _buckets = await populate(server.url, registrations, ledgers)
    env = {**os.environ, "TESSERA_LOG_LEVEL": "WARNING"}
    if os.environ.get("BENCH_PROFILE"):
        env["BENCH_PROFILE_START"] = "1"  # each spawned scheduler profiled from its start
    if os.environ.get("BENCH_RESTART_PODS") == "1":
        listed = Path(tempfile.mkdtemp(prefix="tessera-bench-pods-")) / "pods.json"
        listed.write_text(json.dumps(bound_pods(ledgers)))
        env["BENCH_PODS_FILE"] = str(listed)
    runs = []
    try:
        for _ in range(REPEAT):
            load = loadavg()
            proc, ready = await ready_after_spawn(server.url, free_port(), env)
            runs.append({"ready_s": ready, "ready_cpu_s": cpu_seconds(proc.pid),
                         "rss_ready_mib": memory_mib(proc.pid)[0], "load": load})  # fmt: skip
            proc.terminate()
            proc.wait(10)
            print(f"restart {nodes}: {json.dumps(runs[-1])}", flush=True)
    finally:
        await nc.close()
        server.cleanup()
        if "BENCH_PODS_FILE" in env:
            Path(env["BENCH_PODS_FILE"]).unlink(missing_ok=True)
            Path(env["BENCH_PODS_FILE"]).parent.rmdir()
    return runs


KEYS = ("pods_per_s", "p50_ms", "p99_ms", "scheduler_cpu_ms_per_pod", "start_s", "ready_s",
        "start_cpu_s", "ready_cpu_s",
        "rss_ready_mib", "rss_mib", "hwm_mib", "rss_restarted_mib")  # fmt: skip


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    out["runs"] = len(runs)
    out["each_pods_per_s"] = [round(r["pods_per_s"]) for r in runs]
    out["each_ready_s"] = [round(r["ready_s"], 2) for r in runs]
    out["bound"] = min(r["bound"] for r in runs)
    out["errors"] = max(r["refused"] + r["bind_errors"] for r in runs)
    out["load"] = (min(r["load_before"] for r in runs), max(r["load_after"] for r in runs))
    return out


def fit_p99(nodes: int) -> dict[str, Any]:
    """The placement decision's p50/p99 (what the filter does for one pod given the index:
    `scheduler.run_decisions`), by this thread's CPU time and the wall clock of the same calls
    (on a loaded machine the wall clock mostly measures waiting for a core; the CPU time does
    not). Two traces: bench/scheduler.py's (1-2 GPUs, binpack nodes, every node a candidate; the
    figure recorded before) and the varied one (1-8 GPUs, binpack and spread, label pools).
    Placed pods only; a refused pod's call explains every node (O(nodes)) and is counted apart."""
    import scheduler as bench

    load = loadavg()
    runs, varied_runs = [], []
    for _ in range(REPEAT):
        plain = [(pod, None) for pod in trace(2000)]
        varied = bench.decision_trace(2000)
        runs.append(bench.run_decisions(nodes, with_backlog(plain, UNSCHEDULABLE), lists=LISTS))
        varied_runs.append(bench.run_decisions(nodes, with_backlog(varied, UNSCHEDULABLE),
                                               lists=LISTS))  # fmt: skip

    def median(key: str, of: list[dict[str, Any]]) -> float:
        return statistics.median(r[key] for r in of)

    out: dict[str, Any] = {}
    for prefix, of in (("", runs), ("varied_", varied_runs)):
        for key in ("p50_ms", "p99_ms", "cpu_p50_ms", "cpu_p99_ms", "refused_cpu_p50_ms",
                    "refused_cpu_p99_ms", "parse_cpu_p50_ms", "parse_cpu_p99_ms"):
            out[prefix + key] = median(key, of)
        out[prefix + "refused"] = max(r["refused"] for r in of)
        out[prefix + "each_p99_ms"] = [round(r["p99_ms"], 3) for r in of]
        out[prefix + "each_cpu_p99_ms"] = [round(r["cpu_p99_ms"], 3) for r in of]
    out["load"] = (load, loadavg())
    out["lists"], out["unschedulable"] = LISTS, UNSCHEDULABLE
    return out


def verdict(value: float, target: float | None, higher_is_better: bool) -> str:
    if target is None:
        return ""
    ok = value >= target if higher_is_better else value <= target
    return f"{'meets' if ok else 'misses'} {'≥' if higher_is_better else '≤'} {target:g}"


def markdown(after: dict[str, Any], before: dict[str, Any]) -> str:
    rows = []
    what = (("pods/s end to end", "pods_per_s", "{:.0f}", True),
            ("filter + bind p50 ms", "p50_ms", "{:.1f}", None),
            ("filter + bind p99 ms", "p99_ms", "{:.1f}", None),
            ("scheduler CPU ms per pod", "scheduler_cpu_ms_per_pod", "{:.2f}", None),
            ("pods/s its CPU allows (1000 / CPU ms per pod)", "cpu_pods_per_s", "{:.0f}", True),
            ("first start to ready, s", "start_s", "{:.2f}", None),
            ("restart to ready, s", "ready_s", "{:.2f}", False),
            ("restart to ready, CPU seconds of the scheduler", "ready_cpu_s", "{:.2f}", False),
            ("RSS once ready, MiB", "rss_ready_mib", "{:.0f}", None),
            ("RSS after the run, MiB", "rss_mib", "{:.0f}", False),
            ("peak RSS (VmHWM), MiB", "hwm_mib", "{:.0f}", None))  # fmt: skip
    for nodes in sorted(after["e2e"], key=int):
        now, then = after["e2e"][nodes], before.get("e2e", {}).get(nodes)
        for figures in (now, then):
            if figures:  # what the scheduler's own CPU allows on one core of its own
                figures["cpu_pods_per_s"] = 1000 / figures["scheduler_cpu_ms_per_pod"]
        for label, key, fmt, higher in what:
            target_key = {"cpu_pods_per_s": "pods_per_s", "ready_cpu_s": "ready_s"}.get(key, key)
            target = TARGETS.get(target_key, {}).get(int(nodes))
            old = fmt.format(then[key]) if then and key in then else "—"
            judged = verdict(now[key], target, bool(higher)) if higher is not None else ""
            rows.append(f"| {int(nodes):,} × 8 | {label} | {old} | {fmt.format(now[key])} | "
                        f"{judged} |")  # fmt: skip
    fit_now, fit_then = after["fit"], before.get("fit") or {}
    for label, key in (("placement decision p50 ms, wall", "p50_ms"),
                       ("placement decision p99 ms, wall", "p99_ms"),
                       ("placement decision p50 ms, CPU", "cpu_p50_ms"),
                       ("placement decision p99 ms, CPU", "cpu_p99_ms"),
                       ("decision p50 ms, CPU, varied trace", "varied_cpu_p50_ms"),
                       ("decision p99 ms, CPU, varied trace", "varied_cpu_p99_ms"),
                       ("decision p99 ms, wall, varied trace", "varied_p99_ms")):  # fmt: skip
        if key not in fit_now:
            continue
        old = f"{fit_then[key]:.3f}" if key in fit_then else "—"
        target = verdict(fit_now[key], TARGETS["fit_p99_ms"][5000], False) if "p99" in key else ""
        rows.append(f"| 5,000 × 8 | {label} | {old} | {fit_now[key]:.3f} | {target} |")
    runs = "; ".join(
        f"{int(n):,}: {e['runs']} run(s), pods/s {e['each_pods_per_s']}, restart s "
        f"{e['each_ready_s']}, load {e['load'][0]:.1f}-{e['load'][1]:.1f}"
        for n, e in sorted(after["e2e"].items(), key=lambda kv: int(kv[0]))
    )
    return "\n".join([
        "Issue 14's Scale targets. N nodes × 8 GPUs (80 GiB, split 10, ~50 % used by 1-3 pods "
        f"each). **Candidate lists: `{LISTS}`** (`bench/kube_lists.py`: `window` = "
        "kube-scheduler's rotating adaptive percentageOfNodesToScore window, `full` = a fresh "
        "full list per call, `same` = the identical full list every call, the best case); "
        f"**{UNSCHEDULABLE:.0%} unschedulable pods** mixed in, retried with kube-scheduler's "
        "backoff (1 s doubling to 10 s). The end-to-end figures are `bench/scheduler.py`'s run "
        f"(filter, then bind, 32 in flight, {PODS} pods, real NATS ledger, a fake agent "
        "releasing each claim). Restart to ready: the scheduler terminated after the run and "
        "spawned again over the ledger it wrote, until /readyz answers 200. RSS: VmRSS of the "
        "scheduler process. Medians where several runs were made. The machine is 2 cores "
        "shared with other work (1-minute load average given): figures move by tens of "
        "percent with it.",
        "",
        f"Before: {before.get('note', 'not measured')}.",
        f"After: {after.get('note', '')}",
        "",
        "| nodes | figure | before | after | target |",
        "|---|---|---:|---:|---|",
        *rows,
        "",
        f"Runs (after): {runs}; decision p99 runs {after['fit']['each_p99_ms']} at load "
        f"{after['fit']['load'][0]:.1f}-{after['fit']['load'][1]:.1f}.",
        "",
        "`python bench/scheduler_scale.py` (`BENCH_SIZES`, `BENCH_REPEAT`, `BENCH_PODS`).",
    ])  # fmt: skip


def compile_bytecode() -> None:
    """Compile the scheduler's modules to bytecode first, as installing the wheel does (pip
    compiles what it installs). In a development checkout with PYTHONDONTWRITEBYTECODE=1 (this
    machine's environment) no .pyc is ever written, so every spawn compiled ~70 modules from
    source: ~0.2 s of each start that a real deployment never pays."""
    import compileall

    import tessera.scheduler

    for package in (tessera, tessera.scheduler):
        compileall.compile_dir(Path(package.__file__).parent, quiet=1)
    compileall.compile_dir(Path(__file__).parent, maxlevels=0, quiet=1)


def main() -> None:
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if os.environ.get("BENCH_NO_COMPILE") != "1":  # (1: another checkout's code, left as it is)
        compile_bytecode()
    if os.environ.get("BENCH_RESTART_ONLY") == "1":  # printed, not recorded
        for nodes in SIZES:
            runs = asyncio.run(restarts(nodes))
            print(f"median {nodes}: " + json.dumps(
                {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            ))  # fmt: skip
        return
    if os.environ.get("BENCH_DECISION_ONLY") == "1":  # printed, not recorded
        print(f"fit 5000: {json.dumps(fit_p99(5000))}", flush=True)
        return
    result: dict[str, Any] = {"e2e": {}, "note": os.environ.get("BENCH_NOTE", "")}
    if os.environ.get("BENCH_E2E_FROM"):  # the decision figures of that run too
        result["fit"] = json.loads(Path(os.environ["BENCH_E2E_FROM"]).read_text())["fit"]
    elif os.environ.get("BENCH_SKIP_FIT") != "1":
        result["fit"] = fit_p99(5000)
        print(f"fit 5000: {result['fit']}", flush=True)
    if os.environ.get("BENCH_E2E_FROM"):  # end-to-end medians of an earlier run of this script
        result["e2e"].update(json.loads(Path(os.environ["BENCH_E2E_FROM"]).read_text())["e2e"])
    for nodes in SIZES:
        runs = []
        for _ in range(REPEAT):
            run = asyncio.run(one_run(nodes))
            print(f"e2e {nodes}: {json.dumps(run)}", flush=True)
            runs.append(run)
        result["e2e"][str(nodes)] = median_of(runs)
        print(f"median {nodes}: {json.dumps(result['e2e'][str(nodes)])}", flush=True)
    if os.environ.get("BENCH_JSON"):
        Path(os.environ["BENCH_JSON"]).write_text(json.dumps(result, indent=1))
    before = json.loads(BEFORE.read_text()) if BEFORE.exists() else {}
    if "fit" in result:
        text = markdown(result, before)
        print(text)
        if os.environ.get("BENCH_NO_RECORD") != "1":
            record_section("scheduler scale", text)


if __name__ == "__main__":
    main()
