"""A lost quota state gives running DRA pods their charges back (issue 31): a pod the DRA
allocator placed carries no HAMi annotations; its slice is read from its ResourceClaims (the
driver's own reading, against the node's registered GPUs), in the same rebuild as every other
pod's charge. Real NATS, the in-memory cluster."""

from __future__ import annotations

import uuid
from typing import Any

from tessera import bus
from tessera.bus import connect, ensure_bus
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode, encode
from tessera.dra_names import DRIVER_NAME
from tessera.models import DeviceInfo, NodeRegistration, QuotaReply, QuotaStatusRequest
from tessera.settings import NatsSettings, TesseraSettings


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_a_running_dra_pods_charge_is_rebuilt_from_its_claim(
    start_quota: Any, nats_url: str
) -> None:
    node, namespace = unique("dra-node"), unique("dra-ns")
    nc = await connect(NatsSettings(NATS_URL=nats_url), name="dra-charges-test")
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        card = DeviceInfo(uuid=f"GPU-{node}", index=0, type="NVIDIA-H100", memory_mib=16384,
                          cores=100, split_count=10)  # fmt: skip
        await buckets.nodes.put(node, encode(NodeRegistration(node=node, devices=[card])))
        cluster = InMemoryCluster(implicit_nodes=True)
        pod = cluster.add_pod({
            "metadata": {"name": "train", "namespace": namespace},
            "spec": {"nodeName": node,
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": "train-gpu"}],
                     "containers": [{"name": "main", "image": "x",
                                     "resources": {"claims": [{"name": "gpu"}]}}]},
            "status": {"phase": "Running"},
        })  # fmt: skip
        cluster.put_resource_claim({
            "metadata": {"name": "train-gpu", "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER_NAME}}]}},
            "status": {
                "allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": DRIVER_NAME, "pool": node, "device": "gpu-0",
                    "consumedCapacity": {"memory": "4Gi", "cores": "30"}}]}},
                "reservedFor": [{"resource": "pods", "name": "train",
                                 "uid": pod["metadata"]["uid"]}],
            },
        })  # fmt: skip

        await start_quota(cluster=cluster)  # the quota state has nothing of this namespace

        reply = await nc.request(bus.QUOTA_STATUS, encode(QuotaStatusRequest(
            namespace=namespace)), timeout=10)  # fmt: skip
        [state] = decode(reply.data, QuotaReply).states
        used = state.used()
        assert (used.memory_mib, used.cores) == (4096, 30), used
        assert pod["metadata"]["uid"] in state.charges
    finally:
        await nc.close()
