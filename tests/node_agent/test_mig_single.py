"""Static MIG, migstrategy single (NVIDIA's device plugin semantics): every GPU of the node in
MIG mode with instances of one profile, each instance offered as one whole `nvidia.com/gpu`
device — by the node's one GPU plugin, so the scheduler places pods on instances and the
handshake gives a container exactly its instance's MIG UUID. A node that breaks the rule offers
nothing and says why."""

from __future__ import annotations

import asyncio

from node_agent_rig import grants, make_pod, running_rig
from tessera.node_agent import mig_static
from tessera.node_agent.devices import PhysicalGpu
from tessera.node_agent.mig_static import MigOffer

from tessera.codec import decode
from tessera.models import NodeRegistration

A100 = "NVIDIA A100-SXM4-80GB"


def _offer(uuid: str, profile: str, start: int, parent: int = 0) -> MigOffer:
    return MigOffer(uuid=uuid, parent_uuid=f"GPU-{parent}", parent_index=parent, profile=profile,
                    start=start, gi_id=start + 1)


def _gpu(index: int, mig: bool = True) -> PhysicalGpu:
    return PhysicalGpu(f"GPU-{index}", index, A100, 81920, mig=mig)


def test_single_needs_every_gpu_in_mig_mode_and_one_profile() -> None:
    offers = [_offer("MIG-b", "1g.10gb", 1, parent=1), _offer("MIG-a", "1g.10gb", 0)]
    devices, problem = mig_static.single_devices([_gpu(0), _gpu(1)], offers)
    assert problem == ""
    assert [(d.uuid, d.index, d.type, d.memory_mib, d.cores, d.split_count) for d in devices] == [
        ("MIG-a", 0, f"NVIDIA-{A100}-MIG-1g.10gb", 10240, 100, 1),
        ("MIG-b", 1, f"NVIDIA-{A100}-MIG-1g.10gb", 10240, 100, 1)]
    devices, problem = mig_static.single_devices(
        [_gpu(0), _gpu(1)], [*offers, _offer("MIG-c", "3g.40gb", 4)])
    assert devices == [] and "one MIG profile" in problem and "3g.40gb" in problem
    devices, problem = mig_static.single_devices([_gpu(0), _gpu(1, mig=False)], offers[1:])
    assert devices == [] and "GPU 1 (GPU-1) is not" in problem
    devices, problem = mig_static.single_devices([_gpu(0), _gpu(1)], offers[1:])
    assert devices == [] and "GPU 1 (GPU-1) is in MIG mode but holds no instance" in problem
    # no GPU in MIG mode: as `none`, the GPUs themselves (NVIDIA's rule)
    assert mig_static.single_devices([_gpu(0, mig=False)], []) == (None, "")


async def _registration(rig) -> NodeRegistration:
    entry = await rig.buckets.nodes.get(rig.node)
    return decode(entry.value, NodeRegistration)


async def test_single_node_offers_its_instances_as_gpus_each_pod_gets_its_own(
        short_dir, nc, buckets) -> None:
    layout = "1g.10gb@0,1g.10gb@1"
    async with running_rig(short_dir, nc, buckets, static_gpu_model=A100,
                           static_gpu_memory_mib=81920, static_mig_instances=layout,
                           mig_strategy="single") as rig:
        expected = mig_static.simulated_offers(rig.source.discover(), layout, rig.node)
        plugin = rig.kubelet.plugins["nvidia.com/gpu"]
        await rig.kubelet.wait_for(lambda: len(plugin.devices) == 4)
        # one device per instance (split count 1), named by its MIG UUID; no per-profile plugin
        assert sorted(plugin.devices) == sorted(f"{o.uuid}-0" for o in expected)
        assert not [r for r in rig.kubelet.plugins if r.startswith("nvidia.com/mig-")]

        async def registered():
            while {d.uuid for d in (await _registration(rig)).devices} != {
                    o.uuid for o in expected}:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(registered(), 10)
        devices = (await _registration(rig)).devices
        assert {(d.type, d.memory_mib, d.split_count, d.mode) for d in devices} == {
            (f"NVIDIA-{A100}-MIG-1g.10gb", 10240, 1, "hami-core")}

        # A pod placed on one instance gets exactly that instance's MIG UUID.
        chosen = sorted(o.uuid for o in expected)[2]
        pod = make_pod("infer", [("main", 1)])
        await rig.bind(pod, [grants((chosen, 10240, 100))])
        admitted = await rig.kubelet.admit_pod(pod)
        assert admitted.ok, admitted.error
        container = admitted.containers[0]
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == chosen
        assert container.envs["CUDA_VISIBLE_DEVICES"] == chosen
        assert container.device_ids == [f"{chosen}-0"]
        assert container.mounts == []  # no libvgpu: the hardware isolates a whole instance
        assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in container.envs


async def test_single_with_two_profiles_offers_nothing_and_says_why(
        short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets, static_gpu_model=A100,
                           static_mig_instances="1g.10gb@0,3g.40gb@4",
                           mig_strategy="single") as rig:
        async def refused():
            while rig.agent.mig_plugins is None or "one MIG profile" not in \
                    rig.agent.mig_plugins.problem:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(refused(), 10)
        plugin = rig.kubelet.plugins["nvidia.com/gpu"]
        await rig.kubelet.wait_for(lambda: len(plugin.devices) == 0)
        async def unregistered():
            while (await _registration(rig)).devices:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(unregistered(), 10)  # the registration follows at once
        assert not [r for r in rig.kubelet.plugins if r.startswith("nvidia.com/mig-")]


async def test_mixed_node_registers_its_instances_with_the_pod_holding_each(
        short_dir, nc, buckets) -> None:
    """What the dashboard shows for static MIG: each card's instances (profile, placement) in
    the registration, with the pod kubelet gave each (its pod-resources API)."""
    async with running_rig(short_dir, nc, buckets, static_gpu_model=A100,
                           static_mig_instances="1g.10gb@0,3g.40gb@4", mig_strategy="mixed",
                           node_heartbeat_s=0.3) as rig:
        await rig.kubelet.wait_registered("nvidia.com/mig-3g.40gb")
        pod = {"metadata": {"name": "train", "namespace": "default", "uid": "uid-train"},
               "spec": {"containers": [{"name": "main", "resources": {
                   "limits": {"nvidia.com/mig-3g.40gb": 1}}}]}}
        admitted = await rig.kubelet.admit_pod(pod)
        assert admitted.ok, admitted.error
        held = admitted.container("main").device_ids[0]

        async def shown():
            while True:
                devices = (await _registration(rig)).devices
                if any(i.pod for d in devices for i in d.mig_instances):
                    return devices
                await asyncio.sleep(0.05)

        devices = await asyncio.wait_for(shown(), 15)
        assert [[(i.profile, i.start, i.size) for i in d.mig_instances] for d in devices] == [
            [("1g.10gb", 0, 1), ("3g.40gb", 4, 4)]] * 2
        holders = {i.uuid: i.pod for d in devices for i in d.mig_instances if i.pod}
        assert holders == {held: "default/train"}
