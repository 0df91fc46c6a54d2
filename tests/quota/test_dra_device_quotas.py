"""Tessera's quota shows Kubernetes' DRA device quotas where it shows quotas (`status`,
`tessera quota get|list`): the ResourceQuota's `<class>.deviceclass.resource.k8s.io/devices`
(and kin) with the hard limit and what the quota controller counted, beside Tessera's own GPU
limits. kube-apiserver counts and enforces them (kube-sim: tests/kube_sim/test_dra_quota.py);
Tessera neither charges nor enforces them, so its own limits stay what they were."""

from __future__ import annotations

import asyncio

from quota_testkit import call, eventually, unique_namespace
from typer.testing import CliRunner

from tessera import bus
from tessera.cluster.memory import InMemoryCluster
from tessera.models import DeviceQuota, QuotaAmount, QuotaReply, QuotaStatusRequest
from tessera_cli.app import build_app

DEVICES = "gpu.tessera.io.deviceclass.resource.k8s.io/devices"
IMPLICIT = "requests.deviceclass.resource.kubernetes.io/gpu.tessera.io"


def resource_quota(ns: str, name: str, hard: dict, used: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
            "spec": {"hard": hard}, "status": {"hard": hard, "used": used or {}}}  # fmt: skip


async def test_device_quotas_are_shown_beside_tesseras_limits(start_quota, nc, nats_url,
                                                              monkeypatch) -> None:  # fmt: skip
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("COLUMNS", "200")
    cluster = InMemoryCluster()
    dra_only, mixed = unique_namespace("dra"), unique_namespace("mixed")
    cluster.put_quota(resource_quota(dra_only, "gpus", {DEVICES: "4", "pods": "10"},
                                     {DEVICES: "3", "pods": "2"}))  # fmt: skip
    cluster.put_quota(resource_quota(mixed, "team", {
        "limits.nvidia.com/gpumem": "8000", IMPLICIT: "2",
        "count/resourceclaims.resource.k8s.io": "5"}))
    await start_quota(cluster=cluster)

    async def status(ns: str) -> QuotaReply | None:
        reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
        return reply if isinstance(reply, QuotaReply) and reply.device_quotas else None

    reply = await eventually(lambda: status(dra_only))
    assert reply.states == []  # no Tessera limit nor charge there: still an answer
    assert reply.device_quotas == [DeviceQuota(namespace=dra_only, quota="gpus", key=DEVICES,
                                               hard="4", used="3")]  # fmt: skip
    async def limited(ns: str) -> QuotaReply | None:
        reply = await status(ns)
        return reply if reply is not None and reply.states else None

    reply = await eventually(lambda: limited(mixed))  # once the listed limits are applied
    assert reply.states[0].limits == QuotaAmount(memory_mib=8000)  # Tessera's, unchanged
    assert [(q.key, q.hard, q.used) for q in reply.device_quotas] == [
        ("count/resourceclaims.resource.k8s.io", "5", ""), (IMPLICIT, "2", "")]

    result = await asyncio.to_thread(CliRunner().invoke, build_app(),
                                     ["quota", "get", dra_only])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "DRA device quotas" in result.output and DEVICES in result.output
    assert "3 / 4" in result.output
    result = await asyncio.to_thread(CliRunner().invoke, build_app(), ["quota", "list"])
    assert result.exit_code == 0 and "gpus" in result.output and "8,000 MiB" in result.output

    # the controller counts more; then the key is taken out of the object: gone here too
    cluster.put_quota(resource_quota(dra_only, "gpus", {DEVICES: "4"}, {DEVICES: "4"}))

    async def used_is_4() -> bool:
        reply = await status(dra_only)
        return reply is not None and reply.device_quotas[0].used == "4"

    await eventually(used_is_4)
    cluster.put_quota(resource_quota(dra_only, "gpus", {"pods": "10"}))

    async def unknown() -> bool:
        reply = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=dra_only))
        return not isinstance(reply, QuotaReply) and "unknown namespace" in reply.reason

    await eventually(unknown)
