"""Placement decision, two versions of the scheduler's code side by side in one process.

On a shared, loaded machine two benchmark runs a minute apart see different loads, and the
decision's p99 moves more between them than a change moves it. Here both versions decide the
same trace in lockstep: each pod is decided by one version and then the other (which goes first
alternates), each on its own index built from the same cluster, with the service's GC policy
between calls (as `bench/scheduler.py`'s `run_decisions`), so both see the same load. CPU time
of this thread per placed pod (the first 20 not counted; a refused pod's call also words every
node's reason and is counted apart, and for the backlog's retries also with what the service
then does with those reasons: the reply's failedNodes JSON and the FilteringFailed event's
message, `reply_and_event`), and whether both placed every pod on the same node and cards.
After each call, untimed, what the service's loop runs once a decision has answered (a version's
`ClusterIndex.tidy_orders`, where it has one: merges of the kept candidate orders).

    python bench/decision_lockstep.py REV_BEFORE [REV_AFTER] [bench|varied]

The candidates are kube-scheduler's (`kube_lists.py`, `BENCH_LISTS`: `window` by default, the
rotating `percentageOfNodesToScore` window; `full`, a fresh full list each call; `same`, the
identical list every call, the best case; `BENCH_ORDER=parallel`: in the order kube-scheduler's
parallel filters append the nodes, `kube_lists.py`), each call's body parsed by each version's
`NodeNamesCache` (timed apart: "list parse"). `BENCH_NODES` (5000), `BENCH_PODS` (2000),
`BENCH_WINDOW` (the window's size, instead of kube-scheduler's adaptive one), `BENCH_REFUSED`
(nodes kube-scheduler's own filters refuse each cycle, left out of its list),
`BENCH_UNSCHEDULABLE` (0.1: that share of the calls are retries of a backlog of 20 pods no node
fits, `scheduler.with_backlog`; their CPU, reasons included, reported as "refused").
`BENCH_BODY`: `made` (default: every call's list serialised before the timed loop, as
kube-scheduler does in its own process) or `dumps` (serialised between the calls, as before
session 17: that work evicted the next call's caches, bench/RESULTS.md "fresh").

`BENCH_POD`: `trace` (default: the trace's pods as they are, ~300 bytes, quantities as JSON
numbers, each call's request read from the trace's dict) or `informer` (each pod dressed as
kube-scheduler's informer holds a Deployment's pod and sends it: ~3 KB, `extender_body.pod`'s
metadata, managed fields, last-applied annotation, probes, env, volumes and status around the
trace's own name, uid, policy annotations and GPU limits, every quantity a string as the API
server writes it; each call's request read from the pod the list parse decoded from the body,
as the service reads it). The same decisions either way (same digests).

A revision is a git revision (its `services/scheduler` and `tessera/hami.py`, whose pod parsing
the decision includes, are extracted to a temporary directory, and its `native/names` and
`native/refusals` built there, as `make native` builds them) or `worktree` (the checkout's
own; its libraries as built). Default: HEAD against the worktree, varied trace. The traces and
cluster are `bench/scheduler.py`'s / `bench/scheduler_scale.py`'s (5,000 nodes × 8 GPUs).
Printed, not recorded.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import scheduler as bench  # noqa: E402
import scheduler_scale  # noqa: E402

from tessera.models import Allocation  # noqa: E402
from tessera.settings import TesseraSettings  # noqa: E402

MODULES = ("decide", "index", "node_names", "rules", "gc_policy", "kube_events")
MAX_CANDIDATES = 100_000  # api.MAX_CANDIDATES


def source(rev: str, into: Path) -> Path:
    """The tree holding the revision's `services/scheduler` and `tessera/hami.py`."""
    if rev == "worktree":
        return ROOT
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "services/scheduler", "tessera/hami.py"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    # The revision's native libraries, built beside its scheduler where its `native_names.py`
    # and `native_steps.py` look for them, where it has them: the name resolver and the walk,
    # the refusals' steps and reply. Without them its names would be resolved and its refusals
    # worked out in numpy, and a side by side would compare C with numpy.
    def extracted(path: str) -> bool:
        found = subprocess.run(["git", "-C", str(ROOT), "archive", rev, path],
                               capture_output=True)  # fmt: skip
        if found.returncode == 0:
            subprocess.run(["tar", "-x", "-C", str(into)], input=found.stdout, check=True)
        return found.returncode == 0

    extracted("native/library.mk")  # (their Makefiles include it where the revision has it)
    for library in ("names", "refusals"):
        if extracted(f"native/{library}"):
            subprocess.run(["make", "-s", "-C", str(into / "native" / library)], check=True,
                           capture_output=True)  # fmt: skip
    # An older scheduler checks at import that its msgspec wire Structs mirror the shared
    # models (`wire_fast._check_specs`); the models have gained fields since (elastic grants),
    # and the bench never decodes wire bytes (it hands the index model objects): skipped there.
    wire = into / "services" / "scheduler" / "wire_fast.py"
    if wire.exists():
        wire.write_text(wire.read_text().replace("\n_check_specs()\n", "\n"))
    return into


def load(label: str, tree: Path) -> dict[str, ModuleType]:
    """The scheduler package of `tree` as `tessera.sched_<label>` (its relative imports stay
    inside it; what it imports of the shared package is shared), and its `tessera/hami.py` as
    `tessera.hami_<label>` (its pod parsing, which the decision times; its requests are read by
    either scheduler alike)."""
    spec = importlib.util.spec_from_file_location(f"tessera.hami_{label}",
                                                  tree / "tessera" / "hami.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    parsing = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = parsing
    spec.loader.exec_module(parsing)
    where = tree / "services" / "scheduler"
    name = f"tessera.sched_{label}"
    spec = importlib.util.spec_from_file_location(
        name, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return {"hami": parsing, **{m: importlib.import_module(f"{name}.{m}") for m in MODULES}}


def reply_and_event(m: dict[str, ModuleType], failed: Any) -> tuple[bytes, str]:
    """What the service does with a refused call's reasons besides deciding: the reply's
    failedNodes JSON (`json.dumps` of the dict before; `NodeReasons.to_json` where the version
    has it) and the FilteringFailed event's message (every node's reason sorted and joined
    before; `kube_events.refusal_message` where the version has it)."""
    to_json = getattr(failed, "to_json", None)
    body = (to_json() if to_json is not None
            else json.dumps(failed, ensure_ascii=False, separators=(",", ":")).encode())
    message = getattr(m["kube_events"], "refusal_message", None)
    if message is not None:
        return body, message(failed, {})
    reasons = "; ".join(f"{node}: {why}" for node, why in sorted(failed.items()))
    return body, f"no node fits the GPU request ({len(failed)} refused): {reasons}"


def tidy_between_calls(index: Any) -> None:
    """What the service's loop runs once a decision has answered (`ClusterIndex.tidy_orders`,
    scheduled by the filter call), where the version has it: not timed, as it is not the call's."""
    tidy = getattr(index, "tidy_orders", None)
    if tidy is not None:
        tidy()


def informer_pod(spec: dict[str, Any], i: int) -> dict[str, Any]:
    """The trace's pod as kube-scheduler sends it (`BENCH_POD=informer`): `extender_body.pod`'s
    dress around the trace's name, uid, namespace, policy annotations and GPU limits (strings,
    as the API server writes quantities); no container or field the decision reads is added."""
    import extender_body

    dressed = extender_body.pod(i)
    template = dressed["spec"]["containers"][0]
    meta = spec["metadata"]
    dressed["metadata"].update(name=meta["name"], uid=meta["uid"], namespace=meta["namespace"])
    annotations = dressed["metadata"]["annotations"]
    for key in [k for k in annotations if k.startswith("hami.io/")]:
        del annotations[key]
    annotations.update(meta.get("annotations") or {})
    containers = []
    for container in spec["spec"]["containers"]:
        limits = {k: str(v) for k, v in container["resources"]["limits"].items()}
        containers.append({**template, "name": container["name"],
                           "resources": {"limits": {**limits, "cpu": "8", "memory": "32Gi"},
                                         "requests": {"cpu": "4", "memory": "16Gi"}}})  # fmt: skip
    dressed["spec"]["containers"] = containers
    return dressed


def main() -> None:
    args = sys.argv[1:]
    trace_name = args.pop() if args and args[-1] in ("bench", "varied") else "varied"
    before_rev = args[0] if args else "HEAD"
    after_rev = args[1] if len(args) > 1 else "worktree"
    from kube_lists import COMPACT, KubeLists, extender_args

    settings = TesseraSettings()
    nodes = int(os.environ.get("BENCH_NODES", "5000"))
    count = int(os.environ.get("BENCH_PODS", "2000"))
    mode = os.environ.get("BENCH_LISTS", "window")
    share = float(os.environ.get("BENCH_UNSCHEDULABLE", "0.1"))
    if trace_name == "bench":
        pods: list[tuple[dict[str, Any], str | None]] = [
            (pod, None) for pod in scheduler_scale.trace(count)
        ]
    else:
        pods = bench.decision_trace(count)
    pods = bench.with_backlog(pods, share)
    with tempfile.TemporaryDirectory() as tmp:
        versions = {}
        for label, rev in (("before", before_rev), ("after", after_rev)):
            into = Path(tmp) / label
            into.mkdir()
            versions[label] = load(label, source(rev, into))
        registrations, ledgers = bench.build_cluster(nodes)
        every = [r.node for r in registrations]
        members = {pool: bench.pool_members(every, pool) for pool in bench.POOLS}
        members_set = {pool: frozenset(m) for pool, m in members.items()}
        order = os.environ.get("BENCH_ORDER", "sequential")
        kube = KubeLists(every, mode, find=int(os.environ.get("BENCH_WINDOW", "0")) or None,
                         order=order, refused=int(os.environ.get("BENCH_REFUSED", "0")))
        state = {}
        for label, m in versions.items():
            index = m["index"].ClusterIndex()
            for r, ledger in zip(registrations, ledgers, strict=True):
                index.set_registration(r.node, r, 0.0)
                index.set_ledger(r.node, ledger, 1, 0.0)
            resolver = getattr(index, "names_from_bytes", None)  # (as its api.py passes it)
            runs = getattr(index, "names_of_run", None)
            names_cache = (m["node_names"].NodeNamesCache(MAX_CANDIDATES, resolver=resolver)
                           if resolver else m["node_names"].NodeNamesCache(MAX_CANDIDATES))
            if runs is not None:
                names_cache.runs = runs
            in_place = getattr(index, "names_in_body", None)  # (as its api.py passes it)
            if in_place is not None:
                names_cache.in_place = in_place
            state[label] = (index, names_cache)
        del registrations, ledgers
        gc.collect()
        gc.freeze()
        policy = versions["after"]["gc_policy"].GcPolicy()
        thresholds = gc.get_threshold()
        policy.install()
        collect_at = time.perf_counter() + policy.interval_s
        cpu: dict[str, list[float]] = {"before": [], "after": []}
        refused: dict[str, list[float]] = {"before": [], "after": []}
        backlog: dict[str, list[float]] = {"before": [], "after": []}  # the backlog's retries
        served: dict[str, list[float]] = {"before": [], "after": []}  # + reply body + event
        parse: dict[str, list[float]] = {"before": [], "after": []}
        both: dict[str, list[float]] = {"before": [], "after": []}  # list parse + decision
        # the same, of the placed calls right after a refused one (either version's): what a
        # refusal left in the caches (its reply above all) shows there
        after_refusal: dict[str, list[float]] = {"before": [], "after": []}
        previous = {"refused": False}  # (whether the call just before was refused)
        placed: dict[str, list[Any]] = {"before": [], "after": []}
        reasons: dict[str, list[Any]] = {"before": [], "after": []}
        # `BENCH_SLOWEST=N`: the N slowest placed calls of each version, stage by stage
        slowest = int(os.environ.get("BENCH_SLOWEST", "0"))
        stages: dict[str, list[tuple[Any, ...]]] = {"before": [], "after": []}

        def decide_one(label: str, spec: dict[str, Any], body: bytes, i: int) -> None:
            m, (index, names_cache) = versions[label], state[label]
            started = time.thread_time()
            parsed = names_cache.parse(body)
            if parsed is None:  # (the whole body read, its keys lower-cased, as the service does)
                parsed = {k.lower(): v for k, v in json.loads(body).items()}
            candidates = parsed["nodenames"]
            parsed_in = time.thread_time() - started
            if i >= bench.WARMUP:
                parse[label].append(parsed_in)
            started = time.thread_time()
            if informer:  # (the service reads the pod it decoded from the body)
                spec = parsed["pod"]
            request = m["hami"].parse_pod_request(spec, settings)
            options = m["rules"].parse_pod_options(spec, settings)
            if slowest:
                read_in = time.thread_time()
            decision = m["decide"].decide(index, request, options, candidates)
            if slowest:
                decided_in = time.thread_time()
            chosen = next(decision.fits(), None)
            if slowest and chosen is not None and i >= bench.WARMUP:
                ended = time.thread_time()
                ordering = getattr(decision.slots, "_ordering", None)
                stages[label].append((
                    parsed_in + ended - started, parsed_in, read_in - started,
                    decided_in - read_in, ended - decided_in,
                    getattr(ordering, "checked", -1), len(decision.failed), i, spec, pool,
                ))  # fmt: skip
            if chosen is None:
                decision.explain_rest()
                spent = time.thread_time() - started
                replied = time.thread_time()
                reply_and_event(m, decision.failed)
                replied = time.thread_time() - replied
                if i >= bench.WARMUP:
                    refused[label].append(spent)
                    if spec["metadata"]["uid"].startswith("unfit-"):
                        backlog[label].append(spent)
                        served[label].append(spent + replied)
                # (read after the run: sorting 20,000 entries here, between two timed calls,
                # left the next call's data out of the caches, which the service never does)
                reasons[label].append(decision.failed)
            elif i >= bench.WARMUP:
                cpu[label].append(time.thread_time() - started)
                both[label].append(cpu[label][-1] + parsed_in)
                if previous["refused"]:
                    after_refusal[label].append(both[label][-1])
            previous["refused"] = chosen is None
            tidy_between_calls(index)
            if chosen is None:
                placed[label].append(None)
                return
            entry, fit = chosen
            placed[label].append((entry.name, [[g.uuid for g in c] for c in fit.containers]))
            ledger = entry.ledger.model_copy(deep=False)
            ledger.allocations = dict(ledger.allocations)
            uid = spec["metadata"]["uid"]
            ledger.allocations[uid] = Allocation(
                pod_uid=uid, namespace="bench", name=uid, node=entry.name,
                containers=fit.containers, init_count=len(request.init),
            )  # fmt: skip
            index.set_ledger(entry.name, ledger, entry.ledger_revision + 1, 0.0)

        def listed_of(pool: str | None) -> bytes:
            window = kube.next(None if pool is None else members[pool] if mode == "same"
                               else members_set[pool])  # fmt: skip
            return json.dumps(window, separators=COMPACT).encode()  # as Go writes it

        # kube-scheduler's lists are made in its own process: made here before the timed loop
        # (`BENCH_BODY=made`, the default), not between two timed calls. Making one there
        # (20,000 names: the parallel order's simulation, then json.dumps reading 20,000
        # strings scattered over the heap and making as many) evicted the next call's
        # caches: it ran ~1.5x slower (p50 0.81 vs 0.52 ms at 20,000 nodes), though it
        # page-faulted no more (0-1 faults per timed call either way). `BENCH_BODY=dumps`:
        # made in the loop, as before. The same lists either way (same digests).
        body_mode = os.environ.get("BENCH_BODY", "made")
        if body_mode not in ("made", "dumps"):
            raise SystemExit(f"BENCH_BODY={body_mode!r}: made or dumps")
        made = [listed_of(pool) for _spec, pool in pods] if body_mode == "made" else None
        pod_mode = os.environ.get("BENCH_POD", "trace")
        if pod_mode not in ("trace", "informer"):
            raise SystemExit(f"BENCH_POD={pod_mode!r}: trace or informer")
        informer = pod_mode == "informer"
        sent = [json.dumps(informer_pod(spec, i) if informer else spec, separators=COMPACT
                           if informer else (", ", ": ")).encode()
                for i, (spec, _pool) in enumerate(pods)]  # fmt: skip
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        load_before = scheduler_scale.loadavg()
        for i, (spec, pool) in enumerate(pods):
            listed = made[i] if made is not None else listed_of(pool)
            # (the body as the server reads it off the socket: a new buffer each call)
            body = extender_args(sent[i], listed)
            for label in ("before", "after") if i % 2 else ("after", "before"):
                decide_one(label, spec, body, i)
                if time.perf_counter() >= collect_at:
                    policy.collect()
                    collect_at = time.perf_counter() + policy.interval_s
        gc.set_threshold(*thresholds)
        for label in reasons:
            reasons[label] = [sorted(failed.items()) for failed in reasons[label]]
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / len(pods)
    def ms(values: list[float], q: float) -> str:
        return f"{bench.percentile(values, q) * 1000:.3f}" if values else "-"

    figures = " | ".join(
        f"{label} ({rev}) n {len(cpu[label])} CPU p50 {ms(cpu[label], 0.5)} "
        f"p99 {ms(cpu[label], 0.99)} ms; refused n {len(refused[label])} CPU p50 "
        f"{ms(refused[label], 0.5)} p99 {ms(refused[label], 0.99)} ms (of which the backlog's "
        f"retries n {len(backlog[label])} p50 {ms(backlog[label], 0.5)} p99 "
        f"{ms(backlog[label], 0.99)} ms, max {ms(backlog[label], 1.0)}; with the reply's "
        f"failedNodes JSON and the event's message p50 {ms(served[label], 0.5)} p99 "
        f"{ms(served[label], 0.99)} ms); list parse p50 "
        f"{ms(parse[label], 0.5)} p99 {ms(parse[label], 0.99)} ms; placed, list parse + "
        f"decision p50 {ms(both[label], 0.5)} p99 {ms(both[label], 0.99)} ms (right after a "
        f"refused call n {len(after_refusal[label])} p50 {ms(after_refusal[label], 0.5)} p99 "
        f"{ms(after_refusal[label], 0.99)} ms)"
        for label, rev in (("before", before_rev), ("after", after_rev))
    )
    for label in ("before", "after") if slowest else ():
        print(f"{label}: the {slowest} slowest placed calls (ms: total = list parse + request "
              "+ decide() + walk to the first fit; checked, worded, call, pod)")
        buckets: dict[int, list[float]] = {}
        for record in stages[label]:
            buckets.setdefault(record[-3] // 100, []).append(record[0])
        print("  p50 / p90 by 100 calls: " + ", ".join(
            f"#{b * 100}- {ms(v, 0.5)} / {ms(v, 0.9)}" for b, v in sorted(buckets.items())))
        for total, *times, checked, worded, i, spec, pool in sorted(stages[label])[-slowest:]:
            shape = "+".join(str(c["resources"]["limits"].get("nvidia.com/gpu"))
                             for c in spec["spec"]["containers"])
            policies = ",".join(v for k, v in spec["metadata"]["annotations"].items())
            print(f"  {total * 1000:.3f} = " + " + ".join(f"{t * 1000:.3f}" for t in times)
                  + f"; {checked} {worded} #{i} {shape} GPUs {policies} pool {pool}")
    digest = hashlib.sha256(repr(placed["after"]).encode()).hexdigest()[:10]
    print(f"{trace_name} trace, {nodes} nodes, lists {mode} ({order} order, "
          f"{os.environ.get('BENCH_REFUSED', '0')} refused by its filters), unschedulable "
          f"share {share}, lists made {body_mode}, pods {pod_mode} ({faults:.1f} minor faults "
          f"per pod, both versions' calls and the loop), load "
          f"{load_before} -> {scheduler_scale.loadavg()}, identical placements: "
          f"{placed['before'] == placed['after']} (digest {digest}), identical reasons: "
          f"{reasons['before'] == reasons['after']} | {figures}")  # fmt: skip


if __name__ == "__main__":
    main()
