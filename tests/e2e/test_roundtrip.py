"""Every pod spec a user can copy (examples, the charts' verify pod, README/docs snippets: see
tests/kube_sim/spec_sources.py) through the whole local stack, one at a time: kube-sim stores it
with canonical quantities (`gpumem: 3000` → `3k`, as kube-apiserver does), the webhook admits
that, and the scheduler places exactly the slice the user meant (3000 MiB), or the spec stays
Pending with a reason where it says it would (a card too small, a resource no node offers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kube_sim.spec_sources import PodSpec, pod_specs

from tessera import hami
from tessera.quantity import canonical
from tessera.settings import TesseraSettings
from tessera_cli.stack import make_nodes

from .conftest import RunningStack, grants, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

CARD_MIB = 24576
MEM = "nvidia.com/gpumem"
SETTINGS = TesseraSettings()
# NVIDIA's specs (this stack has NVIDIA nodes only; the other vendors' examples run on the mixed
# cluster of tests/e2e/test_vendors_stack.py).
SPECS = [s for s in pod_specs()
         if (request := hami.parse_pod_request(s.pod, SETTINGS)).wants_gpu
         and all(r.family == "nvidia" for r in request.all if r is not None)]


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(make_nodes(2, 4, CARD_MIB, "NVIDIA A10", prefix="sim-node"))


def slices(request: hami.PodRequest) -> list[tuple[int, int, int | None] | None]:
    """GPUs and memory per container (the webhook may add cores: a bare GPU is a whole card)."""
    return [(r.count, r.memory_mib, r.memory_percentage) if r else None for r in request.all]


def refusal(pod: dict) -> str | None:
    return next((c.get("message") for c in pod["status"].get("conditions") or []
                 if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)


def fits_a_card(spec: PodSpec) -> bool:
    request = hami.parse_pod_request(spec.pod, SETTINGS)
    return all(r.memory_on(CARD_MIB) <= CARD_MIB and r.count <= 4 for r in request.all if r)


def test_every_spec_is_placed_with_the_slice_meant(sim: RunningStack) -> None:
    assert any(s.source.startswith("charts/") for s in SPECS)
    kube = sim.kube
    namespace = f"rt-{uuid.uuid4().hex[:6]}"
    for spec in SPECS:
        pod = {**spec.pod, "metadata": {**spec.pod["metadata"], "namespace": namespace}}
        created = kube.create_pod_retrying(pod, namespace)
        name = created["metadata"]["name"]
        meant = hami.parse_pod_request(spec.pod, SETTINGS)
        for written, kept in zip(spec.pod["spec"]["containers"], created["spec"]["containers"],
                                 strict=True):
            memory = ((written.get("resources") or {}).get("limits") or {}).get(MEM)
            if memory is not None:  # stored as kube-apiserver stores it: 3000 → 3k
                assert kept["resources"]["limits"][MEM] == canonical(memory), spec.source
        stored = hami.parse_pod_request(created, SETTINGS)  # canonical, and through the webhook
        assert slices(stored) == slices(meant), f"{spec.source}: stored as {created['spec']}"
        if not fits_a_card(spec):
            reason = kube.wait_for(f"{spec.source} refused by the scheduler",
                                   lambda name=name: refusal(kube.pod(namespace, name)))
            assert "CardInsufficientMemory" in reason, (spec.source, reason)
        else:
            running = kube.wait_running(namespace, name, timeout_s=30)
            placed = grants(running)
            wanted = [r for r in meant.all if r is not None]
            assert len(placed) == len(wanted), (spec.source, placed)
            for request, devices in zip(wanted, placed, strict=True):
                assert len(devices) == request.count, (spec.source, devices)
                assert {d.memory_mib for d in devices} == {request.memory_on(CARD_MIB)}, (
                    spec.source, devices)
        kube.delete_pod(namespace, name)
        kube.wait_for(f"{name} gone", lambda name=name: all(
            p["metadata"]["name"] != name for p in kube.pods(namespace)))
