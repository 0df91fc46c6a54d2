"""The scheduler's ledger write path per pod, two versions side by side in one process (issue 35).

What the scheduler does for every pod it places besides deciding: the reservation's mutate
(`ledger.reserve_mutate`, claimed ahead: the pod goes in flight in the same write), its encode
(`ledger_codec.LedgerCodec.encode`) and the read of the node agent's `allocated` write off the
wire (`LedgerCodec.read`). The KV write, its ack and the index are the same code for both and
not timed. On a shared, loaded machine two runs a minute apart see different loads, so here both
versions do each pod in lockstep (which goes first alternates), on the same placements (made by
the worktree's index, the cluster and trace of `bench/scheduler_scale.py`), and every write's
bytes are compared: both versions must write byte for byte the same entry (the CAS writes the
same value) and read the agent's write to the same value.

    python bench/ledger_lockstep.py REV_BEFORE [REV_AFTER]     # e.g. 111b9b3 worktree

`BENCH_NODES` (5000), `BENCH_PODS` (3000). CPU time of this thread per pod (µs), per stage and
in all, the cyclic GC off as between the scheduler's calls. Then the JetStream acks the
scheduler awaits (three per pod: the reservation's CAS and two events), through each version's
`acks.JetStreamAcks` against one real nats-server: rounds of 32 event publishes awaited
together (the bench's 32 pods in flight), the versions alternating round by round; CPU of this
process per publish (nats-py's reader included). `BENCH_ACK_ROUNDS` (300). Printed, not
recorded.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import scheduler as bench  # noqa: E402
from decision_lockstep import source  # noqa: E402
from tessera.scheduler.decide import decide  # noqa: E402
from tessera.scheduler.index import ClusterIndex  # noqa: E402
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options  # noqa: E402

from tessera import hami  # noqa: E402
from tessera.models import Allocation  # noqa: E402
from tessera.settings import TesseraSettings  # noqa: E402

NODES = int(os.environ.get("BENCH_NODES", "5000"))
PODS = int(os.environ.get("BENCH_PODS", "3000"))
STAGES = ("reserve", "encode", "read")


def load(label: str, tree: Path) -> dict[str, ModuleType]:
    """The revision's `ledger` and `ledger_codec` as `tessera.sched_<label>.*` (relative
    imports inside it; the shared package shared)."""
    where = tree / "services" / "scheduler"
    name = f"tessera.sched_{label}"
    spec = importlib.util.spec_from_file_location(
        name, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return {m: importlib.import_module(f"{name}.{m}") for m in ("ledger", "ledger_codec", "acks")}


def main() -> None:
    revs = [*sys.argv[1:3], "HEAD", "worktree"][:2] if len(sys.argv) > 1 else ["HEAD", "worktree"]
    versions = []
    for i, rev in enumerate(revs):
        tree = source(rev, Path(tempfile.mkdtemp(prefix="tessera-ledger-lockstep-")))
        versions.append((rev, load(f"v{i}", tree)))
    settings = TesseraSettings()
    registrations, ledgers = bench.build_cluster(NODES)
    index = ClusterIndex()
    for r, ledger in zip(registrations, ledgers, strict=True):
        index.set_registration(r.node, r, 0.0)
        index.set_ledger(r.node, ledger, 1, 0.0)
    names = [r.node for r in registrations]
    codecs = [m["ledger_codec"].LedgerCodec() for _rev, m in versions]
    spent = [{stage: [] for stage in STAGES} for _ in versions]
    now, revision, placed = 1000.0, 10, 0
    gc.collect()
    gc.freeze()
    gc.disable()
    for n, spec in enumerate(bench.trace(PODS, seed=11)):
        request = hami.parse_pod_request(spec, settings)
        options = parse_pod_options(spec, settings)
        chosen = next(decide(index, request, options, names).fits(), None)
        if chosen is None:
            continue
        entry, fit = chosen
        meta = spec["metadata"]
        template = Allocation(
            pod_uid=meta["uid"], namespace=meta["namespace"], name=meta["name"],
            node=entry.name, containers=[], core_policy=settings.core_policy,
            container_names=["main"],
        )  # fmt: skip
        written: list[bytes] = []
        values = []
        order = list(range(len(versions)))[:: 1 if n % 2 == 0 else -1]  # who goes first alternates
        for v in order:
            ledger = versions[v][1]["ledger"]
            req = ledger.ReservationRequest(
                registration=entry.registration, cordoned=index.cordon_of(entry),
                request=request, ctx_factory=lambda o=options: FitContext(o, QuotaBudget()),
                template=template, now=now, ttl_s=60.0, may_create=False, foreign=(),
                claim_ahead=ledger.ClaimAhead("bench", 30.0, 0),
                decided=(entry.ledger, fit),
            )  # fmt: skip
            started = time.thread_time()
            new = ledger.reserve_mutate(req, entry.ledger)
            reserved = time.thread_time()
            payload = codecs[v].encode(new)
            spent[v]["reserve"].append(reserved - started)
            spent[v]["encode"].append(time.thread_time() - reserved)
            written.append(payload)
            values.append(new)
        if any(p != written[0] for p in written):
            raise SystemExit(f"pod {n}: the versions wrote different entries")
        revision += 1
        index.set_ledger(entry.name, values[0], revision, now)
        allocated = bench.allocate_payload(meta["uid"], written[0])
        read = []
        for v in order:
            started = time.thread_time()
            read.append(codecs[v].read(entry.name, allocated))
            spent[v]["read"].append(time.thread_time() - started)
        if any(r.model_dump() != read[0].model_dump() for r in read):
            raise SystemExit(f"pod {n}: the versions read the agent's write differently")
        revision += 1
        index.set_ledger(entry.name, read[0], revision, now)
        placed += 1
    print(
        f"{NODES} nodes, {placed} pods placed, load {os.getloadavg()[0]:.1f}; "
        "CPU µs per pod, median / mean:"
    )
    for (rev, _m), stages in zip(versions, spent, strict=True):
        total = [sum(t) for t in zip(*stages.values(), strict=True)]
        parts = ", ".join(f"{s} {statistics.median(v) * 1e6:.1f} / {statistics.mean(v) * 1e6:.1f}"
                          for s, v in stages.items())  # fmt: skip
        print(
            f"  {rev}: {parts}; all {statistics.median(total) * 1e6:.1f} / "
            f"{statistics.mean(total) * 1e6:.1f}"
        )
    print("every write byte for byte the same in both versions, every read the same value")
    import uvloop

    uvloop.install()
    asyncio.run(acks_lockstep(versions))


async def acks_lockstep(versions: list[tuple[str, dict[str, ModuleType]]]) -> None:
    from tessera.bus import alloc_event_subject, connect, ensure_bus
    from tessera.codec import encode
    from tessera.models import AllocationEvent, DeviceGrant
    from tessera.settings import NatsSettings
    from tessera_cli.nats_embedded import EmbeddedNats

    server = EmbeddedNats().start()
    try:
        nc = await connect(NatsSettings(NATS_URL=server.url), name="bench-acks")
        await ensure_bus(nc.jetstream(), TesseraSettings())
        acks = [m["acks"].JetStreamAcks(nc) for _rev, m in versions]
        grant = DeviceGrant(uuid="GPU-00001-3", type="NVIDIA-H100", memory_mib=8192, cores=20)
        spent: list[list[float]] = [[] for _ in versions]
        for n in range(int(os.environ.get("BENCH_ACK_ROUNDS", "300"))):
            order = list(range(len(versions)))[:: 1 if n % 2 == 0 else -1]
            for v in order:
                events = [AllocationEvent(
                    event_id=f"{v}-{n}-{i}:bound", action="bound", node="node-00001",
                    pod_uid=f"{v}-{n}-{i}", namespace="bench", name=f"p-{v}-{n}-{i}",
                    containers=[[grant]], source="bench",
                ) for i in range(32)]  # fmt: skip
                payloads = [(alloc_event_subject(e.node, e.action), encode(e), e.event_id)
                            for e in events]  # fmt: skip
                started = time.process_time()
                await asyncio.gather(*(acks[v].publish(subject, payload, {"Nats-Msg-Id": key})
                                       for subject, payload, key in payloads))  # fmt: skip
                spent[v].append((time.process_time() - started) / 32)
        await nc.close()
    finally:
        server.cleanup()
    print(f"JetStream acks, load {os.getloadavg()[0]:.1f}; CPU µs per publish awaited, "
          "median / mean of rounds of 32:")
    for (rev, _m), rounds in zip(versions, spent, strict=True):
        median, mean = statistics.median(rounds), statistics.mean(rounds)
        print(f"  {rev}: {median * 1e6:.1f} / {mean * 1e6:.1f}")


if __name__ == "__main__":
    main()
