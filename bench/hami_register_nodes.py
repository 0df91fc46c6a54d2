"""What the scheduler's Node watch costs a decision: every node carries HAMi's
`hami.io/node-nvidia-register`, which Tessera's own node agent writes too (so HAMi's tools read
Tessera's nodes). The scheduler's `ForeignCapacity` used to keep a `ClusterIndex.foreign` entry
for every node whose annotation it read; a node in `index.foreign` is worded one by one and never
remembered in the refusal memo (decide.py), so on a real cluster (Node objects watched) a pod
refused everywhere cost a fit per node on every retry (5,000 nodes: 76 ms CPU p50 instead of
0.4). Now only a node with something to say is (`ForeignNode.special`): this checks it stays so.

Side by side in one process, alternating: the same index with the Node watch's events applied
("watched", as on a cluster) and without ("unwatched", as the decision benchmarks run). CPU ms
of `decide` + `explain_rest` per call: a pod refused on every node (its retries), and a pod that
fits. Placements and every node's reason are checked equal between the two.

    BENCH_NODES=2000 BENCH_CALLS=40 python bench/hami_register_nodes.py
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from tessera.scheduler.decide import decide
from tessera.scheduler.foreign import ForeignCapacity
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rules import parse_pod_options

from tessera.cluster.port import WatchEvent
from tessera.device_kinds import registry
from tessera.hami import PodRequest
from tessera.models import DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()


def cluster(nodes: int, watched: bool) -> tuple[ClusterIndex, list[str]]:
    index = ClusterIndex()
    foreign = ForeignCapacity(settings=SETTINGS, index=index, clock=lambda: 0.0)
    names = []
    for i in range(nodes):
        name = f"node-{i:05d}"
        names.append(name)
        devices = [DeviceInfo(uuid=f"GPU-{i}-{j}", index=j, type="NVIDIA-A10",
                              memory_mib=24576) for j in range(8)]  # fmt: skip
        index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
        if watched:  # what the node agent writes on its Node (registration.py `annotate`)
            foreign.on_node_event(WatchEvent(type="ADDED", object={"metadata": {
                "name": name, "annotations": registry.register_annotations(devices)}}))
    return index, names


def pod(memory: int) -> tuple[PodRequest, Any]:
    spec = {"metadata": {"name": "p", "namespace": "ns", "uid": "p", "annotations": {}},
            "spec": {"containers": [{"name": "m", "resources": {"limits": {
                "nvidia.com/gpu": 1, "nvidia.com/gpumem": memory}}}]}}  # fmt: skip
    request = PodRequest(containers=[registry.read_request(c, SETTINGS)
                                     for c in spec["spec"]["containers"]])  # fmt: skip
    return request, parse_pod_options(spec, SETTINGS)


def call(index: ClusterIndex, names: list[str], request: PodRequest, options: Any,
         ) -> tuple[float, str | None, dict[str, str]]:  # fmt: skip
    start = time.process_time()
    decision = decide(index, request, options, names)
    placed = next((entry.name for entry, _fit in decision.fits()), None)
    if placed is None:
        decision.explain_rest()
    return (time.process_time() - start) * 1e3, placed, dict(decision.failed)


def main() -> None:
    nodes = int(os.environ.get("BENCH_NODES", "2000"))
    calls = int(os.environ.get("BENCH_CALLS", "40"))
    load = os.getloadavg()[0]
    sides = {side: cluster(nodes, side == "watched") for side in ("unwatched", "watched")}
    for label, memory in (("refused everywhere", 30000), ("fits", 1000)):
        request, options = pod(memory)
        times: dict[str, list[float]] = {side: [] for side in sides}
        answers: dict[str, tuple[str | None, dict[str, str]]] = {}
        for _ in range(calls):
            for side, (index, names) in sides.items():  # alternating
                took, placed, failed = call(index, names, request, options)
                times[side].append(took)
                answers[side] = (placed, failed)
        same = answers["unwatched"] == answers["watched"]
        foreign = {side: len(index.foreign) for side, (index, _n) in sides.items()}
        parts = []
        for side, values in times.items():
            values.sort()
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            parts.append(f"{side} (index.foreign {foreign[side]}) CPU p50 "
                         f"{statistics.median(values):.3f} p99 {p99:.3f} ms")  # fmt: skip
        print(f"{nodes} nodes × 8 GPUs, {label}, {calls} calls each, load {load:.2f} -> "
              f"{os.getloadavg()[0]:.2f}, same answers: {same} | " + " | ".join(parts))


if __name__ == "__main__":
    main()
