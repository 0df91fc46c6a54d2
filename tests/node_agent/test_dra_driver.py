"""Tessera's DRA driver over real unix-socket gRPC, as kubelet calls it, with real NATS.

The test plays kubelet: it finds the registration socket, asks GetInfo, and calls
NodePrepareResources / NodeUnprepareResources on the endpoint it was given. The claims are
what kube-scheduler's allocator writes (status.allocation with consumedCapacity) and live in
the in-memory cluster behind the cluster port."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path

import grpc
import pytest
from tessera.node_agent.containers import ContainerStore
from tessera.node_agent.dra import cdi
from tessera.node_agent.dra.driver import DraDriver
from tessera.node_agent.dra.endpoint import DraEndpoint
from tessera.node_agent.dra.quota import DraQuota
from tessera.node_agent.dra.settings import DraSettings
from tessera.node_agent.leases import LeaseService
from tessera.node_agent.state import DeviceState
from tessera.quota import QuotaService

from tessera import bus
from tessera import dra_names as names
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode, encode
from tessera.kubeapi import (
    dra,
    dra_grpc,
    drahealth,
    drahealth_grpc,
    drahealth_v1,
    drahealth_v1_grpc,
    reg,
    reg_grpc,
)
from tessera.models import (
    DeviceInfo,
    NodeLedger,
    QuotaAmount,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaStatusRequest,
)
from tessera.region import LEASE_SOCKET_NAME, read_limits
from tessera.settings import TesseraSettings

GPU_TYPE = "NVIDIA-A100-SXM4-80GB"


def devices(split: int = 4) -> list[DeviceInfo]:
    return [
        DeviceInfo(
            uuid=f"GPU-{i:04d}-{uuid.uuid4().hex[:8]}",
            index=i,
            type=GPU_TYPE,
            memory_mib=16000,
            split_count=split,
            numa=i,
        )
        for i in range(2)
    ]


def pod_and_claim(
    node: str, device: str, memory: str, cores: str, *, two: bool = False, namespace: str = "team"
):
    pod_uid = str(uuid.uuid4())
    claim_uid = str(uuid.uuid4())
    name = f"p-{pod_uid[:6]}"
    claim_name = f"{name}-gpu-abcde"
    pod = {
        "metadata": {"name": name, "namespace": namespace, "uid": pod_uid},
        "spec": {
            "nodeName": node,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "slice"}],
            "containers": [
                {
                    "name": "main",
                    "resources": {"claims": [{"name": "gpu"}]},
                    # what the webhook makes of nvidia.com/priority: 0 (high)
                    "env": [{"name": "CUDA_TASK_PRIORITY", "value": "0"}],
                },
                {"name": "side", "resources": {}},
            ],
        },
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim_name}]},
    }
    results = [{
        "request": "gpu", "driver": names.DRIVER_NAME, "pool": node, "device": device,
        "consumedCapacity": {"memory": memory, "cores": cores, "slots": "1"},
        "shareID": uuid.uuid4().hex[:8],
    }]  # fmt: skip
    if two:
        results.append({"request": "gpu", "driver": "other.example.com", "pool": node,
                         "device": "x"})  # fmt: skip
    claim = {
        "metadata": {"name": claim_name, "namespace": namespace, "uid": claim_uid},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": names.DEVICE_CLASS}}]
            }
        },
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": name, "uid": pod_uid}],
        },
    }
    return pod, claim


class Harness:
    def __init__(
        self, base: Path, nc, buckets, node: str, cluster: InMemoryCluster, quota: bool = False,
        leases: bool = False,
    ) -> None:
        """`leases`: the agent's lease service beside the driver, its own sweeps never run
        (`self.leases`; the driver opens a claim's socket through its `ready`)."""
        self.base = base
        self.node = node
        self.cluster = cluster
        self.buckets = buckets
        self.settings = TesseraSettings(region_host_dir=str(base / "regions"),
                                        libvgpu_host_path="/opt/vgpu/libvgpu.so")  # fmt: skip
        self.dra = DraSettings(kubelet_dir=str(base / "kl"), cdi_dir=str(base / "cdi"),
                               driver_version="560.35.03")  # fmt: skip
        self.state = DeviceState(devices())
        self.store = ContainerStore(self.settings.region_host_dir)
        self.store.ensure_root()
        self.leases = LeaseService(self.store.all, version=lambda: self.store.version)
        self.driver = DraDriver(
            settings=self.settings,
            dra=self.dra,
            node=node,
            state=self.state,
            store=self.store,
            ledger_kv=buckets.ledger,
            js=nc.jetstream(),
            cluster=cluster,
            log=logging.getLogger("test.dra"),
            quota=DraQuota(nc, TesseraSettings()) if quota else None,
            lease_ready=self.leases.ready if leases else None,
        )
        self.endpoint = DraEndpoint(self.driver, poll_s=0.05)
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> Harness:
        self.task = asyncio.create_task(self.endpoint.run(self.stop))
        await wait_for(lambda: self.endpoint.registry_socket.exists()
                       and self.endpoint.publisher.publishes > 0)  # fmt: skip
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 10)
        await self.leases.close()

    async def kubelet_prepare(self, claim: dict) -> dra.NodePrepareResourcesResponse:
        info = await self.info()
        meta = claim["metadata"]
        async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as channel:
            return await dra_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[dra.Claim(
                    namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])]),
                timeout=10)  # fmt: skip

    async def kubelet_unprepare(self, claim: dict) -> dra.NodeUnprepareResourcesResponse:
        info = await self.info()
        meta = claim["metadata"]
        async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as channel:
            return await dra_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                dra.NodeUnprepareResourcesRequest(claims=[dra.Claim(
                    namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])]),
                timeout=10)  # fmt: skip

    async def info(self) -> reg.PluginInfo:
        async with grpc.aio.insecure_channel(f"unix://{self.endpoint.registry_socket}") as ch:
            return await reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=5)

    async def ledger(self) -> NodeLedger | None:
        current = await bus.read(self.buckets.ledger, self.node, NodeLedger)
        return current.value if current else None


async def wait_for(condition, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
def node() -> str:
    return f"dra-{uuid.uuid4().hex[:8]}"


async def test_registers_as_a_dra_plugin_and_publishes_capacities(short_dir, nc, buckets, node):
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": node, "uid": "node-uid-1"}})
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        info = await h.info()
        assert info.type == "DRAPlugin" and info.name == "gpu.tessera.io"
        assert list(info.supported_versions) == ["v1.DRAPlugin"]
        assert Path(info.endpoint).is_socket()
        [published] = await cluster.list_resource_slices(driver=names.DRIVER_NAME, node=node)
        spec = published["spec"]
        [owner] = published["metadata"]["ownerReferences"]  # a deleted Node takes it along
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", node, "node-uid-1")
        assert spec["pool"] == {"name": node, "generation": 1, "resourceSliceCount": 1}
        gpu0 = spec["devices"][0]
        assert gpu0["name"] == "gpu-0" and gpu0["allowMultipleAllocations"] is True
        assert gpu0["attributes"]["uuid"] == {"string": h.state.devices()[0].uuid}
        assert gpu0["attributes"]["model"] == {"string": "A100-SXM4-80GB"}
        assert gpu0["attributes"]["driverVersion"] == {"version": "560.35.3"}
        assert gpu0["capacity"]["memory"]["value"] == "16000Mi"
        assert gpu0["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi"
        assert gpu0["capacity"]["cores"]["requestPolicy"]["validRange"]["max"] == "100"
        assert gpu0["capacity"]["slots"] == {
            "value": "4",
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
        }


async def test_prepare_seals_the_consumed_capacity_and_unprepare_frees_it(
        short_dir, nc, buckets, node):  # fmt: skip
    cluster = InMemoryCluster()
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        pod, claim = pod_and_claim(node, "gpu-1", "4Gi", "30", two=True)
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert answer.error == ""
        [device] = answer.devices  # the other driver's device is not ours to prepare
        assert (device.pool_name, device.device_name) == (node, "gpu-1")
        cdi_id = f"tessera.io/gpu=claim-{claim['metadata']['uid']}"
        assert list(device.cdi_device_ids) == [cdi_id]

        # the CDI spec mounts what Allocate mounts, the limits sealed in the mounted dir
        spec = json.loads(cdi.spec_path(h.dra.cdi_dir, claim["metadata"]["uid"]).read_text())
        assert spec["kind"] == "tessera.io/gpu"
        edits = spec["devices"][0]["containerEdits"]
        mounts = {m["containerPath"]: m for m in edits["mounts"]}
        assert mounts["/usr/local/vgpu/libvgpu.so"]["hostPath"] == "/opt/vgpu/libvgpu.so"
        assert "ro" in mounts["/etc/ld.so.preload"]["options"]
        limits_dir = mounts["/run/tessera/limits"]["hostPath"]
        sealed = read_limits(limits_dir)
        gpu1 = h.state.devices()[1].uuid
        assert sealed is not None and [
            (d.uuid, d.mem_limit_bytes, d.sm_limit_pct) for d in sealed.devices
        ] == [(gpu1, 4096 << 20, 30)]
        assert "CUDA_DEVICE_MEMORY_LIMIT_0=4096m" in edits["env"]

        # the ledger holds the pod's allocation, as an extender allocation once allocated
        ledger = await h.ledger()
        assert ledger is not None
        allocation = ledger.allocations[pod["metadata"]["uid"]]
        assert allocation.state == "allocated"
        assert allocation.container_names == ["main", "side"]
        assert allocation.priority == 0 and sealed.priority == 0
        assert [[(g.uuid, g.memory_mib, g.cores) for g in c] for c in allocation.containers] == [
            [(gpu1, 4096, 30)],
            [],
        ]

        # kubelet retries: the same answer, nothing prepared twice
        again = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert list(again.devices[0].cdi_device_ids) == [cdi_id]
        assert len(h.store.for_pod(pod["metadata"]["uid"])) == 1

        gone = (await h.kubelet_unprepare(claim)).claims[claim["metadata"]["uid"]]
        assert gone.error == ""
        assert not cdi.spec_path(h.dra.cdi_dir, claim["metadata"]["uid"]).exists()
        assert not Path(limits_dir).exists()
        # the ended pod's allocation is the scheduler's to release (ledger, quota, event)
        ledger = await h.ledger()
        assert ledger is not None and pod["metadata"]["uid"] in ledger.allocations


async def test_a_prepared_claims_lease_socket_is_open_when_kubelet_may_start_its_container(
        short_dir, nc, buckets, node):  # fmt: skip
    """libvgpu finding no lease service is refused every allocation: NodePrepareResources
    answers once the claim's account is open (the lease service's own sweeps never run here)."""
    cluster = InMemoryCluster()
    async with Harness(short_dir, nc, buckets, node, cluster, leases=True) as h:
        pod, claim = pod_and_claim(node, "gpu-1", "4Gi", "30")
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert answer.error == ""
        spec = json.loads(cdi.spec_path(h.dra.cdi_dir, claim["metadata"]["uid"]).read_text())
        mounts = {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
        limits_dir = Path(mounts["/run/tessera/limits"]["hostPath"])
        assert read_limits(limits_dir).lease
        assert (limits_dir / LEASE_SOCKET_NAME).is_socket()


async def test_bad_claims_get_a_sentence_and_nothing_is_sealed(short_dir, nc, buckets, node):
    cluster = InMemoryCluster()
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        pod, claim = pod_and_claim(node, "gpu-0", "20000Mi", "30")
        cluster.add_pod(pod)
        cluster.put_resource_claim(claim)
        answer = (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]]
        assert "20000 MiB of gpu-0, which offers 16000 MiB" in answer.error
        pod2, claim2 = pod_and_claim(node, "gpu-7", "1Gi", "10")
        cluster.add_pod(pod2)
        cluster.put_resource_claim(claim2)
        answer2 = (await h.kubelet_prepare(claim2)).claims[claim2["metadata"]["uid"]]
        assert "device 'gpu-7' is not one this node offers" in answer2.error
        missing = {"metadata": {"name": "nope", "namespace": "team", "uid": "u-1"}}
        answer3 = (await h.kubelet_prepare(missing)).claims["u-1"]
        assert "not found" in answer3.error
        assert h.store.all() == [] and cdi.prepared_claims(h.dra.cdi_dir) == []
        assert await h.ledger() is None


async def test_an_unhealthy_gpu_is_tainted_and_streamed(short_dir, nc, buckets, node):
    cluster = InMemoryCluster()
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        async with grpc.aio.insecure_channel(f"unix://{h.endpoint.dra_socket}") as channel:
            stream = drahealth_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                drahealth.NodeWatchResourcesRequest()
            )
            v1 = drahealth_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                drahealth_v1.NodeWatchResourcesRequest()
            )
            first = await stream.read()
            assert {d.device.device_name: d.health for d in first.devices} == {
                "gpu-0": drahealth.HEALTHY,
                "gpu-1": drahealth.HEALTHY,
            }
            assert len((await v1.read()).devices) == 2
            sick = [d.model_copy(update={"healthy": d.index != 0}) for d in h.state.devices()]
            await h.state.update(sick)
            second = await stream.read()
            assert {d.device.device_name: d.health for d in second.devices}["gpu-0"] == (
                drahealth.UNHEALTHY
            )
            [gpu0, gpu1] = (await v1.read()).devices
            assert (gpu0.health, gpu1.health) == (drahealth_v1.UNHEALTHY, drahealth_v1.HEALTHY)
            assert "XID" in gpu0.message and gpu1.message == ""
            stream.cancel()
            v1.cancel()

        async def tainted() -> list:
            [s] = await cluster.list_resource_slices(node=node)
            return s["spec"]["devices"][0].get("taints") or []

        for _ in range(300):
            if await tainted():
                break
            await asyncio.sleep(0.02)
        [taint] = await tainted()
        assert taint["key"] == "gpu.tessera.io/unhealthy" and taint["effect"] == "NoSchedule"
        [s] = await cluster.list_resource_slices(node=node)
        assert s["spec"]["pool"]["generation"] == 2


async def test_the_namespace_quota_holds_dra_claims(short_dir, nc, nats_url, buckets, node):
    """The real quota service: a claim the quota cannot hold is not prepared (the quota's
    sentence goes to kubelet), a freed claim gives its charge back."""
    from tessera.bus import connect
    from tessera.settings import NatsSettings

    quota_nc = await connect(NatsSettings(NATS_URL=nats_url), name="quota-under-test")
    quota = QuotaService(quota_nc, buckets, TesseraSettings(),
                         consumer=f"quota-test-{uuid.uuid4().hex[:8]}")  # fmt: skip
    await quota.start()
    ns = f"q-{uuid.uuid4().hex[:8]}"
    try:
        reply = await nc.request(
            bus.QUOTA_SET,
            encode(QuotaSetRequest(namespace=ns, limits=QuotaAmount(memory_mib=6000))),
            timeout=5,
        )
        assert decode(reply.data, QuotaReply).ok
        cluster = InMemoryCluster()
        async with Harness(short_dir, nc, buckets, node, cluster, quota=True) as h:
            first_pod, first = pod_and_claim(node, "gpu-0", "4Gi", "10", namespace=ns)
            second_pod, second = pod_and_claim(node, "gpu-1", "4Gi", "10", namespace=ns)
            for pod, claim in ((first_pod, first), (second_pod, second)):
                cluster.add_pod(pod)
                cluster.put_resource_claim(claim)
            assert (await h.kubelet_prepare(first)).claims[first["metadata"]["uid"]].error == ""
            refused = (await h.kubelet_prepare(second)).claims[second["metadata"]["uid"]]
            assert "quota" in refused.error and "6000" in refused.error, refused.error
            assert not cdi.spec_path(h.dra.cdi_dir, second["metadata"]["uid"]).exists()
            assert h.store.for_pod(second_pod["metadata"]["uid"]) == []

            async def used() -> int:
                msg = await nc.request(bus.QUOTA_STATUS, encode(QuotaStatusRequest(
                    namespace=ns)), timeout=5)  # fmt: skip
                [state] = decode(msg.data, QuotaReply).states
                return state.used().memory_mib or 0

            assert await used() == 4096
            await h.kubelet_unprepare(first)
            assert await used() == 4096  # held until the ended pod is released, as any pod
            # the scheduler's release of the ended pod (runtime.on_pod_event) frees it
            msg = await nc.request(
                bus.QUOTA_RELEASE,
                encode(QuotaRequest(namespace=ns, pod_uid=first_pod["metadata"]["uid"])),
                timeout=5,
            )
            assert decode(msg.data, QuotaReply).ok
            assert await used() == 0
            again = (await h.kubelet_prepare(second)).claims[second["metadata"]["uid"]]
            assert again.error == ""
            assert await used() == 4096
    finally:
        await quota.stop()
        await quota_nc.drain()


async def test_a_restarted_driver_keeps_what_it_prepared(short_dir, nc, buckets, node):
    """The agent restarts (and the ledger lost the pod meanwhile): its records put the
    allocation back, and kubelet's retried prepare gets the same device, nothing made twice."""
    cluster = InMemoryCluster()
    pod, claim = pod_and_claim(node, "gpu-0", "2Gi", "20")
    cluster.add_pod(pod)
    cluster.put_resource_claim(claim)
    uid = claim["metadata"]["uid"]
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        first = (await h.kubelet_prepare(claim)).claims[uid]
        limits_dir = h.store.for_pod(pod["metadata"]["uid"])[0].limits_dir
    await buckets.ledger.delete(node)
    async with Harness(short_dir, nc, buckets, node, cluster) as again:

        async def restored() -> bool:
            ledger = await again.ledger()
            return ledger is not None and pod["metadata"]["uid"] in ledger.allocations

        for _ in range(200):
            if await restored():
                break
            await asyncio.sleep(0.02)
        assert await restored(), "the prepared claim's allocation was not put back"
        retried = (await again.kubelet_prepare(claim)).claims[uid]
        assert list(retried.devices[0].cdi_device_ids) == list(first.devices[0].cdi_device_ids)
        assert [c.limits_dir for c in again.store.for_pod(pod["metadata"]["uid"])] == [limits_dir]
        sealed = read_limits(limits_dir)
        assert sealed is not None and sealed.devices[0].mem_limit_bytes == 2 << 30


async def test_a_pod_that_opts_in_spills_its_claim_to_host_memory(short_dir, nc, buckets, node):
    """tessera.io/gpumem-spill reaches the claim's sealed limits as it reaches Allocate's; a
    claim two containers share spills only if both opted in (one limits file serves both)."""
    cluster = InMemoryCluster()
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        spilling, claim = pod_and_claim(node, "gpu-0", "4Gi", "30")
        spilling["metadata"]["annotations"] = {"tessera.io/gpumem-spill": "main=2048"}
        shared, shared_claim = pod_and_claim(node, "gpu-1", "2Gi", "20")
        shared["metadata"]["annotations"] = {"tessera.io/gpumem-spill": "main=1024"}
        shared["spec"]["containers"][1]["resources"] = {"claims": [{"name": "gpu"}]}
        plain, plain_claim = pod_and_claim(node, "gpu-1", "2Gi", "20")
        sealed = {}
        for pod, c in ((spilling, claim), (shared, shared_claim), (plain, plain_claim)):
            cluster.add_pod(pod)
            cluster.put_resource_claim(c)
            answer = (await h.kubelet_prepare(c)).claims[c["metadata"]["uid"]]
            assert answer.error == "", answer.error
            [prepared] = h.store.for_pod(pod["metadata"]["uid"])
            limits = read_limits(prepared.limits_dir)
            assert limits is not None
            sealed[pod["metadata"]["name"]] = limits.spill_bytes
        assert sealed == {spilling["metadata"]["name"]: 2048 << 20,
                          shared["metadata"]["name"]: 0, plain["metadata"]["name"]: 0}


async def test_a_claim_shared_by_two_pods_stays_held_when_its_first_pod_goes(
        short_dir, nc, nats_url, buckets, node):  # fmt: skip
    """A ResourceClaim may be reserved for several pods of one node (they share its devices).
    kubelet prepares it once, for the first pod, and unprepares it when the last one is gone.
    When the first pod is deleted, the scheduler's release keeps that pod's booking while the
    claim is still reserved for a pod running here (scheduler/dra_shared.py), and the driver
    hands it on: at no moment between the deletion and the hand-on do the ledger or the
    namespace's quota lose the slice (a tenant could otherwise share a claim, delete the first
    pod and hold the slice outside quota), it is charged once after, and the last unprepare
    still scrubs the claim's directory."""
    from tessera.scheduler.dra_shared import shared_in_use

    from tessera.bus import connect
    from tessera.settings import NatsSettings

    quota_nc = await connect(NatsSettings(NATS_URL=nats_url), name="quota-under-test")
    quota = QuotaService(quota_nc, buckets, TesseraSettings(),
                         consumer=f"quota-test-{uuid.uuid4().hex[:8]}")  # fmt: skip
    await quota.start()
    ns = f"q-{uuid.uuid4().hex[:8]}"

    async def used() -> tuple[int, list[str]]:
        msg = await nc.request(bus.QUOTA_STATUS, encode(QuotaStatusRequest(namespace=ns)),
                               timeout=5)  # fmt: skip
        [state] = decode(msg.data, QuotaReply).states
        return state.used().memory_mib or 0, sorted(state.charges)

    def slices(allocation) -> list[tuple[str, int, int]]:
        return [(g.uuid, g.memory_mib, g.cores) for row in allocation.containers for g in row]

    try:
        reply = await nc.request(bus.QUOTA_SET, encode(QuotaSetRequest(
            namespace=ns, limits=QuotaAmount(memory_mib=6000))), timeout=5)  # fmt: skip
        assert decode(reply.data, QuotaReply).ok
        cluster = InMemoryCluster()
        async with Harness(short_dir, nc, buckets, node, cluster, quota=True) as h:
            first, claim = pod_and_claim(node, "gpu-1", "4Gi", "30", namespace=ns)
            second = json.loads(json.dumps(first))
            second["metadata"].update(name="p-second", uid=str(uuid.uuid4()))
            first_uid, second_uid = first["metadata"]["uid"], second["metadata"]["uid"]
            claim["status"]["reservedFor"].append(
                {"resource": "pods", "name": "p-second", "uid": second_uid})
            for p in (first, second):
                cluster.add_pod(p)
            cluster.put_resource_claim(claim)
            claim_uid = claim["metadata"]["uid"]
            assert (await h.kubelet_prepare(claim)).claims[claim_uid].error == ""
            assert await used() == (4096, [first_uid])
            gpu1 = h.state.devices()[1].uuid

            # the first pod is deleted; the claim controller takes it out of reservedFor
            cluster.delete_pod(ns, first["metadata"]["name"])
            claim["status"]["reservedFor"] = claim["status"]["reservedFor"][1:]
            cluster.put_resource_claim(claim)
            # the scheduler's release (runtime.on_pod_event) asks first: kept
            ledger = await h.ledger()
            assert ledger is not None
            devices = h.state.devices()
            kept = await shared_in_use(cluster, node, ledger.allocations[first_uid], ledger,
                                       devices)  # fmt: skip
            assert kept == [f"{ns}/{claim['metadata']['name']}"]
            assert slices(ledger.allocations[first_uid]) == [(gpu1, 4096, 30)]
            assert await used() == (4096, [first_uid])

            await h.driver.reconcile()  # (the endpoint runs it every publish interval)
            ledger = await h.ledger()
            assert ledger is not None
            held = ledger.allocations.get(second_uid)
            assert held is not None, "the shared claim's slice was not handed on"
            assert slices(held) == [(gpu1, 4096, 30)]
            assert (held.namespace, held.name) == (ns, "p-second")
            # in the same write the ended pod's booking was emptied (a slice booked once)
            assert slices(ledger.allocations[first_uid]) == []
            assert await used() == (4096, [second_uid])
            # now the scheduler's release of the ended pod goes ahead: nothing shared left
            assert await shared_in_use(cluster, node, ledger.allocations[first_uid], ledger,
                                       devices) == []  # fmt: skip
            assert await shared_in_use(cluster, node, held, ledger, devices) == []

            # the last pod goes: kubelet unprepares, the claim's directory is scrubbed
            await h.kubelet_unprepare(claim)
            assert h.store.for_pod(first_uid) == []
            assert h.store.for_pod(second_uid) == []
            assert not cdi.spec_path(h.dra.cdi_dir, claim_uid).exists()
    finally:
        await quota.stop()
        await quota_nc.drain()


async def test_an_admin_access_claim_reaches_the_card_and_books_no_slice(
        short_dir, nc, buckets, node):  # fmt: skip
    """`adminAccess: true` (a namespace the cluster admin labelled `resource.kubernetes.io/
    admin-access`: monitoring, management) "ignores all ordinary claims to the device with
    respect to access modes and any resource allocations" (resource.k8s.io/v1): the allocator
    gives it a card others hold slices of, consuming nothing. The driver gives the container
    the card, and books nothing: it used to record a whole card in the ledger beside the
    tenants' slices (16000 + 12288 MiB on a 16000 MiB card) and charge it to the quota."""
    cluster = InMemoryCluster()
    async with Harness(short_dir, nc, buckets, node, cluster) as h:
        tenant, claim = pod_and_claim(node, "gpu-1", "12Gi", "50")
        cluster.add_pod(tenant)
        cluster.put_resource_claim(claim)
        assert (await h.kubelet_prepare(claim)).claims[claim["metadata"]["uid"]].error == ""
        monitor, admin = pod_and_claim(node, "gpu-1", "0", "0", namespace="monitoring")
        [result] = admin["status"]["allocation"]["devices"]["results"]
        for key in ("consumedCapacity", "shareID"):
            del result[key]
        result["adminAccess"] = True
        cluster.add_pod(monitor)
        cluster.put_resource_claim(admin)
        answer = (await h.kubelet_prepare(admin)).claims[admin["metadata"]["uid"]]
        assert answer.error == ""
        [cdir] = h.store.for_pod(monitor["metadata"]["uid"])
        sealed = read_limits(cdir.limits_dir)
        gpu1 = h.state.devices()[1].uuid
        assert sealed is not None and [(d.uuid, d.mem_limit_bytes >> 20, d.sm_limit_pct)
                                       for d in sealed.devices] == [(gpu1, 16000, 100)]
        ledger = await h.ledger()
        assert ledger is not None and monitor["metadata"]["uid"] not in ledger.allocations
        [booked] = ledger.allocations.values()
        assert [(g.uuid, g.memory_mib) for row in booked.containers for g in row] == [
            (gpu1, 12288)]
        await h.driver.reconcile()  # the periodic pass books nothing either
        ledger = await h.ledger()
        assert ledger is not None and monitor["metadata"]["uid"] not in ledger.allocations
        await h.kubelet_unprepare(admin)
        assert h.store.for_pod(monitor["metadata"]["uid"]) == []
