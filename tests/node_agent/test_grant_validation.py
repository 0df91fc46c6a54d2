"""A grant forged in the ledger (right identity, bad content) is refused before it is sealed, and
oversized device-plugin requests get INVALID_ARGUMENT: real NATS, real unix-socket gRPC."""

from __future__ import annotations

import grpc
from node_agent_rig import grants, running_rig

from tessera import bus
from tessera.codec import decode
from tessera.kubeapi import dp, dp_grpc
from tessera.models import ValueRejectedEvent


def sized_pod(name: str, mem: int, cores: int) -> dict:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "nvidia.com/gpu": 1, "nvidia.com/gpumem": mem, "nvidia.com/gpucores": cores,
        }}}]},
    }  # fmt: skip


async def test_a_grant_above_the_request_is_never_sealed(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        sub = await nc.subscribe(bus.rejected_event_subject("ledger"))
        forged = sized_pod("forged", mem=1000, cores=10)
        # Asked 1000 MiB / 10 %, the ledger says the whole card.
        await rig.bind(forged, [grants((rig.gpus[0], 16000, 100))])
        admission = await rig.kubelet.admit_pod(forged)
        assert not admission.ok
        assert "ledger grants 16000 MiB" in admission.error
        assert "the pod asks 1000 MiB" in admission.error
        event = decode((await sub.next_msg(timeout=5)).data, ValueRejectedEvent)
        assert event.key == rig.node and event.problem == "grant_above_request"
        assert not any(
            (c.limits_dir / "limits").exists() for c in rig.agent.store.for_pod("uid-forged")
        )


async def test_a_dropped_compute_limit_is_refused_and_an_honest_grant_is_sealed(
    short_dir, nc, buckets
):
    async with running_rig(short_dir, nc, buckets) as rig:
        unlimited = sized_pod("unlimited", mem=1000, cores=10)
        # 0 % compute means "no compute limit": a forged way to escape the 10 % asked for.
        await rig.bind(unlimited, [grants((rig.gpus[0], 1000, 0))])
        refused = await rig.kubelet.admit_pod(unlimited)
        assert not refused.ok and "compute" in refused.error
        rig.kubelet.remove_pod(unlimited["metadata"]["uid"])
        honest = sized_pod("honest", mem=1000, cores=10)
        await rig.bind(honest, [grants((rig.gpus[1], 1000, 10))])
        admission = await rig.kubelet.admit_pod(honest)
        assert admission.ok, admission.error


async def test_a_hundred_thousand_ids_get_invalid_argument(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        ids = [f"{rig.gpus[0]}-{i}" for i in range(100_000)]
        socket = rig.agent.endpoint.socket_path
        async with grpc.aio.insecure_channel(
            f"unix://{socket}", options=[("grpc.max_send_message_length", 64 << 20)]
        ) as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            calls = [
                stub.Allocate(dp.AllocateRequest(container_requests=[
                    dp.ContainerAllocateRequest(devices_ids=ids)]), timeout=20),
                stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=ids), timeout=20),
                stub.GetPreferredAllocation(dp.PreferredAllocationRequest(container_requests=[
                    dp.ContainerPreferredAllocationRequest(available_deviceIDs=ids,
                                                           allocation_size=1)]), timeout=20),
            ]  # fmt: skip
            for call in calls:
                try:
                    await call
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                    assert "100000 device IDs" in err.details()
                else:
                    raise AssertionError("a 100k-ID request was accepted")
            # The agent still serves.
            options = await stub.GetDevicePluginOptions(dp.Empty(), timeout=5)
            assert options.pre_start_required
