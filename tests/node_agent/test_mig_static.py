"""Static MIG (migstrategy mixed): existing instances served to kubelet as their own resources,
one device per instance, the container given exactly its instance's MIG UUID."""

from __future__ import annotations

import asyncio

import pytest
from node_agent_rig import running_rig
from tessera.node_agent import mig_static
from tessera.node_agent.mig_static import MigOffer

from tessera import mig
from tessera.codec import decode
from tessera.models import NodeRegistration


def _offer(uuid: str, profile: str, start: int, parent: int = 0) -> MigOffer:
    return MigOffer(uuid=uuid, parent_uuid=f"GPU-{parent}", parent_index=parent, profile=profile,
                    start=start, gi_id=start + 1)


def test_mixed_offers_one_resource_per_profile_single_needs_one_profile() -> None:
    offers = [_offer("MIG-b", "3g.40gb", 4), _offer("MIG-a", "1g.10gb", 0),
              _offer("MIG-c", "1g.10gb", 1, parent=1)]
    mixed = mig_static.plan(mig.STRATEGY_MIXED, offers, "nvidia.com/gpu")
    assert {r: [o.uuid for o in v] for r, v in mixed.resources.items()} == {
        "nvidia.com/mig-1g.10gb": ["MIG-a", "MIG-c"], "nvidia.com/mig-3g.40gb": ["MIG-b"]}
    single = mig_static.plan(mig.STRATEGY_SINGLE, offers, "nvidia.com/gpu")
    assert single.resources == {} and "one MIG profile" in single.problem
    same = mig_static.plan(mig.STRATEGY_SINGLE, offers[1:], "nvidia.com/gpu")
    assert [o.uuid for o in same.resources["nvidia.com/gpu"]] == ["MIG-a", "MIG-c"]
    assert mig_static.plan(mig.STRATEGY_NONE, offers, "nvidia.com/gpu").resources == {}
    assert mig_static.socket_name("nvidia.com/mig-1g.10gb") == "tessera-mig-1g.10gb.sock"


def test_container_env_names_exactly_the_instances() -> None:
    offers = [_offer("MIG-a", "1g.10gb", 0), _offer("MIG-c", "1g.10gb", 1)]
    assert mig_static.container_env(offers, ["MIG-c"]) == {"NVIDIA_VISIBLE_DEVICES": "MIG-c"}
    with pytest.raises(ValueError, match="not a MIG instance"):
        mig_static.container_env(offers, ["GPU-0-1"])
    with pytest.raises(ValueError, match="twice"):
        mig_static.container_env(offers, ["MIG-a", "MIG-a"])


def test_simulated_layout_must_be_a_valid_geometry() -> None:
    from tessera.node_agent.devices import PhysicalGpu

    gpu = PhysicalGpu("GPU-x", 0, "NVIDIA A100-SXM4-80GB", 81920, mig=True)
    offers = mig_static.simulated_offers([gpu], "1g.10gb@0,3g.40gb@4", "n1")
    assert [(o.profile, o.start) for o in offers] == [("1g.10gb", 0), ("3g.40gb", 4)]
    assert offers == mig_static.simulated_offers([gpu], "1g.10gb@0,3g.40gb@4", "n1")  # stable
    with pytest.raises(mig.MigError, match="overlaps"):
        mig_static.simulated_offers([gpu], "3g.40gb@4,1g.10gb@4", "n1")


def _pod(name: str, resource: str, count: int = 1) -> dict:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {resource: count}}}]},
    }


async def test_mixed_node_serves_instances_and_kubelet_gives_each_pod_its_own(
        short_dir, nc, buckets) -> None:
    layout = "1g.10gb@0,1g.10gb@1,3g.40gb@4"
    async with running_rig(short_dir, nc, buckets, static_gpu_model="NVIDIA A100-SXM4-80GB",
                           static_gpu_memory_mib=81920, static_mig_instances=layout,
                           mig_strategy="mixed") as rig:
        small = await rig.kubelet.wait_registered("nvidia.com/mig-1g.10gb")
        large = await rig.kubelet.wait_registered("nvidia.com/mig-3g.40gb")
        expected = mig_static.simulated_offers(rig.source.discover(), layout, rig.node)
        assert sorted(small.devices) == sorted(o.uuid for o in expected if o.profile == "1g.10gb")
        assert len(small.devices) == 4 and len(large.devices) == 2  # 2 GPUs
        # the cards register in MIG mode: the scheduler keeps libvgpu slices off them
        entry = await rig.buckets.nodes.get(rig.node)
        registration = decode(entry.value, NodeRegistration)
        assert {d.mode for d in registration.devices} == {"mig"}

        given = []
        for i in range(4):
            admission = await rig.kubelet.admit_pod(_pod(f"vllm-{i}", "nvidia.com/mig-1g.10gb"))
            assert admission.ok, admission.error
            env = admission.container("main").envs
            assert env["NVIDIA_VISIBLE_DEVICES"] == admission.container("main").device_ids[0]
            assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env  # no libvgpu: MIG isolates
            assert admission.container("main").mounts == []
            given.append(env["NVIDIA_VISIBLE_DEVICES"])
        assert sorted(given) == sorted(small.devices)  # each pod its own instance
        fifth = await rig.kubelet.admit_pod(_pod("vllm-4", "nvidia.com/mig-1g.10gb"))
        assert not fifth.ok and "unavailable" in fifth.error
        big = await rig.kubelet.admit_pod(_pod("train", "nvidia.com/mig-3g.40gb"))
        assert big.ok and big.container("main").envs["NVIDIA_VISIBLE_DEVICES"] in large.devices


async def test_strategy_none_offers_no_instances(short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets, static_gpu_model="NVIDIA A100-SXM4-80GB",
                           static_mig_instances="1g.10gb@0", mig_strategy="none") as rig:
        await _passes(rig, 1)
        assert rig.agent.mig_plugins.endpoints == {}
        assert "nvidia.com/mig-1g.10gb" not in rig.kubelet.plugins


async def _passes(rig, n: int, timeout: float = 10.0) -> None:
    async def wait() -> None:
        while rig.agent.mig_plugins is None or rig.agent.mig_plugins.passes < n:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout)


async def test_instances_follow_their_gpu_health_and_the_node_filter(
        short_dir, nc, buckets) -> None:
    """An XID on a card makes its instances Unhealthy for kubelet (no pod is given one); a GPU
    the node config filters out offers no instance."""
    from tessera.node_agent.devices import HealthEvent

    from tessera.models import NodeConfigSetRequest

    async with running_rig(short_dir, nc, buckets, static_gpu_model="NVIDIA A100-SXM4-80GB",
                           static_mig_instances="1g.10gb@0", mig_strategy="mixed") as rig:
        plugin = await rig.kubelet.wait_registered("nvidia.com/mig-1g.10gb")
        offers = mig_static.simulated_offers(rig.source.discover(), "1g.10gb@0", rig.node)
        on = {o.parent_index: o.uuid for o in offers}
        assert sorted(plugin.healthy()) == sorted(on.values())
        rig.source.events.put(HealthEvent(rig.gpus[1], "xid", 79))
        await rig.kubelet.wait_for(lambda: plugin.healthy() == [on[0]])
        await rig.kubelet.admit_pod(_pod("a", "nvidia.com/mig-1g.10gb"))
        refused = await rig.kubelet.admit_pod(_pod("b", "nvidia.com/mig-1g.10gb"))
        assert not refused.ok  # the only healthy instance is taken; the sick card's is not given

        status = await rig.agent.configurator.set_local(
            NodeConfigSetRequest(config={"filterdevices": {"index": [1]}}))
        assert status.ok, status.reason
        await rig.kubelet.wait_for(lambda: list(plugin.devices) == [on[0]])
