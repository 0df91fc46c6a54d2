"""A lost or empty ledger is rebuilt from the bound pods' annotations before any filter is
answered: running pods keep their grants, new pods fit only into truly free capacity."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest

from tessera import bus
from tessera.bus import Buckets, connect, ensure_bus
from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import ClusterError
from tessera.models import AllocationState, NodeLedger
from tessera.restore import RestoreReport, allocations_from_pods
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats

from .conftest import MakeService, agent_allocate, http_client, register, unique, wait_until
from .factories import GIB, container, node, pod


async def place_full_gpus(service: Any, cluster: InMemoryCluster, buckets: Buckets, name: str,
                          count: int) -> dict[str, Any]:  # fmt: skip
    """`count` pods, each taking one whole 10 GiB GPU of `name`, bound and allocated."""
    placed = {}
    for i in range(count):
        spec = cluster.add_pod(pod(container(mem=10 * GIB), name=f"big-{i}-{name}"))
        meta = spec["metadata"]
        outcome = await service.scheduler.filter(spec, [name])
        assert outcome.nodenames == [name], outcome
        ns, pod_name, uid = meta["namespace"], meta["name"], meta["uid"]
        assert await service.scheduler.bind(ns, pod_name, uid, name) == ""
        await agent_allocate(buckets, name, meta["uid"])
        placed[meta["uid"]] = spec
    return placed


async def refused_for_lack_of_memory(service: Any, cluster: InMemoryCluster, name: str) -> str:
    spec = cluster.add_pod(pod(container(mem=10 * GIB)))
    outcome = await service.scheduler.filter(spec, [name])
    assert not outcome.nodenames, f"a new pod was placed on GPUs running pods hold: {outcome}"
    return outcome.failed[name]


def test_pods_annotations_read_back_as_allocations() -> None:
    bound = pod(container(mem=1000), name="a", annotations={
        "hami.io/vgpu-devices-to-allocate": "GPU-1,NVIDIA-H100,1000,0:;",
        "hami.io/vgpu-node": "n1", "hami.io/bind-phase": "success",
    })  # fmt: skip
    bound["spec"]["nodeName"] = "n1"
    allocating = pod(container(mem=500), name="b", annotations={
        "hami.io/vgpu-devices-to-allocate": "GPU-2,NVIDIA-H100,500,0:;",
        "hami.io/vgpu-node": "n1", "hami.io/bind-phase": "allocating",
    })  # fmt: skip
    allocating["spec"]["nodeName"] = "n1"
    finished = {**bound, "metadata": {**bound["metadata"], "uid": "x", "name": "c"},
                "status": {"phase": "Succeeded"}}  # fmt: skip
    garbage = pod(container(), name="d", annotations={
        "hami.io/vgpu-devices-to-allocate": "not;a:grant"})  # fmt: skip
    garbage["spec"]["nodeName"] = "n1"
    unbound = pod(container(), name="e", annotations={
        "hami.io/vgpu-devices-to-allocate": "GPU-1,NVIDIA-H100,1000,0:;"})  # fmt: skip
    report = RestoreReport()
    by_node = allocations_from_pods(
        [bound, allocating, finished, garbage, unbound], quota_held=True, now=100.0,
        claim_ttl_s=30.0, report=report,
    )  # fmt: skip
    [(a, a_claim), (b, b_claim)] = by_node["n1"]
    assert (a.name, a.state, a_claim) == ("a", AllocationState.ALLOCATED, None)
    assert a.containers[0][0].uuid == "GPU-1" and a.containers[0][0].memory_mib == 1000
    assert a.quota_held
    # Bound but not yet through its node agent's Allocate: the node's claim comes back too.
    assert b.state == AllocationState.BOUND and b_claim is not None and b_claim.pod_uid == b.pod_uid
    assert report.gpu_pods == 2 and len(report.unreadable) == 1 and "d" in report.unreadable[0]


async def test_lost_ledger_is_rebuilt_before_the_next_filter(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    name = unique("rb")
    await register(buckets, node(name, gpus=2, memory_mib=10 * GIB))
    first = await make_service()
    await wait_until(lambda: first.index.node(name) is not None)
    placed = await place_full_gpus(first, cluster, buckets, name, 2)
    before = await bus.read(buckets.ledger, name, NodeLedger)
    assert before is not None
    await first.stop()

    await buckets.ledger.purge(name)  # NATS lost the node's ledger
    second = await make_service()  # ready = synced *and* rebuilt from the pods
    after = await bus.read(buckets.ledger, name, NodeLedger)
    assert after is not None and set(after.value.allocations) == set(placed)
    for uid, allocation in after.value.allocations.items():
        assert allocation.containers == before.value.allocations[uid].containers
        assert allocation.active and allocation.quota_held is False  # quota off in these tests
    reason = await refused_for_lack_of_memory(second, cluster, name)
    assert "CardInsufficientMemory" in reason


async def test_replicas_rebuilding_at_once_restore_each_pod_once(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    name = unique("rb2")
    await register(buckets, node(name, gpus=3, memory_mib=10 * GIB))
    first = await make_service()
    await wait_until(lambda: first.index.node(name) is not None)
    placed = await place_full_gpus(first, cluster, buckets, name, 3)
    await first.stop()
    await buckets.ledger.purge(name)
    replicas = await asyncio.gather(make_service(), make_service(), make_service())
    restored = sum(r.metrics.ledger_restored._value.get() for r in replicas)
    assert restored == len(placed)  # one CAS won per pod; the others found it there
    after = await bus.read(buckets.ledger, name, NodeLedger)
    assert after is not None and set(after.value.allocations) == set(placed)
    for replica in replicas:
        await refused_for_lack_of_memory(replica, cluster, name)


class UnreachableCluster(InMemoryCluster):
    """The cluster API refuses to list pods until `reachable` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.reachable = False

    async def list_pods(self, namespace: str | None = None, node_name: str | None = None):
        if not self.reachable:
            raise ClusterError("apiserver unreachable", 503)
        return await super().list_pods(namespace, node_name)


async def test_filter_is_refused_with_a_reason_until_the_ledger_is_rebuilt(nats_url: str) -> None:
    from tessera.scheduler.config import SchedulerSettings
    from tessera.scheduler.runtime import SchedulerService

    settings = TesseraSettings(quota_enabled=False)
    nc = await connect(NatsSettings(NATS_URL=nats_url), name="rebuild-test")
    js = nc.jetstream()
    buckets = await ensure_bus(js, settings)
    name = unique("rb3")
    await register(buckets, node(name, gpus=1, memory_mib=10 * GIB))
    cluster = UnreachableCluster()
    cluster.add_node({"metadata": {"name": name}})  # filter places only on nodes that exist
    service = SchedulerService(settings, SchedulerSettings(), nc, js, buckets, cluster)
    await service.start()
    try:
        spec = cluster.add_pod(pod(container(mem=GIB)))
        args = {"Pod": spec, "NodeNames": [name]}
        async with http_client(service) as http:
            await wait_until(lambda: service.nodes_synced.is_set())
            await asyncio.sleep(1.0)  # several rebuild attempts failed meanwhile
            assert (await http.get("/readyz")).status_code == 503
            refused = (await http.post("/filter", json=args)).json()
            assert "rebuilt from pods" in refused["error"]
            assert "apiserver unreachable" in refused["error"]
            assert not refused.get("nodenames")
            cluster.reachable = True
            await service.wait_ready(30)
            assert (await http.get("/readyz")).status_code == 200
            placed = (await http.post("/filter", json=args)).json()
            assert placed["nodenames"] == [name], placed
    finally:
        await service.stop()
        await nc.close()


async def test_wiped_store_under_a_running_scheduler_is_recreated_and_rebuilt(
    fresh_nats: EmbeddedNats, make_service: MakeService, cluster: InMemoryCluster,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """NATS loses its whole JetStream store and comes back empty on the same port: the
    scheduler re-creates the buckets, stops serving from what it knew, and rebuilds the ledger
    from the cluster's pods before it places anything again."""
    settings = TesseraSettings(quota_enabled=False)
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="wipe-test")
    try:
        buckets = await ensure_bus(nc.jetstream(), settings)
        name = unique("wipe")
        await register(buckets, node(name, gpus=2, memory_mib=10 * GIB))
        service = await make_service(keeper=True, url=fresh_nats.url)
        await wait_until(lambda: service.index.node(name) is not None)
        placed = await place_full_gpus(service, cluster, buckets, name, 2)
        caplog.clear()

        fresh_nats.stop()
        shutil.rmtree(fresh_nats.data_dir / "jetstream")
        fresh_nats.start()
        keeper = service.keeper
        assert keeper is not None
        # The re-creation itself, not the not-ready window it opens: with an in-memory cluster
        # the rebuild can finish between two polls of `ready()` (it did in a loaded CI run).
        await wait_until(lambda: keeper.generation >= 1)
        for _ in range(100):  # the node agent's next heartbeat, once the bucket is back
            try:
                await register(buckets, node(name, gpus=2, memory_mib=10 * GIB))
                break
            except Exception:
                await asyncio.sleep(0.1)
        await wait_until(lambda: service.ready(), 30)
        messages = [record.getMessage() for record in caplog.records]
        assert "buckets re-created: re-syncing and rebuilding the ledger" in messages
        assert "ledger rebuilt from the cluster's pods" in messages
        after = await bus.read(buckets.ledger, name, NodeLedger)
        assert after is not None and set(after.value.allocations) == set(placed)
        await wait_until(lambda: service.index.node(name) is not None
                         and service.index.node(name).registration is not None, 10)  # fmt: skip
        await refused_for_lack_of_memory(service, cluster, name)
    finally:
        await nc.close()
