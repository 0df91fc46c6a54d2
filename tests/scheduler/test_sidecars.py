"""Native sidecars (init containers with restartPolicy: Always) run beside the app containers:
the scheduler, the quota charge and the ledger's usage sum them with the app, never max them."""

from __future__ import annotations

from typing import Any

from tessera.scheduler.cards import allocation_usage, build_cards
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.quota_client import grants_charge
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options

from tessera.hami import parse_pod_request, quota_charge
from tessera.models import Allocation, AllocationState, DeviceGrant, NodeRegistration
from tessera.settings import TesseraSettings

from .factories import GIB, container, device, pod

SETTINGS = TesseraSettings()


def sidecar(name: str, mem: int) -> dict[str, Any]:
    return {**container(name, mem=mem, cores=10), "restartPolicy": "Always"}


def fit_on(cards_mib: list[int], spec: dict[str, Any]) -> Any:
    devices = [device(f"GPU-{i}", i, memory_mib=m) for i, m in enumerate(cards_mib)]
    cards = build_cards(NodeRegistration(node="n", devices=devices), [], 0.0)
    ctx = FitContext(parse_pod_options(spec, SETTINGS), QuotaBudget())
    return fit_pod(cards, parse_pod_request(spec, SETTINGS), ctx)


def test_sidecar_and_app_do_not_share_one_card_beyond_its_memory() -> None:
    # 16 GiB sidecar + 16 GiB app on one 24 GiB card: 32 GiB would be granted if maxed.
    spec = pod(container("app", mem=16 * GIB, cores=10), init=[sidecar("proxy", 16 * GIB)])
    assert not fit_on([24 * GIB], spec).ok
    two = fit_on([24 * GIB, 24 * GIB], spec)
    assert two.ok
    assert {g.uuid for c in two.containers for g in c} == {"GPU-0", "GPU-1"}  # one card each
    # A plain init container of the same size runs before the app: maxed, one card is enough.
    plain = pod(container("app", mem=16 * GIB, cores=10),
                init=[container("init", mem=16 * GIB, cores=10)])
    assert fit_on([24 * GIB], plain).ok


def test_later_init_container_fits_beside_running_sidecars() -> None:
    # Sidecar 10 GiB starts first; the migration init container (16 GiB) runs beside it.
    spec = pod(container("app", mem=4 * GIB, cores=10),
               init=[sidecar("proxy", 10 * GIB), container("migrate", mem=16 * GIB, cores=10)])
    assert not fit_on([24 * GIB], spec).ok
    assert fit_on([32 * GIB], spec).ok


def test_quota_charge_sums_sidecars_with_the_app() -> None:
    spec = pod(container("app", mem=6000, cores=10),
               init=[sidecar("proxy", 2000), container("init", mem=7000, cores=10)])
    request = parse_pod_request(spec, SETTINGS)
    assert request.sidecars == frozenset({0})
    assert quota_charge(request) == (8000, 20, 2)  # max(6000 + 2000, 7000)
    grants = [[DeviceGrant(uuid="g", type="t", memory_mib=2000, cores=10)],
              [DeviceGrant(uuid="g", type="t", memory_mib=7000, cores=10)],
              [DeviceGrant(uuid="g", type="t", memory_mib=6000, cores=10)]]
    assert grants_charge(grants, 2, request.sidecars) == (8000, 20, 2)
    assert grants_charge(grants, 2) == (7000, 10, 1)  # without the sidecar rule: maxed


def test_ledger_usage_keeps_sidecars_after_init_is_done() -> None:
    def grant(mib: int) -> list[DeviceGrant]:
        return [DeviceGrant(uuid="GPU-0", type="t", memory_mib=mib, cores=10)]

    allocation = Allocation(pod_uid="u", namespace="d", name="p", node="n",
                            containers=[grant(2000), grant(7000), grant(6000)], init_count=2,
                            sidecars=[0], state=AllocationState.BOUND)
    assert allocation_usage(allocation)["GPU-0"].memory_mib == 8000
    done = allocation.model_copy(update={"init_done": True})
    assert allocation_usage(done)["GPU-0"].memory_mib == 8000  # sidecar + app, still running
    devices = [device("GPU-0", 0, memory_mib=24 * GIB)]
    cards = build_cards(NodeRegistration(node="n", devices=devices), [done], 0.0)
    assert cards[0].used_mem == 8000
