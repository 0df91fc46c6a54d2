"""MIG and MPS through Tessera's DRA driver (docs/dra.md, "MIG and MPS"), as kubelet calls it over
real unix-socket gRPC, with real NATS.

A card in dynamic MIG is published as KEP-4815 partitions (one device per profile placement,
consuming its card's memory-slice and compute-slice counters, in a pool of two slices that
kube-sim's API validation accepts); a claim allocated one partition gets that MIG instance made
(the simulated NVML of the local stack) and only its UUID in the container; unpreparing destroys
it. An MPS card's claim, MPS selected by the opaque configuration, gets its own control daemon
(the fake nvidia-cuda-mps-control) holding exactly the claim's share before the CDI spec exists;
a configuration the driver cannot apply is refused with a sentence and nothing is prepared."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from pathlib import Path

import pytest
from tessera.kube_sim.dra.slices import validate_slice
from tessera.node_agent.devices import PhysicalGpu
from tessera.node_agent.dra import cdi
from tessera.node_agent.mig_dynamic import MigReconciler
from tessera.node_agent.mig_service import DynamicMig
from tessera.node_agent.mig_sim import SimulatedMig
from tessera.node_agent.mps import MpsDaemons
from tessera.node_agent.state import DeviceState
from test_dra_driver import Harness, pod_and_claim

from tessera import dra_names as names
from tessera.cluster.memory import InMemoryCluster
from tessera.models import DeviceInfo, MigCapability, MigState
from tessera.region import read_limits

FAKE_MPS = Path(__file__).parent / "fake_mps_control.py"
A100 = "A100-SXM4-80GB"


def cards() -> list[DeviceInfo]:
    tag = uuid.uuid4().hex[:8]
    return [
        DeviceInfo(uuid=f"GPU-mig-{tag}", index=0, type=f"NVIDIA-{A100}", memory_mib=81920,
                   mode="mig", mig=MigCapability(model=A100)),
        DeviceInfo(uuid=f"GPU-slc-{tag}", index=1, type=f"NVIDIA-{A100}", memory_mib=16000,
                   split_count=4),
        DeviceInfo(uuid=f"GPU-mps-{tag}", index=2, type=f"NVIDIA-{A100}", memory_mib=16000,
                   split_count=4, mode="mps"),
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def harness(base: Path, nc, buckets, node: str, cluster: InMemoryCluster):
    h = Harness(base, nc, buckets, node, cluster)
    h.state = DeviceState(cards())
    h.driver.state = h.state
    gpus = [PhysicalGpu(uuid=d.uuid, index=d.index, name=A100, memory_mib=d.memory_mib, mig=True)
            for d in h.state.devices() if d.mode == "mig"]  # fmt: skip
    h.nvml = SimulatedMig(gpus, str(base / "mig.json"))  # type: ignore[attr-defined]
    js = nc.jetstream()
    log = logging.getLogger("test.dra.mig")
    reconciler = MigReconciler(node=node, handles=h.nvml.handles, list_devices=h.nvml.list_devices,
                               create=h.nvml.create, destroy=h.nvml.destroy, js=js, log=log,
                               clock=lambda: 0.0)  # type: ignore[attr-defined]  # fmt: skip
    h.driver.mig = DynamicMig(node=node, reconciler=reconciler, ledger_kv=buckets.ledger, js=js,
                              cluster=None, log=log)  # fmt: skip
    h.driver.mps = MpsDaemons(binary=str(FAKE_MPS),
                              root=Path(h.settings.region_host_dir) / ".mps", node=node, log=log)
    try:
        async with h:
            yield h
    finally:
        for daemon in list(h.driver.mps.daemons.values()):
            with contextlib.suppress(Exception):
                daemon.quit()


@pytest.fixture
def node() -> str:
    return f"dra-{uuid.uuid4().hex[:8]}"


def partition_claim(node: str, device: str):
    pod, claim = pod_and_claim(node, device, "0", "0")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    del result["consumedCapacity"], result["shareID"]  # a partition is allocated whole
    return pod, claim


def spec_of(h, claim) -> dict:
    return json.loads(cdi.spec_path(h.dra.cdi_dir, claim["metadata"]["uid"]).read_text())


async def test_a_mig_card_is_published_as_partitions_with_shared_counters(
        short_dir, nc, buckets, node):  # fmt: skip
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster):
        pool = await cluster.list_resource_slices(driver=names.DRIVER_NAME, node=node)
        assert len(pool) == 2 and {s["spec"]["pool"]["resourceSliceCount"] for s in pool} == {2}
        for published in pool:  # what kube-apiserver's validation says of each
            assert validate_slice(published) == [], published["metadata"]["name"]
        devices = next(s for s in pool if s["spec"].get("devices"))["spec"]["devices"]
        [counters] = next(s for s in pool if s["spec"].get("sharedCounters"))["spec"][
            "sharedCounters"]
        assert counters["name"] == "gpu-0-counters"
        assert counters["counters"]["compute-slices"] == {"value": "7"}
        assert sorted(counters["counters"]) == sorted(
            ["compute-slices", *(f"memory-slice-{k}" for k in range(8))])
        by_name = {d["name"]: d for d in devices}
        assert {"gpu-1", "gpu-2"} <= set(by_name) and "gpu-0" not in by_name
        assert by_name["gpu-2"]["attributes"]["mode"] == {"string": "mps"}
        partitions = [d for d in devices if d["name"].startswith("gpu-0-mig-")]
        assert len(partitions) == 18  # 7 + 4 + 3 + 2 + 1 + 1 placements of an 8-slice card
        three = by_name["gpu-0-mig-3g-40gb-4"]
        assert three["attributes"]["profile"] == {"string": "3g.40gb"}
        assert three["capacity"]["memory"] == {"value": "40960Mi"}
        assert "allowMultipleAllocations" not in three
        [use] = three["consumesCounters"]
        assert use["counterSet"] == "gpu-0-counters"
        assert use["counters"] == {**{f"memory-slice-{k}": {"value": "1"} for k in (4, 5, 6, 7)},
                                   "compute-slices": {"value": "3"}}  # fmt: skip


async def test_a_partition_claim_gets_its_mig_instance_and_unprepare_destroys_it(
        short_dir, nc, buckets, node):  # fmt: skip
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        pod, claim = partition_claim(node, "gpu-0-mig-3g-40gb-4")
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert answer.error == ""
        [instance] = h.nvml.list_devices(h.nvml.handles[h.state.devices()[0].uuid][0], 0)
        assert (instance.profile, instance.start) == ("3g.40gb", 4)
        edits = spec_of(h, claim)["devices"][0]["containerEdits"]
        assert f"NVIDIA_VISIBLE_DEVICES={instance.uuid}" in edits["env"]
        assert edits["mounts"] == []  # a MIG instance only: the hardware isolates it
        ledger = await h.ledger()
        [[grant]] = ledger.allocations[pod["metadata"]["uid"]].containers[:1]
        assert grant.mig is not None and grant.mig.mig_uuid == instance.uuid
        assert grant.mig.state == MigState.CREATED and grant.memory_mib == 40960

        # a placement the hardware cannot hold beside it (7g spans every slice): refused, kept
        pod2, claim2 = partition_claim(node, "gpu-0-mig-7g-80gb-0")
        cluster.add_pod(pod2)
        cluster.put_resource_claim(claim2)
        refused = (await h.kubelet_prepare(claim2)).claims[claim2["metadata"]["uid"]]
        assert "7g.80gb" in refused.error and "Insufficient Resources" in refused.error
        assert not cdi.spec_path(h.dra.cdi_dir, claim2["metadata"]["uid"]).exists()

        assert (await h.kubelet_unprepare(claim)).claims[claim["metadata"]["uid"]].error == ""
        assert h.nvml.list_devices(h.nvml.handles[h.state.devices()[0].uuid][0], 0) == []
        ledger = await h.ledger()
        entry = ledger.allocations[pod["metadata"]["uid"]]
        assert not any(entry.containers)  # holds nothing; the scheduler releases the ended pod
        # the placement is free again: kubelet's retry of the other claim now succeeds
        again = (await h.kubelet_prepare(claim2)).claims[claim2["metadata"]["uid"]]
        assert again.error == ""


MPS_CONFIG = {"source": "FromClass", "requests": [], "opaque": {
    "driver": names.DRIVER_NAME,
    "parameters": {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig",
                   "sharing": {"strategy": "MPS"}}}}  # fmt: skip


async def test_an_mps_claim_gets_its_own_daemon_holding_its_share(short_dir, nc, buckets, node):
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        pod, claim = pod_and_claim(node, "gpu-2", "4Gi", "30")
        claim["status"]["allocation"]["devices"]["config"] = [MPS_CONFIG]
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert answer.error == ""
        edits = spec_of(h, claim)["devices"][0]["containerEdits"]
        mounts = {m["containerPath"]: m for m in edits["mounts"]}
        pipe = Path(mounts["/run/tessera/mps"]["hostPath"])
        assert "rw" in mounts["/run/tessera/mps"]["options"]
        assert "CUDA_MPS_PIPE_DIRECTORY=/run/tessera/mps" in edits["env"]
        log = (pipe.parent / "log" / "control.log").read_text()
        assert "set_default_device_pinned_mem_limit 0 4096M" in log
        assert "set_default_active_thread_percentage 30" in log
        sealed = read_limits(mounts["/run/tessera/limits"]["hostPath"])
        assert sealed is not None
        # libvgpu keeps the memory limit; compute is the MPS server's
        assert [(d.mem_limit_bytes, d.sm_limit_pct) for d in sealed.devices] == [(4096 << 20, 100)]


async def test_an_mps_claim_on_two_cards_is_refused(short_dir, nc, buckets, node):
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        await h.state.update([*h.state.devices(), h.state.devices()[2].model_copy(
            update={"uuid": "GPU-mps-2", "index": 3})])
        pod, claim = pod_and_claim(node, "gpu-2", "4Gi", "30")
        results = claim["status"]["allocation"]["devices"]["results"]
        results.append({**results[0], "device": "gpu-3", "shareID": "other"})
        claim["status"]["allocation"]["devices"]["config"] = [MPS_CONFIG]
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert "an MPS claim holds one card" in answer.error, answer.error
        assert not h.driver.mps.daemons  # no daemon started for it


@pytest.mark.parametrize(("device", "parameters", "expected"), [
    ("gpu-1", {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS"}}, "not in MPS mode"),
    ("gpu-2", {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "TimeSlicing"}}, "is in MPS mode"),
    ("gpu-1", {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "Bogus"}}, "sharing.strategy"),
    ("gpu-1", {"apiVersion": "gpu.tessera.io/v1", "kind": "GpuConfig"}, "apiVersion"),
    ("gpu-1", {"apiVersion": "gpu.tessera.io/v1alpha1", "kind": "GpuConfig", "mps": {}},
     "mps: Extra inputs are not permitted"),
    ("gpu-1", "MPS", "parameters must be an object"),
])  # fmt: skip
async def test_a_configuration_the_driver_cannot_apply_is_refused_with_a_sentence(
        short_dir, nc, buckets, node, device, parameters, expected):  # fmt: skip
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        pod, claim = pod_and_claim(node, device, "4Gi", "30")
        claim["status"]["allocation"]["devices"]["config"] = [{
            "source": "FromClaim", "requests": ["gpu"],
            "opaque": {"driver": names.DRIVER_NAME, "parameters": parameters}}]  # fmt: skip
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert expected in answer.error, answer.error
        assert not cdi.spec_path(h.dra.cdi_dir, claim["metadata"]["uid"]).exists()
        assert (await h.ledger()) is None or pod["metadata"]["uid"] not in (
            await h.ledger()).allocations


async def test_a_claim_naming_the_mig_card_whole_or_an_unknown_partition_is_refused(
        short_dir, nc, buckets, node):  # fmt: skip
    """The card in dynamic MIG is offered only as its partitions: an allocation naming it whole
    (or a placement it does not have) is refused, never sealed as a slice of it."""
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        for device in ("gpu-0", "gpu-0-mig-4g-40gb-4"):
            pod, claim = partition_claim(node, device)
            cluster.add_pod(pod)
            cluster.put_resource_claim(claim)
            answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
            assert f"device '{device}' is not one this node offers" in answer.error
            assert not cdi.spec_path(h.dra.cdi_dir, claim["metadata"]["uid"]).exists()
        assert h.nvml.list_devices(h.nvml.handles[h.state.devices()[0].uuid][0], 0) == []


def test_a_node_of_eight_mig_cards_spreads_its_pool_over_valid_slices() -> None:
    """144 partitions (at most 64 a slice when they consume counters) and 8 counter sets (at
    most 8 a slice): three device slices and one counter slice, each valid for the API."""
    from tessera.node_agent.dra.slices import build_slices

    eight = [DeviceInfo(uuid=f"GPU-{i}", index=i, type=f"NVIDIA-{A100}", memory_mib=81920,
                        mode="mig", mig=MigCapability(model=A100)) for i in range(8)]
    pool = build_slices("n", eight, generation=3, driver_version="560.35.03")
    assert [len(s["spec"].get("devices") or []) for s in pool] == [64, 64, 16, 0]
    assert [len(s["spec"].get("sharedCounters") or []) for s in pool] == [0, 0, 0, 8]
    assert [s["metadata"]["name"] for s in pool] == [
        "n-gpu.tessera.io", "n-gpu.tessera.io-1", "n-gpu.tessera.io-2", "n-gpu.tessera.io-3"]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in pool} == {(3, 4)}  # fmt: skip
    for published in pool:
        assert validate_slice(published) == []


async def test_a_pool_that_shrinks_drops_the_slices_it_no_longer_has(short_dir, nc, buckets, node):
    """The card leaves dynamic MIG (node configuration): one slice is left, at a new generation;
    the counter slice is deleted."""
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        before = await cluster.list_resource_slices(driver=names.DRIVER_NAME, node=node)
        assert len(before) == 2
        plain = [d.model_copy(update={"mode": "hami-core", "mig": None})
                 if d.mode == "mig" else d for d in h.state.devices()]  # fmt: skip
        await h.state.update(plain)

        async def one_slice() -> list[dict]:
            found = await cluster.list_resource_slices(driver=names.DRIVER_NAME, node=node)
            return found if len(found) == 1 else []

        deadline = asyncio.get_running_loop().time() + 15
        while not (after := await one_slice()):
            assert asyncio.get_running_loop().time() < deadline, "the counter slice stayed"
            await asyncio.sleep(0.05)
        [published] = after
        assert published["spec"]["pool"]["resourceSliceCount"] == 1
        assert published["spec"]["pool"]["generation"] > before[0]["spec"]["pool"]["generation"]
        assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-0", "gpu-1", "gpu-2"]


async def test_a_restarted_agent_keeps_the_instance_of_a_prepared_claim(
        short_dir, nc, buckets, node):  # fmt: skip
    """After a restart (a new reconciler that made nothing itself), the instance the ledger
    records for the prepared claim is adopted, never destroyed as an orphan; unpreparing the
    claim still destroys it."""
    cluster = InMemoryCluster()
    async with harness(short_dir, nc, buckets, node, cluster) as h:
        pod, claim = partition_claim(node, "gpu-0-mig-1g-10gb-6")
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        assert (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]].error == ""
        handle = h.nvml.handles[h.state.devices()[0].uuid][0]
        [made] = h.nvml.list_devices(handle, 0)
        log = logging.getLogger("test.dra.mig.restarted")
        fresh = MigReconciler(node=node, handles=h.nvml.handles, list_devices=h.nvml.list_devices,
                              create=h.nvml.create, destroy=h.nvml.destroy, js=nc.jetstream(),
                              log=log, clock=lambda: 1e9, grace_s=0.0)  # fmt: skip
        h.driver.mig = DynamicMig(node=node, reconciler=fresh, ledger_kv=buckets.ledger,
                                  js=nc.jetstream(), cluster=None, log=log)  # fmt: skip
        await h.driver.reconcile()  # what a restarted driver does first
        outcome = await h.driver.mig.reconcile_once()
        assert not outcome.destroyed and not outcome.vanished
        assert [d.uuid for d in h.nvml.list_devices(handle, 0)] == [made.uuid]
        assert (await h.kubelet_unprepare(claim)).claims[claim["metadata"]["uid"]].error == ""
        assert h.nvml.list_devices(handle, 0) == []
