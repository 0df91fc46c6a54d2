"""The crossed-limits scenario (HAMi's defect): two pods in flight for one node, the agent killed
between Allocate and PreStartContainer. Each container must end with its own pod's limits or
fail to start; never the other's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid

from node_agent_rig import bind, grants, ledger_of, make_pod, rig_settings
from tessera.kube_sim.kubelet import SimKubelet
from tessera.node_agent.nvidia_source import StaticSource

from tessera.region import SEALED_LIMITS_DIR, read_limits


def start_agent_process(settings, node: str, nats_url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "NATS_"))}
    env.update({
        "NATS_URL": nats_url,
        "TESSERA_NODE_NAME": node,
        "TESSERA_CLUSTER": "none",
        "TESSERA_DEVICE_SOURCE": "static",
        "TESSERA_STATIC_GPU_COUNT": str(settings.static_gpu_count),
        "TESSERA_STATIC_GPU_MEMORY_MIB": str(settings.static_gpu_memory_mib),
        "TESSERA_STATIC_NUMA_NODES": str(settings.static_numa_nodes),
        "TESSERA_DEVICE_SPLIT_COUNT": str(settings.device_split_count),
        "TESSERA_DEVICE_PLUGIN_DIR": settings.device_plugin_dir,
        "TESSERA_POD_RESOURCES_SOCKET": settings.pod_resources_socket,
        "TESSERA_REGION_HOST_DIR": settings.region_host_dir,
        "TESSERA_LOG_LEVEL": "WARNING",
    })
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.node_agent"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def sealed_mib(container) -> list[tuple[str, int]] | None:
    limits = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
    if limits is None:
        return None
    return [(d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices]


async def test_agent_killed_between_allocate_and_prestart(short_dir, nats_url, buckets):
    settings = rig_settings(short_dir, static_gpu_count=1)
    node = f"node-{uuid.uuid4().hex[:8]}"
    gpu = StaticSource(settings, node).discover()[0].uuid
    kubelet = SimKubelet(settings.device_plugin_dir, settings.pod_resources_socket)
    await kubelet.start()
    agent = start_agent_process(settings, node, nats_url)
    try:
        await kubelet.wait_registered("nvidia.com/gpu", timeout=30)
        pod_a = make_pod("a", [("main", 1)])
        pod_b = make_pod("b", [("main", 1)])
        await bind(buckets.ledger, node, pod_a, [grants((gpu, 3000, 30))])
        admission_a = await kubelet.allocate_pod(pod_a)
        assert admission_a.ok, admission_a.error
        # The agent dies before kubelet gets to PreStartContainer for pod a.
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        # Meanwhile the scheduler binds pod b to the same GPU.
        await bind(buckets.ledger, node, pod_b, [grants((gpu, 9000, 60))])
        agent = start_agent_process(settings, node, nats_url)
        await kubelet.wait_registered("nvidia.com/gpu", after=1, timeout=30)
        # Pod b is admitted and started first, then pod a's container finally starts.
        admission_b = await kubelet.admit_pod(pod_b)
        admission_a = await kubelet.start_pod(admission_a)
        a, b = admission_a.containers[0], admission_b.containers[0]
        assert admission_b.ok, admission_b.error
        assert sealed_mib(b) == [(gpu, 9000)]
        assert b.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "9000m"
        # Pod a started with a's limits (the agent found a's preparation on disk and checked
        # pod-resources), never b's.
        assert admission_a.ok, admission_a.error
        assert sealed_mib(a) == [(gpu, 3000)]
        assert a.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m"
        assert (await ledger_of(buckets.ledger, node)).in_flight() == {}
    finally:
        agent.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(10)
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        await kubelet.stop()


async def test_crossed_guess_is_repaired_before_sealing_across_an_agent_kill(
    short_dir, nats_url, buckets
):
    """Pods a and b (other sizes, one GPU) are both in flight; kubelet admits b first while the
    agent expects a (a bound earlier), so b's Allocate is counted for a. The agent is SIGKILLed
    before the start. PreStartContainer finds b holding the devices, relabels the directory to
    b before anything is sealed, and a, in flight again, is admitted after: both run with their
    own limits, neither fails. (This kubelet's pod-resources List shows a pod only once it
    holds devices, so the agent cannot read which pod is under admission and must guess.)"""
    settings = rig_settings(short_dir, static_gpu_count=1)
    node = f"node-{uuid.uuid4().hex[:8]}"
    gpu = StaticSource(settings, node).discover()[0].uuid
    kubelet = SimKubelet(settings.device_plugin_dir, settings.pod_resources_socket,
                         lists_admitting=False)  # fmt: skip
    await kubelet.start()
    agent = start_agent_process(settings, node, nats_url)
    try:
        await kubelet.wait_registered("nvidia.com/gpu", timeout=30)
        pod_a = make_pod("a", [("main", 1)])
        pod_b = make_pod("b", [("main", 1)])
        await bind(buckets.ledger, node, pod_a, [grants((gpu, 3000, 30))])
        await asyncio.sleep(0.05)  # a's claim is the older one: the agent expects a first
        await bind(buckets.ledger, node, pod_b, [grants((gpu, 9000, 60))])
        admission_b = await kubelet.allocate_pod(pod_b)
        assert admission_b.ok, admission_b.error
        assert admission_b.containers[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m"  # a's
        agent.send_signal(signal.SIGKILL)  # and the agent restarts in the middle, too
        agent.wait(10)
        agent = start_agent_process(settings, node, nats_url)
        await kubelet.wait_registered("nvidia.com/gpu", after=1, timeout=30)
        admission_b = await kubelet.start_pod(admission_b)
        assert admission_b.ok, admission_b.error
        assert sealed_mib(admission_b.containers[0]) == [(gpu, 9000)]  # its own, sealed
        admission_a = await kubelet.admit_pod(pod_a)
        assert admission_a.ok, admission_a.error
        assert sealed_mib(admission_a.containers[0]) == [(gpu, 3000)]
        state = await ledger_of(buckets.ledger, node)
        assert {a.name: a.state for a in state.allocations.values()} == {
            "a": "allocated", "b": "allocated"}
        assert state.in_flight() == {}
    finally:
        agent.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(10)
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        await kubelet.stop()
    await asyncio.sleep(0)
