"""Several pods in flight on one node at once, admitted by kubelet in an order the agent does not
expect, across a kubelet restart and an agent SIGKILL: every container starts, with its own
pod's limits on the GPUs kubelet really gave it, and the ledger ends agreeing with kubelet."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import uuid
from typing import Any

import pytest
from node_agent_rig import bind, grants, ledger_of, make_pod, rig_settings, running_rig
from tessera.kube_sim.kubelet import PodAdmission, SimKubelet
from tessera.node_agent.nvidia_source import StaticSource
from test_crossed_limits import start_agent_process

from tessera import hami
from tessera.models import NodeLedger
from tessera.region import SEALED_LIMITS_DIR, read_limits


def sealed(admission: PodAdmission) -> list[tuple[str, int]]:
    container = admission.containers[0]
    limits = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
    assert limits is not None, f"{admission.name}: nothing sealed"
    return [(d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices]


def gpu_of_replica(device_id: str) -> str:
    return device_id.rpartition("-")[0]


def check_exact(admissions: list[PodAdmission], wanted_mib: dict[str, int],
                ledger: NodeLedger) -> None:  # fmt: skip
    """Each pod: started, sealed with its own memory on the GPU of its own device IDs, and the
    ledger's grant says the same; nothing left in flight."""
    by_name = {a.name: a for a in ledger.allocations.values()}
    for admission in admissions:
        assert admission.ok, f"{admission.name}: {admission.error}"
        gpu = gpu_of_replica(admission.containers[0].device_ids[0])
        assert sealed(admission) == [(gpu, wanted_mib[admission.name])], admission.name
        grant = by_name[admission.name].containers[0][0]
        assert (grant.uuid, grant.memory_mib) == (gpu, wanted_mib[admission.name])
        assert by_name[admission.name].state == "allocated"
    assert ledger.in_flight() == {}


async def wait_annotation(rig: Any, name: str, containers: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        pod = await rig.cluster.get_pod("team", name)
        text = (pod["metadata"].get("annotations") or {}).get(hami.ANN_DEVICES_ALLOCATED)
        if text and hami.decode_pod_devices(text) == containers:
            return
        assert asyncio.get_running_loop().time() < deadline, (name, text)
        await asyncio.sleep(0.05)


async def test_identical_pods_admitted_in_reverse_order_are_swapped_before_sealing(
    short_dir, nc, buckets
):
    """Six pods of one shape over two GPUs; kubelet admits them newest first and its List does
    not show which pod it is admitting, so every guess is wrong: PreStart swaps the grants of
    the crossed pods (same amounts on each card)."""
    async with running_rig(short_dir, nc, buckets, lists_admitting=False) as rig:
        pods = [make_pod(f"same{i}", [("main", 1)]) for i in range(6)]
        for i, pod in enumerate(pods):
            await rig.bind(pod, [grants((rig.gpus[i % 2], 2000, 20))])
        admissions = [await rig.kubelet.admit_pod(p) for p in reversed(pods)]
        ledger = await rig.ledger()
        check_exact(admissions, {p["metadata"]["name"]: 2000 for p in pods}, ledger)
        # The pods' own record (HAMi's annotations, from which a lost ledger is rebuilt) was
        # rewritten to the repaired grants too.
        for allocation in ledger.allocations.values():
            await wait_annotation(rig, allocation.name, allocation.containers)
        per_gpu = [sum(1 for a in admissions
                       if gpu_of_replica(a.containers[0].device_ids[0]) == g)
                   for g in rig.gpus]  # fmt: skip
        assert per_gpu == [3, 3]


async def test_pods_of_other_sizes_on_one_gpu_are_relabelled_before_sealing(
    short_dir, nc, buckets
):
    """Guessing (kubelet's List does not show the pod under admission), pods of other amounts
    on one GPU cross; PreStart relabels each directory to its holder before sealing."""
    async with running_rig(short_dir, nc, buckets, lists_admitting=False) as rig:
        sizes = {"s1": 1000, "s2": 2000, "s3": 3000, "s4": 4000}
        pods = {n: make_pod(n, [("main", 1)]) for n in sizes}
        for name, pod in pods.items():
            await rig.bind(pod, [grants((rig.gpus[0], sizes[name], 10))])
        admissions = [await rig.kubelet.admit_pod(pods[n]) for n in ("s3", "s1", "s4", "s2")]
        check_exact(admissions, sizes, await rig.ledger())


async def test_different_shapes_in_flight_are_resolved_from_kubelets_view(
    short_dir, nc, buckets
):
    """Pods of four kinds in flight together (1 GPU of 3000 MiB on GPU 0 twice, 1 GPU of 5000
    MiB on GPU 1, 2 GPUs of 2000 MiB), admitted b, d, c, a (a guess by bind order would give
    b a's GPU, a cross no swap can repair): the agent reads the pod under
    admission off kubelet's pod-resources List, so each Allocate is answered for its own pod
    (the env kubelet takes carries the pod's own amounts) and no grant had to move."""
    async with running_rig(short_dir, nc, buckets) as rig:
        g0, g1 = rig.gpus
        kinds = {"a": [grants((g0, 3000, 30))], "b": [grants((g1, 5000, 50))],
                 "c": [grants((g0, 2000, 20), (g1, 2000, 20))], "d": [grants((g0, 3000, 30))]}
        pods = {n: make_pod(n, [("main", len(g[0]))]) for n, g in kinds.items()}
        for n, pod in pods.items():
            await rig.bind(pod, kinds[n])
        admissions = [await rig.kubelet.admit_pod(pods[n]) for n in "bdca"]
        ledger = await rig.ledger()
        by_name = {a.name: a for a in ledger.allocations.values()}
        for admission in admissions:
            assert admission.ok, f"{admission.name}: {admission.error}"
            want = kinds[admission.name][0]
            assert by_name[admission.name].containers[0] == want  # nothing moved
            container = admission.containers[0]
            assert sorted(gpu_of_replica(d) for d in container.device_ids) == sorted(
                g.uuid for g in want)
            assert container.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{want[0].memory_mib}m"
            limits = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
            assert limits is not None
            assert sorted((d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices) == sorted(
                (g.uuid, g.memory_mib) for g in want)
            assert by_name[admission.name].state == "allocated"
        assert ledger.in_flight() == {}


async def test_crossed_pods_of_other_amounts_trade_cards_before_sealing(short_dir, nc, buckets):
    """Guessing (kubelet's List does not show the pod under admission): a (3000 MiB on GPU 0)
    and b (5000 MiB on GPU 1) are in flight; kubelet admits b first and gets a's GPU. PreStart
    sees b holding it and, before sealing, has the two trade cards keeping their amounts (it
    fits): b runs with 5000 MiB on GPU 0, then a is admitted onto GPU 1 with 3000 MiB."""
    async with running_rig(short_dir, nc, buckets, lists_admitting=False) as rig:
        g0, g1 = rig.gpus
        pod_a, pod_b = make_pod("a", [("main", 1)]), make_pod("b", [("main", 1)])
        await rig.bind(pod_a, [grants((g0, 3000, 30))])
        await asyncio.sleep(0.05)  # a's claim is the older one: the agent expects a first
        await rig.bind(pod_b, [grants((g1, 5000, 50))])
        admission_b = await rig.kubelet.admit_pod(pod_b)
        assert admission_b.ok, admission_b.error
        assert gpu_of_replica(admission_b.containers[0].device_ids[0]) == g0  # a's card
        assert sealed(admission_b) == [(g0, 5000)]  # but b's own amounts, sealed
        admission_a = await rig.kubelet.admit_pod(pod_a)
        assert admission_a.ok, admission_a.error
        check_exact([admission_a, admission_b], {"a": 3000, "b": 5000}, await rig.ledger())
        assert gpu_of_replica(admission_a.containers[0].device_ids[0]) == g1


def hami_pod(node: str, devices: str) -> dict[str, Any]:
    """A pod HAMi's scheduler placed on this node before it switched to Tessera's agent
    (docs/migrating-from-hami.md): in no ledger, its grants only in HAMi's annotations."""
    spec = make_pod(f"hami-{uuid.uuid4().hex[:6]}", [("main", 1)])
    spec["metadata"]["annotations"] = {
        hami.ANN_DEVICES_ALLOCATED: devices, hami.ANN_DEVICES_TO_ALLOCATE: ";",
        hami.ANN_VGPU_NODE: node, hami.ANN_BIND_PHASE: hami.BIND_PHASE_SUCCESS,
    }  # fmt: skip
    spec["spec"] |= {"schedulerName": "hami-scheduler", "nodeName": node}
    spec["status"] = {"phase": "Running"}
    return spec


@pytest.mark.parametrize("held_mib, readable, traded", [
    (12000, True, False),  # a's 3000 beside it fits; b's 5000 would make 17000 of 16000 MiB
    (2000, True, True),  # room for b's 5000 beside it: the trade is made as without HAMi
    (12000, False, False),  # its grants do not read: nothing is moved onto any card
])  # fmt: skip
async def test_a_trade_counts_hami_pods_on_the_cards(
    short_dir, nc, buckets, held_mib: int, readable: bool, traded: bool
):
    """The trade of test_crossed_pods_of_other_amounts_trade_cards_before_sealing, on a node
    where a HAMi pod holds room on a's card (GPU 0): the agent judges the trade with it, and
    refuses it (b's start fails, nothing sealed, no grant moves) when b's amounts would overfill
    that card or the HAMi pod cannot be read."""
    async with running_rig(short_dir, nc, buckets, lists_admitting=False) as rig:
        g0, g1 = rig.gpus
        devices = f"{g0},NVIDIA-A100,{held_mib},10:;" if readable else f"{g0},broken;"
        rig.cluster.add_pod(hami_pod(rig.node, devices))
        pod_a, pod_b = make_pod("a", [("main", 1)]), make_pod("b", [("main", 1)])
        await rig.bind(pod_a, [grants((g0, 3000, 30))])
        await asyncio.sleep(0.05)  # a's claim is the older one: the agent expects a first
        await rig.bind(pod_b, [grants((g1, 5000, 50))])
        admission_b = await rig.kubelet.admit_pod(pod_b)
        assert gpu_of_replica(admission_b.containers[0].device_ids[0]) == g0  # a's card
        by_name = {a.name: a for a in (await rig.ledger()).allocations.values()}
        cards = {n: [(g.uuid, g.memory_mib) for g in by_name[n].containers[0]] for n in "ab"}
        if traded:
            assert admission_b.ok, admission_b.error
            assert sealed(admission_b) == [(g0, 5000)]
            assert cards == {"a": [(g1, 3000)], "b": [(g0, 5000)]}
            return
        assert not admission_b.ok, "b started on a card whose room a HAMi pod holds"
        container = admission_b.containers[0]
        assert read_limits(container.mount(SEALED_LIMITS_DIR).host_path) is None
        assert cards == {"a": [(g0, 3000)], "b": [(g1, 5000)]}  # no grant moved


async def test_kubelet_restart_with_pods_in_flight(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        pods = [make_pod(f"r{i}", [("main", 1)]) for i in range(3)]
        for pod in pods:
            await rig.bind(pod, [grants((rig.gpus[0], 1500, 15))])
        half = await rig.kubelet.allocate_pod(pods[2])  # admitted, not started yet
        assert half.ok, half.error
        await rig.kubelet.restart()  # every socket deleted: the agent must re-register
        await rig.kubelet.wait_registered(rig.settings.resource_name, after=1, timeout=20)
        admissions = [await rig.kubelet.start_pod(half)]
        admissions += [await rig.kubelet.admit_pod(p) for p in pods[:2]]
        check_exact(admissions, {p["metadata"]["name"]: 1500 for p in pods}, await rig.ledger())


async def test_agent_sigkill_with_pods_in_flight(short_dir, nats_url, buckets):
    """Four pods of one shape over two GPUs in flight; kubelet allocates two of them newest
    first, the agent is SIGKILLed before they start and comes back; then the starts and the
    other two admissions (also out of order) all end exact."""
    settings = rig_settings(short_dir)
    node = f"node-{uuid.uuid4().hex[:8]}"
    gpus = [d.uuid for d in StaticSource(settings, node).discover()]
    kubelet = SimKubelet(settings.device_plugin_dir, settings.pod_resources_socket)
    await kubelet.start()
    agent = start_agent_process(settings, node, nats_url)
    try:
        await kubelet.wait_registered("nvidia.com/gpu", timeout=30)
        pods = [make_pod(f"k{i}", [("main", 1)]) for i in range(4)]
        for i, pod in enumerate(pods):
            await bind(buckets.ledger, node, pod, [grants((gpus[i % 2], 2500, 25))])
            await asyncio.sleep(0.01)  # claims in a known order
        first: list[Any] = [await kubelet.allocate_pod(p) for p in (pods[3], pods[2])]
        assert all(a.ok for a in first), [a.error for a in first]
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        agent = start_agent_process(settings, node, nats_url)
        await kubelet.wait_registered("nvidia.com/gpu", after=1, timeout=30)
        admissions = [await kubelet.start_pod(a) for a in first]
        admissions += [await kubelet.admit_pod(p) for p in (pods[1], pods[0])]
        check_exact(admissions, {p["metadata"]["name"]: 2500 for p in pods},
                    await ledger_of(buckets.ledger, node))  # fmt: skip
    finally:
        agent.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(10)
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        await kubelet.stop()
