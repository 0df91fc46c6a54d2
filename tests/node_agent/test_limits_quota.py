"""limits.set keeps the ledger, the namespace quota and the pod's annotation in step (real NATS,
the real quota service, the device plugin over real gRPC)."""

from __future__ import annotations

import contextlib
import uuid

from node_agent_rig import grants, running_rig
from tessera.quota.service import QuotaService

from tessera import bus, hami
from tessera.bus import connect, ensure_bus
from tessera.codec import decode, encode
from tessera.models import (
    LimitsSetReply,
    LimitsSetRequest,
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.settings import NatsSettings, TesseraSettings


async def ask(nc, subject: str, body, model):  # type: ignore[no-untyped-def]
    return decode((await nc.request(subject, encode(body), timeout=5)).data, model)


@contextlib.asynccontextmanager
async def quota_service(nats_url: str):  # type: ignore[no-untyped-def]
    client = await connect(NatsSettings(NATS_URL=nats_url), name="quota-for-limits")
    settings = TesseraSettings()
    consumer = f"quota-limits-{uuid.uuid4().hex[:8]}"
    service = QuotaService(client, await ensure_bus(client.jetstream(), settings), settings,
                           consumer=consumer)  # fmt: skip
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        with contextlib.suppress(Exception):
            await client.jetstream().delete_consumer(bus.EVENTS_STREAM, consumer)
        await client.drain()


async def test_limits_set_resizes_the_quota_charge_and_the_annotation(
    short_dir, nc, buckets, nats_url
):
    namespace = f"lim-{uuid.uuid4().hex[:6]}"
    async with quota_service(nats_url), running_rig(short_dir, nc, buckets) as rig:
        gpu = rig.gpus[0]
        assert (await ask(nc, bus.QUOTA_SET, QuotaSetRequest(
            namespace=namespace, limits=QuotaAmount(memory_mib=5000)), QuotaReply)).ok
        pod = {
            "metadata": {"name": "grow", "namespace": namespace, "uid": f"uid-{namespace}"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {
                "nvidia.com/gpu": 1, "nvidia.com/gpumem": 2000, "nvidia.com/gpucores": 30}}}]},
        }  # fmt: skip
        uid = pod["metadata"]["uid"]
        # What the scheduler does: hold the charge, then record the allocation as holding it.
        assert (await ask(nc, bus.QUOTA_RESERVE, QuotaRequest(
            namespace=namespace, pod_uid=uid, name="grow", memory_mib=2000, cores=30, gpus=1,
        ), QuotaReply)).ok  # fmt: skip
        await rig.bind(pod, [grants((gpu, 2000, 30))])

        def held(ledger: NodeLedger | None) -> NodeLedger:
            assert ledger is not None
            ledger.allocations[uid].quota_held = True
            return ledger

        await bus.cas_update(buckets.ledger, rig.node, NodeLedger, held)
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error

        async def charge() -> int:
            status = await ask(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=namespace),
                               QuotaReply)  # fmt: skip
            return status.states[0].charges[uid].memory_mib

        target = {"namespace": namespace, "pod": "grow", "container": "main"}
        reply = await ask(nc, bus.node_limits_subject(rig.node),
                          LimitsSetRequest(memory_mib=4000, **target), LimitsSetReply)
        assert reply.ok, reply.reason
        assert await charge() == 4000
        annotations = rig.cluster.pods[(namespace, "grow")]["metadata"]["annotations"]
        recorded = hami.decode_pod_devices(annotations[hami.ANN_DEVICES_ALLOCATED])
        assert [(g.uuid, g.memory_mib, g.cores) for g in recorded[0]] == [(gpu, 4000, 30)]
        # Past the namespace quota: refused before anything changes.
        reply = await ask(nc, bus.node_limits_subject(rig.node),
                          LimitsSetRequest(memory_mib=6000, **target), LimitsSetReply)
        assert not reply.ok and "quota" in reply.reason
        assert await charge() == 4000
        grant = (await rig.ledger()).allocations[uid].containers[0][0]
        assert grant.memory_mib == 4000
        # A value no GPU here holds is rejected by validation, not by a later check.
        reply = await ask(nc, bus.node_limits_subject(rig.node),
                          LimitsSetRequest(memory_mib=10**9, **target), LimitsSetReply)
        assert not reply.ok and "more than GPU" in reply.reason
