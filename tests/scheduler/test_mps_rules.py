"""MPS cards in the fit rules (HAMi's rule 3, CardTypeMismatch, covers the device mode):
a pod asking `nvidia.com/vgpu-mode: mps` goes only to cards in MPS mode, a pod asking another
mode never to one, and an MPS card takes one card per container (a client reaches one card's
control daemon). Memory and cores are charged as on any card."""

from __future__ import annotations

from .factories import container, device, pod
from .test_rules import picked, run_fit

MPS = {"nvidia.com/vgpu-mode": "mps"}


def test_an_mps_pod_goes_only_to_mps_cards_and_is_charged_as_usual() -> None:
    cards = [device("GPU-0", 0), device("GPU-1", 1, mode="mps")]
    fit = run_fit(cards, pod(container(mem=4000, cores=30), annotations=MPS))
    assert fit.ok, fit.reason_text()
    assert picked(fit) == [["GPU-1"]]
    assert [(g.memory_mib, g.cores) for g in fit.containers[0]] == [(4000, 30)]
    full = run_fit(cards, pod(container(mem=4000, cores=30), annotations=MPS),
                   used={"GPU-1": (device().memory_mib - 1000, 0, 1)})
    assert not full.ok and full.reason_text() == "1/2 CardInsufficientMemory, 1/2 CardTypeMismatch"


def test_other_modes_never_land_on_an_mps_card() -> None:
    mps_only = [device("GPU-1", 0, mode="mps")]
    core = run_fit(mps_only, pod(container(mem=1000),
                                 annotations={"nvidia.com/vgpu-mode": "hami-core"}))
    assert not core.ok and core.reason_text() == "1/1 CardTypeMismatch"
    # No mode asked: the node's mode decides (HAMi), the pod is served as an MPS client.
    assert run_fit(mps_only, pod(container(mem=1000))).ok


def test_an_mps_card_serves_one_card_per_container() -> None:
    cards = [device("GPU-0", 0, mode="mps"), device("GPU-1", 1, mode="mps")]
    fit = run_fit(cards, pod(container(gpus=2, mem=1000), annotations=MPS))
    assert not fit.ok
    assert "CardTypeMismatch" in fit.reason_text()
