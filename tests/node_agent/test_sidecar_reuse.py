"""Native sidecars (init containers with restartPolicy: Always) and kubelet's device reuse: the
scheduler's fit, the node agent and kube-sim's kubelet agree on which cards each container gets.

kubelet hands a plain init container's devices to the containers after it; a sidecar runs beside
the app containers, so it keeps the devices it got (even ones it reused) and they leave the pool.
The pod: `prep` (plain init, 2 GPUs), `proxy` (sidecar, 1 GPU), `main` (app, 1 GPU), on a node of
two GPUs. kubelet gives `proxy` either of prep's GPUs at random and `main` the other one; the
agent follows kubelet's pick in the ledger, and every container is sealed with its own grant on
the GPU it really holds, `proxy` and `main` never on the same one.
"""

from __future__ import annotations

import random

from node_agent_rig import running_rig
from tessera.scheduler.cards import build_cards
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options

from tessera import bus
from tessera.hami import parse_pod_request
from tessera.models import NodeRegistration
from tessera.region import SEALED_LIMITS_DIR, read_limits
from tessera.settings import TesseraSettings


def gpu_container(name: str, count: int, mib: int, sidecar: bool = False) -> dict:
    spec: dict = {"name": name, "image": "x", "resources": {"limits": {
        "nvidia.com/gpu": count, "nvidia.com/gpumem": mib, "nvidia.com/gpucores": 10}}}
    if sidecar:
        spec["restartPolicy"] = "Always"
    return spec


def sidecar_pod(name: str) -> dict:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {
            "initContainers": [gpu_container("prep", 2, 4000),
                               gpu_container("proxy", 1, 3000, sidecar=True)],
            "containers": [gpu_container("main", 1, 5000)],
        },
    }


async def test_sidecar_keeps_its_gpu_and_the_app_reuses_the_other(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets, static_gpu_memory_mib=40000) as rig:
        registration = (await bus.read(buckets.nodes, rig.node, NodeRegistration)).value
        settings = TesseraSettings()
        followed = 0
        for seed in range(4):
            rig.kubelet.rng = random.Random(seed)
            pod = sidecar_pod(f"side{seed}")
            request = parse_pod_request(pod, settings)
            ledger = await rig.ledger() if seed else None
            others = ledger.allocations.values() if ledger else []
            fit = fit_pod(build_cards(registration, others, 0.0), request,
                          FitContext(parse_pod_options(pod, settings), QuotaBudget()))
            assert fit.ok, fit.reason_text()
            await rig.bind(pod, fit.containers, init_count=2, sidecars=sorted(request.sidecars))
            admission = await rig.kubelet.admit_pod(pod)
            assert admission.ok, admission.error
            allocation = next(a for a in (await rig.ledger()).allocations.values()
                              if a.name == pod["metadata"]["name"])
            held = {}
            for index, container in enumerate(admission.containers):
                gpus = sorted(d.rpartition("-")[0] for d in container.device_ids)
                granted = allocation.containers[index]
                assert gpus == sorted(g.uuid for g in granted), (seed, container.name)
                limits = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
                assert limits is not None, (seed, container.name)
                assert sorted((d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices) == sorted(
                    (g.uuid, g.memory_mib) for g in granted)
                held[container.name] = gpus
            assert held["proxy"] != held["main"] and set(held["proxy"] + held["main"]) == set(
                held["prep"])  # the sidecar keeps one of prep's GPUs, the app reuses the other
            assert allocation.state == "allocated"
            followed += allocation.containers[1] != fit.containers[1]
        assert followed, "kubelet never picked the other card: the follow path was not tested"
