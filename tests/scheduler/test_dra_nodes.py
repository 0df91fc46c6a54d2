"""One cluster, both modes (docs/dra.md): the extender never places on a node whose agent
serves DRA (annotation `tessera.io/allocation-mode: dra`); the node is refused with a reason
that says so, and becomes usable again once the annotation goes. Real NATS, the in-memory
cluster's node watch."""

from __future__ import annotations

from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster

from .conftest import MakeService, register, unique, wait_until
from .factories import container, node, pod


def node_object(name: str, dra: bool) -> dict:
    annotations = {"tessera.io/allocation-mode": "dra"} if dra else {}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": annotations}}  # fmt: skip


async def test_the_extender_leaves_dra_nodes_to_the_allocator(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    dra_node, extender_node = unique("dra"), unique("ext")
    for name in (dra_node, extender_node):
        await register(buckets, node(name, gpus=1, memory_mib=24576))
    cluster.add_node(node_object(dra_node, True))
    cluster.add_node(node_object(extender_node, False))
    service = await make_service()
    await wait_until(lambda: dra_node in service.foreign.dra_nodes
                     and service.index.node(extender_node) is not None)  # fmt: skip

    first = cluster.add_pod(pod(container(mem=1000)))
    outcome = await service.scheduler.filter(first, [dra_node])
    assert not outcome.nodenames, "the extender placed a pod on a node in DRA mode"
    assert outcome.failed[dra_node].startswith("NodeInDRAMode: this node's GPUs are allocated "
                                               "through DRA")  # fmt: skip

    cluster.add_node(node_object(dra_node, False))  # the node went back to extender mode
    await wait_until(lambda: dra_node not in service.foreign.dra_nodes)
    second = cluster.add_pod(pod(container(mem=1000)))
    outcome = await service.scheduler.filter(second, [dra_node])
    assert outcome.nodenames == [dra_node]
    third = cluster.add_pod(pod(container(mem=1000)))
    outcome = await service.scheduler.filter(third, [extender_node])
    assert outcome.nodenames == [extender_node]
