"""Elastic sharing in the scheduler (issue 33): the pod is packed by its guarantee (HAMi's
request), and its burst limit (tessera.io/gpumem-limit, gpucores-limit) rides on the grant into
the ledger and onto the bound pod (tessera.io/vgpu-burst-allocated), from which a lost ledger
is rebuilt with it; a pod without one is a hard slice exactly as before."""

from __future__ import annotations

from typing import Any

from tessera.scheduler.rules import parse_pod_options

from tessera import elastic, hami
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.models import DeviceGrant
from tessera.restore import allocation_from_pod
from tessera.settings import TesseraSettings

from .conftest import MakeService, http_client, unique
from .factories import container, node, pod
from .test_extender import bind_call, filter_call, ledger, setup_node

CARD_MIB = 16384


async def test_packed_by_the_guarantee_and_the_limit_recorded(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1, memory_mib=CARD_MIB))
    burst: dict[str, Any] = cluster.add_pod(pod(
        container(mem=4096, cores=20),
        annotations={elastic.ANN_GPUMEM_LIMIT: "12288", elastic.ANN_GPUCORES_LIMIT: "90",
                     elastic.ANN_GPUMEM_RECLAIM: "evict", elastic.ANN_GPUMEM_WAIT: "15"}))
    hard: dict[str, Any] = cluster.add_pod(pod(container(mem=12288, cores=20)))
    too_big: dict[str, Any] = cluster.add_pod(pod(container(mem=1024, cores=10)))
    async with http_client(service) as client:
        assert (await filter_call(client, burst, [name]))["nodenames"] == [name]
        assert await bind_call(client, burst, name) == ""
        # 4 GiB of 16 are guaranteed: a 12 GiB hard slice still fits beside the burst pod
        assert (await filter_call(client, hard, [name]))["nodenames"] == [name]
        assert await bind_call(client, hard, name) == ""
        assert (await filter_call(client, too_big, [name]))["nodenames"] == []
    state = await ledger(buckets, name)
    a = state.allocations[burst["metadata"]["uid"]]
    (g,) = a.containers[0]
    assert (g.memory_mib, g.memory_limit_mib, g.cores, g.cores_limit) == (4096, 12288, 20, 90)
    assert (a.memory_reclaim, a.memory_wait_s) == ("evict", 15.0)
    (h,) = state.allocations[hard["metadata"]["uid"]].containers[0]
    assert (h.memory_limit_mib, h.cores_limit) == (0, 0)  # a hard slice, as before

    bound = await cluster.get_pod(burst["metadata"]["namespace"], burst["metadata"]["name"])
    record = bound["metadata"]["annotations"][elastic.ANN_BURST_ALLOCATED]
    assert record == f"{g.uuid},12288,90:;"
    plain = await cluster.get_pod(hard["metadata"]["namespace"], hard["metadata"]["name"])
    assert elastic.ANN_BURST_ALLOCATED not in plain["metadata"]["annotations"]
    # a ledger rebuilt from the bound pod keeps the limit
    bound["spec"]["nodeName"] = name
    restored = allocation_from_pod(bound, quota_held=False, now=1.0, claim_ttl_s=30)
    assert restored is not None
    assert restored[0].containers[0][0].memory_limit_mib == 12288


def test_a_limit_above_the_card_is_clamped_to_it() -> None:
    request = hami.parse_pod_request(
        pod(container(mem=4096), annotations={elastic.ANN_GPUMEM_LIMIT: "99999"}),
        TesseraSettings())  # fmt: skip
    (r,) = request.containers
    assert r is not None and r.burst is not None
    g = DeviceGrant(uuid="GPU-a", type="T", memory_mib=4096, cores=0)
    assert elastic.burst_of_grant(r.burst, g, CARD_MIB) == (CARD_MIB, 0)
    assert elastic.burst_of_grant(r.burst, g, 4096) == (0, 0)  # no room above: a hard slice


def test_options_read_the_reclaim_policy_and_wait() -> None:
    options = parse_pod_options(pod(container(), annotations={
        elastic.ANN_GPUMEM_RECLAIM: "Evict", elastic.ANN_GPUMEM_WAIT: "2.5"}), TesseraSettings())
    assert (options.memory_reclaim, options.memory_wait_s) == ("evict", 2.5)
    assert parse_pod_options(pod(container()), TesseraSettings()).memory_reclaim == "fail"
