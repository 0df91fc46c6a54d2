"""A cluster migrating from HAMi node by node (docs/migrating-from-hami.md): pods HAMi's scheduler
placed hold GPUs Tessera must never hand out again, also on a node that switched to Tessera's
node agent; nodes HAMi's device plugin registered are read-only; anything unreadable quarantines
the node; a restart rebuilds it all from the cluster. Real NATS, the in-memory cluster.

The HAMi objects are written as HAMi writes them (specs/hami-compat.md): pods routed to
`hami-scheduler` with `hami.io/vgpu-devices-allocated` (`UUID,TYPE,MEM,CORES:` per device, `;`
per container, init containers first), `hami.io/vgpu-node`, `hami.io/bind-phase`; nodes with
`hami.io/node-nvidia-register` (the JSON array, or the legacy `:`-joined form).
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from tessera.scheduler.foreign import ForeignCapacity
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.validation import cluster_rebuild

from tessera import bus
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import WatchEvent
from tessera.models import ExplainRequest, NodeLedger
from tessera.settings import TesseraSettings

from .conftest import MakeService, register, unique, wait_until
from .factories import container, node, pod

CARD = 24576


def hami_pod(
    name: str, node_name: str | None, devices: str, *, mem: int = 20000, cores: int = 50,
    phase: str = "Running", bind_phase: str = "success", vgpu_node: str | None = None,
    namespace: str = "team-hami",
) -> dict[str, Any]:  # fmt: skip
    """A pod as HAMi's webhook routed it and HAMi's scheduler annotated and bound it."""
    spec = pod(container(mem=mem, cores=cores), name=name, namespace=namespace, annotations={
        "hami.io/vgpu-devices-allocated": devices,
        "hami.io/vgpu-devices-to-allocate": ";",  # HAMi's device plugin empties it as it serves
        "hami.io/vgpu-node": vgpu_node or node_name or "",
        "hami.io/vgpu-time": "1700000000",
        "hami.io/bind-time": "1700000000",
        "hami.io/bind-phase": bind_phase,
    })  # fmt: skip
    spec["metadata"]["labels"] = {"hami.io/vgpu-node": vgpu_node or node_name or ""}
    spec["spec"]["schedulerName"] = "hami-scheduler"
    if node_name:
        spec["spec"]["nodeName"] = node_name
    spec["status"] = {"phase": phase}
    return spec


def hami_node(name: str, register_text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {
                "hami.io/node-nvidia-register": register_text}}}  # fmt: skip


def hami_register_json(name: str, gpus: int = 2) -> str:
    return json.dumps([
        {"id": f"GPU-{name}-{i}", "index": i, "count": 10, "devmem": CARD, "devcore": 100,
         "type": "NVIDIA-NVIDIA A10", "numa": 0, "mode": "hami-core", "health": True}
        for i in range(gpus)
    ])  # fmt: skip


async def filter_pod(service: Any, cluster: InMemoryCluster, names: list[str],
                     **kw: Any) -> tuple[dict[str, Any], Any]:  # fmt: skip
    spec = cluster.add_pod(pod(container(**kw)))
    return spec, await service.scheduler.filter(spec, names)


def granted(service: Any, node_name: str, uid: str) -> list[list[Any]]:
    entry = service.index.entries[node_name]
    assert entry.ledger is not None
    return entry.ledger.allocations[uid].containers


async def test_hami_pod_on_a_migrated_node_holds_its_gpu_until_deleted(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    name = unique("mix")
    await register(buckets, node(name, gpus=1, memory_mib=CARD))
    held = cluster.add_pod(hami_pod("trainer", name, f"GPU-{name}-0,NVIDIA-H100,20000,50:;"))
    service = await make_service()
    await wait_until(lambda: service.index.node(name) is not None)

    big, outcome = await filter_pod(service, cluster, [name], mem=10000)
    assert not outcome.nodenames, "placed on memory a HAMi pod holds"
    reason = outcome.failed[name]
    assert "CardInsufficientMemory" in reason
    assert f"GPU-{name}-0: 20000 MiB and 50 cores used by HAMi pod team-hami/trainer" in reason
    explained = service.explain(ExplainRequest(namespace="default", name=big["metadata"]["name"]))
    assert explained.pending
    assert "used by HAMi pod team-hami/trainer" in explained.node_reasons[name]

    # What is left beside the HAMi pod is Tessera's to give, and no more.
    small, outcome = await filter_pod(service, cluster, [name], mem=4000, cores=50)
    assert outcome.nodenames == [name]
    _exclusive, outcome = await filter_pod(service, cluster, [name], mem=100, cores=1)
    assert not outcome.nodenames and "CardInsufficientCore" in outcome.failed[name]
    ledger = await bus.read(buckets.ledger, name, NodeLedger)
    assert ledger is not None and held["metadata"]["uid"] not in ledger.value.allocations

    cluster.delete_pod("team-hami", "trainer")
    await wait_until(lambda: not service.index.foreign_allocations(name))
    outcome = await service.scheduler.filter(big, [name])
    assert outcome.nodenames == [name], outcome
    assert granted(service, name, big["metadata"]["uid"])[0][0].memory_mib == 10000
    assert small["metadata"]["uid"] in service.index.pod_nodes


async def test_restart_rebuilds_hami_holdings_from_the_cluster_before_serving(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    name = unique("mixr")
    await register(buckets, node(name, gpus=2, memory_mib=CARD))
    first = await make_service()
    await wait_until(lambda: first.index.node(name) is not None)
    # HAMi places while Tessera runs: the pod watch counts it at once.
    cluster.add_pod(hami_pod("a", name, f"GPU-{name}-0,NVIDIA-H100,24000,100:;", mem=24000,
                             cores=100))  # fmt: skip
    await wait_until(lambda: len(first.index.foreign_allocations(name)) == 1)
    await first.stop()

    second = await make_service()  # ready = the ledger synced and HAMi's pods read back
    spec, outcome = await filter_pod(second, cluster, [name], mem=1000, cores=100)
    assert outcome.nodenames == [name]
    assert granted(second, name, spec["metadata"]["uid"])[0][0].uuid == f"GPU-{name}-1"
    _spec, outcome = await filter_pod(second, cluster, [name], mem=1000)
    assert not outcome.nodenames, "the card HAMi holds whole was handed out after a restart"
    ledger = await bus.read(buckets.ledger, name, NodeLedger)
    assert ledger is not None and len(ledger.value.allocations) == 1  # HAMi's never restored


async def test_unreadable_hami_pod_quarantines_its_node_until_it_is_gone(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    bad, good = unique("qbad"), unique("qgood")
    await register(buckets, node(bad, gpus=2, memory_mib=CARD))
    await register(buckets, node(good, gpus=2, memory_mib=CARD))
    cluster.add_pod(hami_pod("garbled", bad, "GPU-x,NVIDIA,lots,50:;"))
    cluster.add_pod(hami_pod("elsewhere", good, "GPU-not-on-this-node,NVIDIA-H100,100,0:;"))
    service = await make_service()
    await wait_until(lambda: service.index.node(bad) is not None
                     and service.index.node(good) is not None)  # fmt: skip

    _spec, outcome = await filter_pod(service, cluster, [bad, good], mem=100)
    assert not outcome.nodenames, "placed on a node whose HAMi holdings are unknown"
    assert outcome.failed[bad].startswith("HAMiCapacityUnknown: HAMi pod team-hami/garbled:")
    assert "bad memory/cores" in outcome.failed[bad]
    assert "GPU-not-on-this-node" in outcome.failed[good]
    metrics = generate_latest(service.metrics.registry).decode()
    assert 'tessera_scheduler_hami_quarantined{kind="pod"} 1.0' in metrics

    cluster.delete_pod("team-hami", "garbled")
    fixed = hami_pod("elsewhere", good, f"GPU-{good}-0,NVIDIA-H100,100,0:;")
    fixed["metadata"]["uid"] = cluster.pods[("team-hami", "elsewhere")]["metadata"]["uid"]
    cluster.update_pod(fixed)
    await wait_until(lambda: not service.index.entries[bad].blocked
                     and not service.index.entries[good].blocked)  # fmt: skip
    _spec, outcome = await filter_pod(service, cluster, [bad, good], mem=100)
    assert outcome.nodenames


async def test_hami_nodes_are_read_only_and_shown_with_what_hami_pods_hold(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    json_node, legacy_node, broken = unique("hj"), unique("hl"), unique("hb")
    cluster.add_node(hami_node(json_node, hami_register_json(json_node)))
    legacy = ":".join(f"GPU-{legacy_node}-{i},10,{CARD},100,NVIDIA-NVIDIA A10,0,true,{i},hami-core"
                      for i in range(3))  # fmt: skip
    cluster.add_node(hami_node(legacy_node, legacy))
    cluster.add_node(hami_node(broken, '[{"index": 0, "devmem": 100}]'))
    cluster.add_pod(hami_pod("infer", json_node, f"GPU-{json_node}-1,NVIDIA-A10,8000,30:;"))
    service = await make_service()
    await wait_until(lambda: len(service.foreign.registers) >= 3)

    _spec, outcome = await filter_pod(service, cluster, [json_node, legacy_node, broken], mem=10)
    assert not outcome.nodenames, "Tessera placed on a node only HAMi's device plugin serves"
    assert outcome.failed[json_node].startswith("NodeUnregistered: no Tessera node agent")
    registered = "hami.io/node-nvidia-register (2 GPUs): read-only to Tessera"
    assert registered in outcome.failed[json_node]
    assert (f"GPU-{json_node}-1: 8000 MiB and 30 cores used by HAMi pod team-hami/infer"
            in outcome.failed[json_node])  # fmt: skip
    assert "(3 GPUs)" in outcome.failed[legacy_node]
    assert "unreadable and quarantined" in outcome.failed[broken]
    assert 'no string "id"' in outcome.failed[broken]
    metrics = generate_latest(service.metrics.registry).decode()
    assert "tessera_scheduler_hami_nodes 2.0" in metrics
    assert 'tessera_scheduler_hami_quarantined{kind="node"} 1.0' in metrics
    assert "tessera_scheduler_hami_pods 1.0" in metrics

    cluster.delete_node(broken)
    await wait_until(lambda: broken not in service.foreign.registers)


async def test_what_hami_pods_no_longer_hold_is_free(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    name = unique("free")
    await register(buckets, node(name, gpus=1, memory_mib=CARD))
    whole = f"GPU-{name}-0,NVIDIA-H100,{CARD},100:;"
    cluster.add_pod(hami_pod("done", name, whole, phase="Succeeded"))
    cluster.add_pod(hami_pod("failed-bind", None, whole, phase="Pending", bind_phase="failed",
                             vgpu_node=name))  # fmt: skip
    forged = hami_pod("no-gpu", name, whole)
    forged["spec"]["containers"][0]["resources"] = {}  # kubelet gives it no GPU at all
    cluster.add_pod(forged)
    service = await make_service()
    await wait_until(lambda: service.index.node(name) is not None)
    assert not service.index.foreign_allocations(name)
    _spec, outcome = await filter_pod(service, cluster, [name], mem=CARD, cores=100)
    assert outcome.nodenames == [name]

    # Decided by HAMi's scheduler but not bound yet: it holds the card from that moment on.
    other = unique("free2")
    await register(buckets, node(other, gpus=1, memory_mib=CARD))
    cluster.add_pod(hami_pod("binding", None, f"GPU-{other}-0,NVIDIA-H100,{CARD},100:;",
                             phase="Pending", bind_phase="allocating", vgpu_node=other))
    await wait_until(lambda: service.index.node(other) is not None
                     and bool(service.index.foreign_allocations(other)))  # fmt: skip
    _spec, outcome = await filter_pod(service, cluster, [other], mem=100)
    assert not outcome.nodenames and "CardInsufficientMemory" in outcome.failed[other]


async def test_tessera_pods_are_never_taken_for_hamis(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    """Tessera's own pods carry the same annotations; routed to Tessera's scheduler they are
    restored into the ledger after a loss, not counted as HAMi's."""
    name = unique("own")
    await register(buckets, node(name, gpus=1, memory_mib=CARD))
    mine = hami_pod("mine", name, f"GPU-{name}-0,NVIDIA-H100,1000,10:;", namespace="default")
    mine["spec"]["schedulerName"] = "tessera-scheduler"
    cluster.add_pod(mine)
    service = await make_service()
    assert not service.index.foreign_allocations(name)
    ledger = await bus.read(buckets.ledger, name, NodeLedger)
    assert ledger is not None and len(ledger.value.allocations) == 1
    assert service.index.node(name) is not None


def test_a_listing_never_brings_back_what_the_watch_saw_end() -> None:
    """The listing a rebuild or reconcile works from may predate a delete or a newer update the
    watch already applied: neither resurrects a freed GPU nor rolls back to older grants."""
    now = [1000.0]
    index = ClusterIndex()
    index.set_registration("n1", node("n1", gpus=2, memory_mib=CARD), now[0])
    foreign = ForeignCapacity(settings=TesseraSettings(), index=index, clock=lambda: now[0])
    listed = hami_pod("old", "n1", f"GPU-n1-0,NVIDIA-H100,{CARD},100:;")
    listed["metadata"]["resourceVersion"] = "5"
    foreign.on_pod_event(WatchEvent(type="DELETED", object=listed))
    assert foreign.load([listed], listed_at=now[0]) == []  # HAMi's: not for the ledger rebuild
    assert not index.foreign_allocations("n1")

    moved = hami_pod("moving", "n1", "GPU-n1-1,NVIDIA-H100,1000,10:;")
    moved["metadata"]["resourceVersion"] = "9"
    stale = {**moved, "metadata": {**moved["metadata"], "resourceVersion": "7",
             "annotations": {**moved["metadata"]["annotations"],
                             "hami.io/vgpu-devices-allocated": "GPU-n1-0,NVIDIA-H100,1,1:;"}}}
    foreign.on_pod_event(WatchEvent(type="ADDED", object=moved))
    foreign.load([stale], listed_at=now[0])
    (held,) = index.foreign_allocations("n1")
    assert held.containers[0][0].uuid == "GPU-n1-1"
    cards = {c.uuid: c for c in index.entries["n1"].cards}
    assert (cards["GPU-n1-1"].used_mem, cards["GPU-n1-0"].used_mem) == (1000, 0)

    now[0] += 60  # a later listing without the pod: it ended while no watch saw it
    foreign.load([], listed_at=now[0])
    assert not index.foreign_allocations("n1") and index.entries["n1"].cards[1].used_mem == 0


def test_hostile_shapes_never_raise_and_never_free_a_gpu() -> None:
    index = ClusterIndex()
    index.set_registration("n1", node("n1", gpus=1, memory_mib=CARD), 0.0)
    foreign = ForeignCapacity(settings=TesseraSettings(), index=index, clock=lambda: 0.0)
    base = hami_pod("odd", "n1", "GPU-n1-0,NVIDIA-H100,1000,10:;")
    shapes: list[Any] = [
        {**base, "status": "Running"},
        {**base, "spec": {**base["spec"], "containers": "main"}},
        {**base, "spec": {**base["spec"], "initContainers": [7]}},
        {**base, "metadata": {**base["metadata"], "annotations": {
            "hami.io/vgpu-node": "n1", "hami.io/vgpu-devices-allocated": {"x": 1}}}},
        {**base, "metadata": {**base["metadata"], "name": 5}},
        {"metadata": [], "spec": {}},
    ]
    for shape in shapes:
        foreign.on_pod_event(WatchEvent(type="ADDED", object=shape))
        foreign.load([shape], listed_at=0.0)
        if shape is not shapes[-1]:  # HAMi's: its GPU stays taken (counted, or quarantined)
            entry = index.entries["n1"]
            assert (entry.blocked.startswith("HAMiCapacityUnknown: HAMi pod team-hami/")
                    or entry.cards[0].used_mem == 1000), shape  # fmt: skip
    foreign.on_pod_event(WatchEvent(type="DELETED", object=base))
    assert not index.entries["n1"].blocked


async def test_ledger_repair_never_writes_hami_pods_into_tesseras_ledger() -> None:
    """A quarantined ledger entry is completed from the pods' annotations: Tessera's pods come
    back, HAMi's (same annotations, another scheduler) stay counted apart."""
    cluster = InMemoryCluster()
    index = ClusterIndex()
    foreign = ForeignCapacity(settings=TesseraSettings(), index=index, clock=lambda: 0.0)
    theirs = cluster.add_pod(hami_pod("theirs", "n1", "GPU-n1-0,NVIDIA-H100,1000,10:;"))
    mine = hami_pod("mine", "n1", "GPU-n1-1,NVIDIA-H100,2000,0:;", namespace="default")
    mine["spec"]["schedulerName"] = "tessera-scheduler"
    mine = cluster.add_pod(mine)
    foreign.load(await cluster.list_pods(), listed_at=0.0)
    repaired = await foreign.repairing(cluster_rebuild(cluster))("n1", None)
    assert set(repaired.allocations) == {mine["metadata"]["uid"]}
    assert theirs["metadata"]["uid"] in foreign.pods
