"""Init containers and kubelet's device reuse, end to end: the scheduler's placement (pure fit),
the node agent, and kube-sim's kubelet following the device manager's rules (a finished init
container's devices go to the later containers first, any of them when more are reusable than
asked). Every container starts, sealed with exactly its own grant on the GPUs it was given."""

from __future__ import annotations

import random
from typing import Any

import pytest
from node_agent_rig import grants, running_rig
from tessera.kube_sim.kubelet import PodAdmission
from tessera.scheduler.cards import build_cards
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, parse_pod_options
from test_in_flight import hami_pod

from tessera import bus
from tessera.hami import parse_pod_request
from tessera.models import NodeLedger, NodeRegistration
from tessera.region import SEALED_LIMITS_DIR, read_limits
from tessera.settings import TesseraSettings


def gpu_container(name: str, gpus: int, mem: int) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": {
        "nvidia.com/gpu": gpus, "nvidia.com/gpumem": mem, "nvidia.com/gpucores": 10,
    }}}  # fmt: skip


def gpu_pod(name: str, init: list[dict], app: list[dict]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
            "spec": {"initContainers": init, "containers": app}}  # fmt: skip


async def place_and_admit(rig: Any, pod: dict[str, Any]) -> tuple[PodAdmission, Any]:
    """Fit the pod with the scheduler's rules on the agent's registration, bind it, admit it."""
    from node_agent_rig import bind

    registration = await bus.read(rig.buckets.nodes, rig.node, NodeRegistration)
    assert registration is not None
    settings = TesseraSettings(gpu_scheduler_policy="spread")
    current = await bus.read(rig.buckets.ledger, rig.node, NodeLedger)
    existing = current.value.allocations.values() if current else []
    outcome = fit_pod(build_cards(registration.value, existing, 0.0),
                      parse_pod_request(pod, settings),
                      FitContext(parse_pod_options(pod, settings)))  # fmt: skip
    assert outcome.ok, outcome.reason_text()
    rig.cluster.add_pod(pod)
    await bind(rig.buckets.ledger, rig.node, pod, outcome.containers,
               init_count=len(pod["spec"]["initContainers"]))  # fmt: skip
    admission = await rig.kubelet.admit_pod(pod)
    assert admission.ok, admission.error
    return admission, outcome


def sealed(admission: PodAdmission) -> dict[str, list[tuple[str, int]]]:
    out = {}
    for c in admission.containers:
        limits = read_limits(c.mount(SEALED_LIMITS_DIR).host_path)
        assert limits is not None, f"{c.name}: nothing sealed"
        out[c.name] = sorted((d.uuid, d.mem_limit_bytes >> 20) for d in limits.devices)
    return out


def gpus_given(admission: PodAdmission, name: str) -> set[str]:
    return {d.rpartition("-")[0] for d in admission.container(name).device_ids}


def drop(ledger: NodeLedger | None, uid: str) -> NodeLedger:
    assert ledger is not None
    new = ledger.model_copy(deep=True)
    del new.allocations[uid]
    return new


async def ledger_grants(rig: Any, uid: str) -> dict[str, list[tuple[str, int]]]:
    allocation = (await rig.ledger()).allocations[uid]
    return {n: sorted((g.uuid, g.memory_mib) for g in grants)
            for n, grants in zip(allocation.container_names, allocation.containers, strict=True)}


async def test_init_and_app_on_one_card_init_needing_more(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        pod = gpu_pod("one", [gpu_container("init", 1, 9000)], [gpu_container("app", 1, 2000)])
        admission, _ = await place_and_admit(rig, pod)
        card = gpus_given(admission, "init")
        assert gpus_given(admission, "app") == card  # kubelet reused the init's device
        (gpu,) = card
        assert sealed(admission) == {"init": [(gpu, 9000)], "app": [(gpu, 2000)]}
        assert await ledger_grants(rig, "uid-one") == sealed(admission)


async def test_app_on_the_init_card_and_a_new_one(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        pod = gpu_pod("two", [gpu_container("init", 1, 3000)], [gpu_container("app", 2, 1000)])
        admission, _ = await place_and_admit(rig, pod)
        assert gpus_given(admission, "init") < gpus_given(admission, "app")
        assert len(gpus_given(admission, "app")) == 2
        assert await ledger_grants(rig, "uid-two") == sealed(admission)


async def test_kubelet_picking_any_of_two_init_cards_is_followed(short_dir, nc, buckets):
    """Init on both cards (more than the app asks): kubelet gives the app either one; whichever
    it is, the ledger follows before the start and the app is sealed on that card."""
    async with running_rig(short_dir, nc, buckets) as rig:
        picked = set()
        for seed in range(6):
            rig.kubelet.rng = random.Random(seed)
            pod = gpu_pod(f"pick{seed}", [gpu_container("init", 2, 5000)],
                          [gpu_container("app", 1, 2000)])  # fmt: skip
            admission, _ = await place_and_admit(rig, pod)
            (app_gpu,) = gpus_given(admission, "app")
            assert app_gpu in gpus_given(admission, "init")
            assert sealed(admission)["app"] == [(app_gpu, 2000)]
            assert await ledger_grants(rig, f"uid-pick{seed}") == sealed(admission)
            picked.add(app_gpu)
            rig.kubelet.remove_pod(f"uid-pick{seed}")  # the pod ends: free its share
            await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger,
                                 lambda led, u=f"uid-pick{seed}": drop(led, u))  # fmt: skip
        assert len(picked) == 2  # both of kubelet's choices were exercised


class PickCard:
    """kube-sim's kubelet chooses reusable devices with `rng.sample`: this one takes `card`'s."""

    def __init__(self, card: str) -> None:
        self.card = card

    def sample(self, population: list[str], k: int) -> list[str]:
        return sorted(population, key=lambda d: not d.startswith(self.card))[:k]


@pytest.mark.parametrize("held_mib, followed", [(10000, False), (2000, True)])
async def test_following_kubelets_reuse_counts_hami_pods(
    short_dir, nc, buckets, held_mib: int, followed: bool
):
    """The app is granted 9000 MiB on the init's first card; kubelet hands it the other init
    card, where a HAMi pod (in no ledger: a cluster migrating from HAMi) holds room. Following
    kubelet there is judged with that pod: 9000 beside 10000 would overfill the 16000 MiB card,
    so the start is refused, nothing sealed and the grant unmoved; beside 2000 it is followed."""
    async with running_rig(short_dir, nc, buckets) as rig:
        g0, g1 = rig.gpus
        rig.cluster.add_pod(hami_pod(rig.node, f"{g1},NVIDIA-A100,{held_mib},10:;"))
        rig.kubelet.rng = PickCard(g1)
        pod = gpu_pod("hm", [gpu_container("init", 2, 5000)], [gpu_container("app", 1, 9000)])
        await rig.bind(pod, [grants((g0, 5000, 10), (g1, 5000, 10)), grants((g0, 9000, 10))],
                       init_count=1)  # fmt: skip
        admission = await rig.kubelet.admit_pod(pod)
        app_grants = (await ledger_grants(rig, "uid-hm"))["app"]
        if followed:
            assert admission.ok, admission.error
            assert gpus_given(admission, "app") == {g1}
            assert sealed(admission)["app"] == app_grants == [(g1, 9000)]
            return
        assert not admission.ok, "the app started on a card whose room a HAMi pod holds"
        assert f"kubelet chose GPU(s) {g1}" in admission.error, admission.error  # refused
        assert not admission.container("app").started
        assert app_grants == [(g0, 9000)]  # the grant did not move
