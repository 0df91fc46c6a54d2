"""The device plugin over real unix-socket gRPC, against the kubelet stand-in."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from node_agent_rig import grants, make_pod, running_rig
from tessera.node_agent import leases as agent_leases
from tessera.node_agent.devices import HealthEvent

from tessera import hami
from tessera.codec import decode
from tessera.events import subscribe
from tessera.kubeapi import HEALTHY, UNHEALTHY, dp, dp_grpc
from tessera.models import AllocationState, NodeRegistration
from tessera.region import LEASE_SOCKET_NAME, SEALED_LIMITS_DIR, read_limits


async def test_registers_and_advertises_replicas_with_numa(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        plugin = rig.kubelet.plugins["nvidia.com/gpu"]
        assert plugin.pre_start_required and plugin.preferred_allocation
        gpus = rig.gpus
        assert sorted(plugin.devices) == sorted(f"{u}-{i}" for u in gpus for i in range(4))
        assert {d.health for d in plugin.devices.values()} == {HEALTHY}
        numa = {i: d.topology.nodes[0].ID for i, d in plugin.devices.items()}
        assert numa[f"{gpus[0]}-3"] == 0 and numa[f"{gpus[1]}-0"] == 1
        # The registration in tessera-nodes, with HAMi's annotation through the cluster port.
        entry = await buckets.nodes.get(rig.node)
        registration = decode(entry.value, NodeRegistration)
        assert [d.uuid for d in registration.devices] == gpus
        assert registration.devices[0].split_count == 4
        # written after the registration and its event (a JetStream round trip more)

        async def annotated() -> bool:
            return hami.ANN_NODE_REGISTER in rig.cluster.node_annotations.get(rig.node, {})

        await eventually(annotated, timeout=10)
        annotation = rig.cluster.node_annotations[rig.node][hami.ANN_NODE_REGISTER]
        assert [d.uuid for d in hami.decode_node_register(annotation)] == gpus


async def registered_health(buckets, node: str) -> list[bool]:
    entry = await buckets.nodes.get(node)
    return [d.healthy for d in decode(entry.value, NodeRegistration).devices]


async def eventually(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_unhealthy_gpu_reaches_kubelet_registration_and_events(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets, health_recovery_s=3.0) as rig:
        bad, good = rig.gpus
        unhealthy_events = subscribe(nc, f"tessera.events.node.{rig.node}.unhealthy")
        rig.source.events.put(HealthEvent(bad, "xid", 79))
        kubelet = rig.kubelet

        def health_of(uuid: str) -> set[str]:
            devices = kubelet.plugins["nvidia.com/gpu"].devices
            return {d.health for i, d in devices.items() if i.startswith(uuid)}

        await kubelet.wait_for(lambda: health_of(bad) == {UNHEALTHY}, timeout=15)
        assert health_of(good) == {HEALTHY}

        async def registered_unhealthy() -> bool:
            return await registered_health(buckets, rig.node) == [False, True]

        await eventually(registered_unhealthy, timeout=15)  # a KV write after the health change
        event = (await asyncio.wait_for(anext(unhealthy_events), 5)).event
        await unhealthy_events.aclose()
        assert event.device_uuids == [bad] and "XID 79" in event.reason
        # No new critical event for health_recovery_s: healthy again (HAMi never recovers).
        await kubelet.wait_for(lambda: health_of(bad) == {HEALTHY}, timeout=20)

        async def registered_healthy() -> bool:
            return await registered_health(buckets, rig.node) == [True, True]

        await eventually(registered_healthy, timeout=15)


async def test_admission_steers_kubelet_and_seals_each_containers_limits(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0, gpu1 = rig.gpus
        pod = make_pod("train", [("main", 2), ("side", 1)], init=[("setup", 1)])
        allocation = await rig.bind(pod, [
            grants((gpu1, 2000, 10)),
            grants((gpu0, 6000, 30), (gpu1, 4000, 50)),
            grants((gpu1, 1000, 0)),
        ], init_count=1)
        events = subscribe(nc, f"tessera.events.alloc.{rig.node}.allocated")
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error
        setup, main, side = admission.containers
        # GetPreferredAllocation steered kubelet to exactly the granted GPUs.
        assert [i.rsplit("-", 1)[0] for i in setup.device_ids] == [gpu1]
        assert [i.rsplit("-", 1)[0] for i in main.device_ids] == [gpu0, gpu1]
        assert setup.device_ids[0] in main.device_ids  # kubelet reused the init's replica
        assert main.envs["NVIDIA_VISIBLE_DEVICES"] == f"{gpu0},{gpu1}"
        assert main.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "6000m"
        assert main.envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == "4000m"
        assert main.envs["CUDA_DEVICE_SM_LIMIT_0"] == "30"
        assert main.envs["CUDA_DEVICE_SM_LIMIT_1"] == "50"
        assert main.envs["CUDA_TASK_PRIORITY"] == "1"
        assert main.envs["GPU_CORE_UTILIZATION_POLICY"] == "default"
        assert "CUDA_OVERSUBSCRIBE" not in main.envs
        assert setup.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
        libvgpu = main.mount("/usr/local/vgpu/libvgpu.so")
        assert libvgpu.read_only and libvgpu.host_path == rig.settings.libvgpu_host_path
        preload = main.mount("/etc/ld.so.preload")
        with open(preload.host_path) as f:
            assert f.read().strip() == "/usr/local/vgpu/libvgpu.so"
        limits_mount = main.mount(SEALED_LIMITS_DIR)
        assert limits_mount.read_only
        # the region's directory read-only, the file read-write on top: it cannot be replaced
        assert main.mount("/run/tessera/region").read_only
        assert not main.mount("/run/tessera/region/usage").read_only
        # PreStartContainer sealed each container's own limits.
        sealed = read_limits(limits_mount.host_path)
        assert sealed.lease  # libvgpu leases from the agent's lease service
        assert [(d.uuid, d.mem_limit_bytes >> 20, d.sm_limit_pct) for d in sealed.devices] == [
            (gpu0, 6000, 30), (gpu1, 4000, 50)
        ]
        assert sealed.region_path == main.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
        side_limits = read_limits(side.mount(SEALED_LIMITS_DIR).host_path)
        assert [(d.uuid, d.mem_limit_bytes >> 20) for d in side_limits.devices] == [(gpu1, 1000)]
        # The allocation is allocated, the claim released, the event out, bind-phase success.
        ledger = await rig.ledger()
        assert ledger.in_flight() == {}
        assert ledger.allocations[allocation.pod_uid].state == AllocationState.ALLOCATED
        received = await asyncio.wait_for(anext(events), 5)
        await events.aclose()
        assert received.event.pod_uid == allocation.pod_uid
        assert received.event.containers[1][0].memory_mib == 6000

        async def bind_phase_success() -> bool:  # patched after the pod's finish is written
            pod_now = await rig.cluster.get_pod("team", "train")
            return pod_now["metadata"]["annotations"].get(hami.ANN_BIND_PHASE) == "success"

        await eventually(bind_phase_success, timeout=10)


async def test_a_sealed_containers_lease_socket_is_open_when_kubelet_may_start_it(
    short_dir, nc, buckets, monkeypatch
):
    """libvgpu in a container that finds no lease service is refused every allocation: the
    account opens before PreStartContainer answers, not at the lease service's next sweep
    (made slow here, as on a busy node)."""
    monkeypatch.setattr(agent_leases, "SYNC_S", 60.0)
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0, gpu1 = rig.gpus
        pod = make_pod("early", [("main", 1), ("side", 1)])
        await rig.bind(pod, [grants((gpu0, 2000, 10)), grants((gpu1, 1000, 0))])
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error
        for container in admission.containers:
            limits_dir = Path(container.mount(SEALED_LIMITS_DIR).host_path)
            assert (limits_dir / LEASE_SOCKET_NAME).is_socket(), container


async def test_reused_init_replica_still_gets_each_containers_own_limits(short_dir, nc, buckets):
    """kubelet gives an app container the init container's replica: both hold the same ID, and
    PreStartContainer still seals each one's own limits, in start order."""
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu1 = rig.gpus[1]
        pod = make_pod("reuse", [("main", 1)], init=[("setup", 1)])
        await rig.bind(pod, [grants((gpu1, 2000, 20)), grants((gpu1, 5000, 50))], init_count=1)
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error
        setup, main = admission.containers
        assert setup.device_ids == main.device_ids
        assert main.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "5000m"
        for container, mib, sm in ((setup, 2000, 20), (main, 5000, 50)):
            sealed = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
            assert [(d.mem_limit_bytes >> 20, d.sm_limit_pct) for d in sealed.devices] == [
                (mib, sm)
            ]
        # Containers started again (a pod restart): still each one's own limits.
        again = await rig.kubelet.start_pod(admission)
        assert again.ok, again.error
        for container, mib in ((setup, 2000), (main, 5000)):
            sealed = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
            assert sealed.devices[0].mem_limit_bytes >> 20 == mib and sealed.generation >= 1


async def test_kubelet_restart_reregisters_within_five_seconds(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        before = rig.kubelet.registration_count("nvidia.com/gpu")
        started = time.monotonic()
        await rig.kubelet.restart()
        plugin = await rig.kubelet.wait_registered("nvidia.com/gpu", after=before, timeout=5)
        assert time.monotonic() - started < 5
        assert len(plugin.devices) == 8
        # And it serves again through the new socket.
        pod = make_pod("after-restart", [("main", 1)])
        await rig.bind(pod, [grants((rig.gpus[0], 1000, 10))])
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error


async def test_bad_requests_get_grpc_errors_and_the_agent_keeps_serving(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0, gpu1 = rig.gpus
        socket = rig.agent.endpoint.socket_path
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = dp_grpc.DevicePluginStub(channel)

            async def allocate(ids):
                request = dp.AllocateRequest(container_requests=[
                    dp.ContainerAllocateRequest(devices_ids=ids)
                ])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Allocate(request, timeout=5)
                return err.value

            # Nothing in flight: Allocate cannot know the pod and says so.
            err = await allocate([f"{gpu0}-0"])
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no pod is in flight" in err.details()
            pod = make_pod("one", [("main", 1)])
            await rig.bind(pod, [grants((gpu1, 1000, 10))])
            err = await allocate(["GPU-nope-0", f"{gpu0}-0"])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown device IDs ['GPU-nope-0']" in err.details()
            err = await allocate([f"{gpu0}-9"])  # beyond the split count
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            err = await allocate([f"{gpu0}-0", f"{gpu1}-0"])  # wrong count
            assert "allocated 2 devices" in err.details() and "granted 1 GPU" in err.details()
            err = await allocate([f"{gpu0}-0"])  # the wrong GPU
            assert f"chose GPU(s) {gpu0}" in err.details()
            err = await allocate([])
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.GetPreferredAllocation(dp.PreferredAllocationRequest(
                    container_requests=[dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[f"{gpu0}-0", f"{gpu1}-0"], allocation_size=2
                    )]
                ), timeout=5)
            assert "asks for 2 devices" in bad.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.PreStartContainer(
                    dp.PreStartContainerRequest(devices_ids=[f"{gpu1}-3"]), timeout=5
                )
            assert "no container was prepared" in bad.value.details()
            # Still serving: the real admission of the bound pod goes through.
            options = await stub.GetDevicePluginOptions(dp.Empty(), timeout=5)
            assert options.pre_start_required
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error
        assert admission.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpu1


async def test_prestart_refuses_a_container_of_another_pod(short_dir, nc, buckets):
    """Only pod B is in flight but kubelet admits pod A (its ledger entry, on another GPU and of
    another size, says it was served already): Allocate counts it for B, PreStartContainer finds
    A holding the devices, cannot repair (neither B's layout nor B's shape) and fails the start
    rather than seal B's limits for A."""
    from tessera import bus
    from tessera.models import NodeLedger

    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0, gpu1 = rig.gpus[0], rig.gpus[1]
        pod_a = make_pod("a", [("main", 1)])
        pod_b = make_pod("b", [("main", 1)])
        allocation_a = await rig.bind(pod_a, [grants((gpu1, 1000, 10))], claim=False)

        def served(ledger: NodeLedger | None) -> NodeLedger:
            ledger = ledger.model_copy(deep=True)
            ledger.allocations[allocation_a.pod_uid].state = AllocationState.ALLOCATED
            return ledger

        await bus.cas_update(buckets.ledger, rig.node, NodeLedger, served)
        await rig.bind(pod_b, [grants((gpu0, 7000, 70))])
        mismatches = subscribe(nc, f"tessera.events.alloc.{rig.node}.mismatch")
        admission = await rig.kubelet.admit_pod(pod_a)
        assert not admission.ok
        container = admission.containers[0]
        assert not container.started
        assert "held by team/a" in container.error and "prepared for team/b" in container.error
        assert read_limits(container.mount(SEALED_LIMITS_DIR).host_path) is None
        event = (await asyncio.wait_for(anext(mismatches), 5)).event
        await mismatches.aclose()
        assert event.name == "b" and "another pod's limits" in event.reason
        # B's own Allocate still finds its claim and B starts with B's limits.
        ledger = await rig.ledger()
        assert [c.name for c in ledger.in_flight().values()] == ["b"]
        admission_b = await rig.kubelet.admit_pod(pod_b)
        assert admission_b.ok, admission_b.error
        sealed = read_limits(admission_b.containers[0].mount(SEALED_LIMITS_DIR).host_path)
        assert [(d.uuid, d.mem_limit_bytes >> 20) for d in sealed.devices] == [(gpu0, 7000)]
        assert (await rig.ledger()).in_flight() == {}


async def test_kubelet_retrying_an_unfinished_admission_is_served_again(short_dir, nc, buckets):
    """The agent prepared every container but the pod never got to `allocated` (a crash before
    the ledger write): kubelet's retry of the admission is served from the start."""
    from tessera import bus
    from tessera.models import InFlightClaim, NodeLedger, now

    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0 = rig.gpus[0]
        pod = make_pod("retry", [("main", 1)])
        allocation = await rig.bind(pod, [grants((gpu0, 1500, 15))])
        first = await rig.kubelet.allocate_pod(pod)
        assert first.ok, first.error
        deadline = asyncio.get_running_loop().time() + 10
        while (await rig.ledger()).allocations[allocation.pod_uid].state != "allocated":
            assert asyncio.get_running_loop().time() < deadline  # written after the answer
            await asyncio.sleep(0.02)

        def restore(ledger: NodeLedger | None) -> NodeLedger:
            ledger = ledger.model_copy(deep=True)
            ledger.allocations[allocation.pod_uid].state = AllocationState.BOUND
            ledger.claims[allocation.pod_uid] = InFlightClaim(
                pod_uid=allocation.pod_uid, namespace="team", name="retry", expires_at=now() + 60)
            return ledger

        await bus.cas_update(buckets.ledger, rig.node, NodeLedger, restore)
        rig.kubelet.remove_pod(allocation.pod_uid)  # kubelet: the admission failed
        again = await rig.kubelet.admit_pod(pod)
        assert again.ok, again.error
        sealed = read_limits(again.containers[0].mount(SEALED_LIMITS_DIR).host_path)
        assert sealed.devices[0].mem_limit_bytes >> 20 == 1500
        ledger = await rig.ledger()
        assert ledger.in_flight() == {}
        assert ledger.allocations[allocation.pod_uid].state == AllocationState.ALLOCATED
