"""Dynamic MIG through the whole node agent and the kubelet stand-in (real unix-socket gRPC, real
nats-server), on the static source's simulated MIG (mig_sim.py): the registration says which
cards serve dynamic MIG; Allocate makes the pod's instance and hands the container its MIG UUID
without libvgpu; NVML refusing the instance fails the allocation with the reason (the Allocate
refused, a Warning event on the pod); a restarted agent keeps the instances the ledger names;
a released pod's instance is destroyed, someone else's only once no process runs in it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from node_agent_rig import running_rig
from tessera.node_agent.mig_sim import SimulatedMig
from tessera.node_agent.nvidia_source import StaticSource

from tessera import bus, mig
from tessera.models import (
    AllocationState,
    DeviceGrant,
    MigInstanceGrant,
    MigState,
    NodeLedger,
)

A100 = mig.MODELS["A100-SXM4-80GB"]
TYPE = "NVIDIA-NVIDIA A100-SXM4-80GB"


def mig_pod(name: str, mem: int) -> dict:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "nvidia.com/gpu": 1, "nvidia.com/gpumem": mem}}}]},
    }


def mig_grant(gpu: str, profile: str, start: int) -> DeviceGrant:
    p = A100.profile(profile)
    return DeviceGrant(uuid=gpu, type=TYPE, memory_mib=A100.profile_memory_mib(p),
                       cores=A100.profile_cores(p),
                       mig=MigInstanceGrant(profile=profile, start=start, size=p.memory_slices))


async def until(check, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_dynamic_mig_through_the_agent(short_dir: Path, nc, buckets) -> None:
    state = short_dir / "mig.json"
    settings = {
        "mig_strategy": "dynamic", "static_gpu_memory_mib": 81920,
        "static_gpu_model": "NVIDIA A100-SXM4-80GB", "static_mig_state": str(state),
        "mig_reconcile_s": 0.2, "mig_orphan_grace_s": 0.5,
    }
    async with running_rig(short_dir, nc, buckets, **settings) as rig:
        gpu0, _gpu1 = rig.gpus
        # registration: each A100 serves dynamic MIG, with its model
        devices = rig.agent.state.devices()
        assert {(d.mode, d.mig.model if d.mig else None) for d in devices} == {
            ("mig", "A100-SXM4-80GB")}
        operator = SimulatedMig(StaticSource(rig.settings, rig.node).discover(), str(state))
        handle = next(g for g in StaticSource(rig.settings, rig.node).discover()
                      if g.uuid == gpu0)

        # Allocate: the instance is made and the container gets its MIG UUID, no libvgpu
        a = mig_pod("a", 8000)
        await rig.bind(a, [[mig_grant(gpu0, "1g.10gb", 6)]])
        admitted = await rig.kubelet.admit_pod(a)
        assert admitted.ok, admitted.error
        (container,) = admitted.containers
        made = container.envs["NVIDIA_VISIBLE_DEVICES"]
        assert made.startswith("MIG-") and container.envs["CUDA_VISIBLE_DEVICES"] == made
        assert container.mounts == [] and "CUDA_DEVICE_MEMORY_SHARED_CACHE" not in container.envs
        assert [(d.uuid, d.profile, d.start) for d in operator.list_devices(handle, 0)] == [
            (made, "1g.10gb", 6)]
        (g,) = (await rig.ledger()).allocations["uid-a"].containers[0]
        assert (g.mig.mig_uuid, g.mig.state) == (made, MigState.CREATED)

        # NVML refuses (an operator's instance is where the pod's goes): failed, with the reason
        theirs = operator.create(handle, 0, "2g.20gb", 4)
        Path(f"{state}.busy").write_text(theirs.uuid + "\n")  # a process runs in it
        b = mig_pod("b", 15000)
        await rig.bind(b, [[mig_grant(gpu0, "2g.20gb", 4)]])
        refused = await rig.kubelet.allocate_pod(b)
        assert "2g.20gb at slice 4" in refused.error and "Insufficient Resources" in refused.error
        held = (await rig.ledger()).allocations["uid-b"]
        assert held.state == AllocationState.FAILED and "Insufficient Resources" in held.reason
        assert any(e["reason"] == "MigInstanceFailed" and e["involved"]["name"] == "b"
                   for e in rig.cluster.events)

        # the agent restarts: the pod's instance is kept (the ledger names it), the busy
        # stranger too; once its process ends, the stranger goes
        await rig.stop_agent()
        await rig.start_agent()
        await asyncio.sleep(1.0)  # several passes, past the grace period
        assert {d.uuid for d in operator.list_devices(handle, 0)} == {made, theirs.uuid}
        g = (await rig.ledger()).allocations["uid-a"].containers[0][0]
        assert g.mig.state == MigState.CREATED
        Path(f"{state}.busy").write_text("")
        await until(lambda: [d.uuid for d in operator.list_devices(handle, 0)] == [made])

        # the pod is released: its instance is destroyed
        def drop(ledger: NodeLedger | None) -> NodeLedger:
            assert ledger is not None
            out = ledger.model_copy(deep=True)
            out.allocations.pop("uid-a")
            return out

        await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, drop)
        await until(lambda: operator.list_devices(handle, 0) == [])
        assert json.loads(state.read_text()) == {gpu0: []}
