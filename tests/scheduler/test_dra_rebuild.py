"""A lost ledger is rebuilt with the DRA pods too (issue 31): a pod kube-scheduler's structured
allocator placed carries no HAMi annotations, its slice is in its ResourceClaims' allocation.
The rebuild reads the claims (tessera.dra_restore, with the driver's own reading of a claim), so
after NATS lost its store the card a running DRA pod holds is not given to an extender pod even
when no node agent restores it (down, switched back to extender mode, or its records lost); a
claim that cannot be true is reported and never overcommits a card."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

from tessera import bus
from tessera.bus import connect, ensure_bus
from tessera.cluster.memory import InMemoryCluster
from tessera.dra_names import DRA_REASON, DRIVER_NAME
from tessera.dra_restore import allocations_from_claims
from tessera.models import DeviceGrant, NodeLedger
from tessera.restore import RestoreReport, RestoreRules, checked_restore
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats

from .conftest import MakeService, register, unique, wait_until
from .factories import GIB, container, node, pod


def dra_pod(namespace: str, node_name: str, *, init: bool = False,
            phase: str = "Running") -> dict[str, Any]:  # fmt: skip
    """A running pod whose second container (after an init container, when `init`) uses a
    claim made from a template (its name in `status.resourceClaimStatuses`)."""
    name = unique("dra")
    spec: dict[str, Any] = {
        "nodeName": node_name,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "slice"}],
        "containers": [{"name": "side", "image": "x"},
                       {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
    }  # fmt: skip
    if init:
        spec["initContainers"] = [{"name": "setup", "image": "x"}]
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
        "status": {"phase": phase,
                   "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]},
    }  # fmt: skip


def claim_for(spec: dict[str, Any], pool: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The claim the allocator made for the pod: allocated, reserved for it."""
    meta = spec["metadata"]
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": f"{meta['name']}-gpu", "namespace": meta["namespace"],
                     "uid": unique("claim")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER_NAME}}]}},
        "status": {
            "allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER_NAME, "pool": pool, **r} for r in results]}},
            "reservedFor": [{"resource": "pods", "name": meta["name"], "uid": meta["uid"]}],
        },
    }  # fmt: skip


def slice_of(device: str, memory: str, cores: str) -> dict[str, Any]:
    return {"device": device, "consumedCapacity": {"memory": memory, "cores": cores},
            "shareID": unique("share")}  # fmt: skip


def with_uid(spec: dict[str, Any]) -> dict[str, Any]:
    spec["metadata"]["uid"] = unique("uid")
    return spec


# --- pure: what a claim says a running pod holds ------------------------------------------------


def test_a_claims_consumed_capacity_is_read_back_as_the_pods_allocation() -> None:
    registration = node("n1", gpus=2, memory_mib=16 * GIB)
    spec = with_uid(dra_pod("team", "n1", init=True))
    claim = claim_for(spec, "n1", [slice_of("gpu-1", "4Gi", "30")])
    claim["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "nic.example.com", "pool": "n1", "device": "eth0"})
    report = RestoreReport()
    by_node = allocations_from_claims(
        [claim], {spec["metadata"]["uid"]: spec}, {"n1": registration.devices}.get,
        quota_held=True, now=100.0, report=report,
    )  # fmt: skip
    [(allocation, no_claim)] = by_node["n1"]
    assert no_claim is None and report.refused == [] and report.gpu_pods == 1
    assert allocation.reason == DRA_REASON and allocation.quota_held
    assert allocation.container_names == ["setup", "side", "main"]
    assert allocation.init_count == 1
    # the claim's slice on the card the pool's gpu-1 is, on the container naming the claim
    assert allocation.containers == [[], [], [DeviceGrant(
        uuid=registration.devices[1].uuid, type="NVIDIA-H100", memory_mib=4096, cores=30)]]


def test_claims_that_cannot_be_true_are_reported_and_not_restored() -> None:
    registration = node("n1", gpus=1, memory_mib=16 * GIB)
    pods, claims = {}, []
    for results in ([slice_of("gpu-7", "1Gi", "10")],  # no such card on the node
                    [slice_of("gpu-0", "17Gi", "10")],  # more memory than the card has
                    [slice_of("gpu-0", "1Gi", "101")]):  # more than a card's compute
        spec = with_uid(dra_pod("team", "n1"))
        pods[spec["metadata"]["uid"]] = spec
        claims.append(claim_for(spec, "n1", results))
    elsewhere = with_uid(dra_pod("team", "n2"))  # bound to another node than the claim's pool
    pods[elsewhere["metadata"]["uid"]] = elsewhere
    claims.append(claim_for(elsewhere, "n1", [slice_of("gpu-0", "1Gi", "10")]))
    ended = with_uid(dra_pod("team", "n1", phase="Succeeded"))
    pods[ended["metadata"]["uid"]] = ended
    claims.append(claim_for(ended, "n1", [slice_of("gpu-0", "1Gi", "10")]))
    report = RestoreReport()
    by_node = allocations_from_claims(claims, pods, {"n1": registration.devices}.get,
                                      quota_held=False, now=0.0, report=report)  # fmt: skip
    assert dict(by_node) == {}
    assert len(report.refused) == 3, report.refused
    assert "device 'gpu-7' is not one this node offers" in report.refused[0]
    assert "17408 MiB of gpu-0, which offers 16384 MiB" in report.refused[1]
    assert "101 % of gpu-0's compute" in report.refused[2]


def test_restored_claims_never_overcommit_a_card() -> None:
    """Two claims whose slices together exceed the card (a forged status, or a card that shrank):
    one is restored, the other reported; the card is never held beyond its capacity."""
    registration = node("n1", gpus=1, memory_mib=16 * GIB)
    pods, claims = {}, []
    for _ in range(2):
        spec = with_uid(dra_pod("team", "n1"))
        pods[spec["metadata"]["uid"]] = spec
        claims.append(claim_for(spec, "n1", [slice_of("gpu-0", "10Gi", "40")]))
    report = RestoreReport()
    found = allocations_from_claims(claims, pods, {"n1": registration.devices}.get,
                                    quota_held=False, now=0.0, report=report)["n1"]  # fmt: skip
    assert len(found) == 2
    devices = {d.uuid: d for d in registration.devices}
    kept = checked_restore("n1", found, pods, devices, [], RestoreRules(TesseraSettings()), report)
    assert len(kept) == 1 and kept[0][0].containers[1][0].memory_mib == 10 * GIB
    assert any("would hold 20480 MiB of 16384 MiB" in line for line in report.refused)


# --- a wiped store under a running DRA pod ------------------------------------------------------


async def test_a_wiped_store_under_a_running_dra_pod_gives_its_card_to_no_one(
    fresh_nats: EmbeddedNats, make_service: MakeService, cluster: InMemoryCluster,
) -> None:
    """A DRA pod runs with 4 GiB / 30 % of the node's only card (its claim allocated by the
    DRA allocator, its ledger entry written by the driver). NATS loses its whole store; no node
    agent restores the entry (its agent is down, or was switched back to extender mode: the
    node is not marked DRA). Before the scheduler serves again, the ledger holds the DRA pod's
    slice, read from its claim: an extender pod asking more than the 12 GiB left is refused,
    one asking the rest fits."""
    settings = TesseraSettings(quota_enabled=False)
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="dra-wipe-test")
    try:
        buckets = await ensure_bus(nc.jetstream(), settings)
        registration = node(unique("dra-wipe"), gpus=1, memory_mib=16 * GIB)
        name = registration.node
        await register(buckets, registration)
        service = await make_service(keeper=True, url=fresh_nats.url)
        await wait_until(lambda: service.index.node(name) is not None)
        spec = cluster.add_pod(dra_pod("default", name))
        uid = spec["metadata"]["uid"]
        cluster.put_resource_claim(claim_for(spec, name, [slice_of("gpu-0", "4Gi", "30")]))

        fresh_nats.stop()
        shutil.rmtree(fresh_nats.data_dir / "jetstream")
        fresh_nats.start()
        keeper = service.keeper
        assert keeper is not None
        await wait_until(lambda: keeper.generation >= 1)
        for _ in range(100):  # the node agent's next heartbeat, once the bucket is back
            try:
                await register(buckets, registration)
                break
            except Exception:
                await asyncio.sleep(0.1)
        await wait_until(lambda: service.ready(), 30)

        after = await bus.read(buckets.ledger, name, NodeLedger)
        assert after is not None and set(after.value.allocations) == {uid}
        restored = after.value.allocations[uid]
        assert restored.reason == DRA_REASON and restored.active
        assert restored.containers == [[], [DeviceGrant(
            uuid=registration.devices[0].uuid, type="NVIDIA-H100", memory_mib=4096, cores=30)]]
        await wait_until(lambda: service.index.node(name) is not None
                         and service.index.node(name).registration is not None, 10)  # fmt: skip
        too_big = cluster.add_pod(pod(container(mem=12 * GIB + 1)))
        outcome = await service.scheduler.filter(too_big, [name])
        assert not outcome.nodenames, f"the DRA pod's card was given away: {outcome}"
        fits = cluster.add_pod(pod(container(mem=12 * GIB)))
        outcome = await service.scheduler.filter(fits, [name])
        assert outcome.nodenames == [name], outcome
    finally:
        await nc.close()
