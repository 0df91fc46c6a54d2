"""The namespace quota counts NVIDIA's GPUs, memory and cores only (an Ascend, MLU or DCU pod's
devices are Kubernetes' ResourceQuota's to count): when the quota's reconcile gives a held
allocation whose charge is missing its charge back (the quota store lost or wiped), an MLU pod's
devices are not charged as NVIDIA memory and cores, and a pod mixing both is charged its NVIDIA
containers only. Real NATS, the quota service's own reconcile pass."""

from __future__ import annotations

import uuid

from quota_testkit import call, eventually, unique_namespace

from tessera import bus
from tessera.bus import Buckets
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.settings import TesseraSettings

GPU = DeviceGrant(uuid="GPU-1", type="NVIDIA-A100", memory_mib=1000, cores=10)
MLU = DeviceGrant(uuid="MLU-1", type="MLU370-X4", memory_mib=4096, cores=50)


def held(ns: str, node: str, uid: str, containers: list[list[DeviceGrant]]) -> Allocation:
    """An allocation as the scheduler writes it with quota on (a vendor pod's too: its charge
    of nothing was held)."""
    return Allocation(pod_uid=uid, namespace=ns, name=f"pod-{uid}", node=node,
                      containers=containers, state=AllocationState.ALLOCATED,
                      quota_held=True)  # fmt: skip


async def test_a_lost_charge_comes_back_without_another_vendors_devices(
    start_quota, nc, buckets: Buckets
) -> None:
    await start_quota(TesseraSettings(quota_reconcile_interval_s=0.2, quota_grace_margin_s=0.2,
                                      reservation_ttl_s=0.3))  # fmt: skip
    ns, node = unique_namespace(), f"node-{uuid.uuid4().hex[:8]}"
    await call(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns,
                                                  limits=QuotaAmount(memory_mib=3000)))

    def mutate(ledger: NodeLedger | None) -> NodeLedger:  # both in one write: one snapshot
        ledger = ledger.model_copy(deep=True) if ledger else NodeLedger(node=node)
        for allocation in (held(ns, node, "mlu", [[MLU]]),
                           held(ns, node, "mixed", [[GPU], [MLU]])):  # fmt: skip
            ledger.allocations[allocation.pod_uid] = allocation
        return ledger

    await bus.cas_update(buckets.ledger, node, NodeLedger, mutate)

    async def charges() -> dict:
        reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
        assert isinstance(reply, QuotaReply), reply
        return reply.states[0].charges

    restored = await eventually(lambda: _when(charges, "mixed"), timeout=10)
    assert set(restored) == {"mixed"}, "an MLU pod was charged NVIDIA quota"
    mixed = restored["mixed"]
    assert (mixed.memory_mib, mixed.cores, mixed.gpus) == (1000, 10, 1)
    # what is left is NVIDIA's to use: 2000 MiB (the MLUs' 8 GiB never counted)
    reply = await call(nc, bus.QUOTA_RESERVE, QuotaRequest(
        namespace=ns, pod_uid="next", memory_mib=2000, cores=10, gpus=1))
    assert reply.ok, reply.reason


async def _when(charges, uid: str) -> dict | None:
    found = await charges()
    return found if uid in found else None
