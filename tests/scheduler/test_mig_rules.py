"""Dynamic MIG through the scheduler's fit (rule 15 and the grant it writes): a pod on a
dynamic-MIG card becomes the smallest covering instance, charged at the profile's size and
recorded with its placement; pods of one node pack a card into a geometry NVIDIA allows; a card
never mixes libvgpu slices and MIG instances; refusals carry a sentence. Table-driven from
NVIDIA's profile tables (tessera/mig.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.scheduler.cards import build_cards
from tessera.scheduler.ledger import competes
from tessera.scheduler.placement import PodFit, fit_pod
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options

from tessera import hami, mig
from tessera.hami import parse_pod_request
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    MigCapability,
    MigInstanceGrant,
    NodeLedger,
    NodeRegistration,
)
from tessera.settings import TesseraSettings
from tessera.validation import Bounds, ledger_problem, mig_problem, registration_problem

from .factories import container, device, pod

SETTINGS = TesseraSettings()


def dynamic(uuid: str = "GPU-0", model: str = "A100-SXM4-80GB", index: int = 0,
            geometries: list[dict[str, int]] | None = None) -> DeviceInfo:
    memory = mig.MODELS[model].memory_mib
    return device(uuid, index, memory_mib=memory, type=f"NVIDIA-{model}", mode="mig").model_copy(
        update={"mig": MigCapability(model=model, geometries=geometries or [])})


def allocation(uid: str, grants: list[DeviceGrant]) -> Allocation:
    return Allocation(pod_uid=uid, namespace="default", name=uid, node="n",
                      containers=[grants], state=AllocationState.ALLOCATED)


def slice_grant(uuid: str = "GPU-0", mem: int = 1000) -> DeviceGrant:
    return DeviceGrant(uuid=uuid, type="NVIDIA-A100-SXM4-80GB", memory_mib=mem, cores=10)


def mig_grant(profile: str, start: int, uuid: str = "GPU-0",
              model: str = "A100-SXM4-80GB") -> DeviceGrant:
    m = mig.MODELS[model]
    p = m.profile(profile)
    return DeviceGrant(uuid=uuid, type=f"NVIDIA-{model}", memory_mib=m.profile_memory_mib(p),
                       cores=m.profile_cores(p),
                       mig=MigInstanceGrant(profile=profile, start=start, size=p.memory_slices))


def run(devices: list[DeviceInfo], spec: dict[str, Any],
        held: list[Allocation] | None = None) -> PodFit:
    cards = build_cards(NodeRegistration(node="n", devices=devices), held or [], 0.0)
    ctx = FitContext(parse_pod_options(spec, SETTINGS), QuotaBudget())
    return fit_pod(cards, parse_pod_request(spec, SETTINGS), ctx)


def mig_pod(mem: int, cores: int | None = None, mode: str | None = "mig") -> dict[str, Any]:
    return pod(container(mem=mem, cores=cores),
               annotations={hami.ANN_VGPU_MODE: mode} if mode else {})


@pytest.mark.parametrize(
    ("model", "mem", "cores", "profile", "charged"),
    [
        ("A100-SXM4-80GB", 8000, None, "1g.10gb", (10240, 14)),
        ("A100-SXM4-80GB", 15000, None, "1g.20gb", (20480, 14)),
        ("A100-SXM4-80GB", 15000, 25, "2g.20gb", (20480, 28)),
        ("A100-SXM4-80GB", 35000, None, "3g.40gb", (40960, 42)),
        ("A100-SXM4-40GB", 4000, None, "1g.5gb", (5120, 14)),
        ("A30", 10000, None, "2g.12gb", (12288, 50)),
        ("H100 80GB HBM3", 40000, 50, "4g.40gb", (40960, 57)),
        ("H200", 100000, None, "7g.141gb", (144384, 100)),
    ],
)
def test_the_grant_is_the_smallest_covering_profile_charged_at_its_size(
    model, mem, cores, profile, charged
) -> None:
    fit = run([dynamic(model=model)], mig_pod(mem, cores))
    assert fit.ok, fit.reason_text()
    (grant,) = fit.containers[0]
    assert (grant.memory_mib, grant.cores) == charged
    assert grant.mig is not None and grant.mig.profile == profile
    p = mig.MODELS[model].profile(profile)
    assert grant.mig.size == p.memory_slices and grant.mig.start in p.starts
    assert grant.mig.mig_uuid == "" and grant.mig.state == "planned"


def test_a_pod_without_a_mode_on_a_dynamic_card_gets_an_instance() -> None:
    fit = run([dynamic()], mig_pod(8000, mode=None))
    assert fit.ok and fit.containers[0][0].mig is not None


def test_pods_pack_one_card_into_an_allowed_geometry_then_it_is_full() -> None:
    """1g.10gb-, 2g.20gb- and 3g.40gb-sized asks, one pod after another, as the ledger holds
    them: never an overlap, always a geometry NVIDIA documents, and the next ask that has no
    placement is refused with the card's instances named."""
    held: list[Allocation] = []
    asks = [(35000, None), (15000, 25), (8000, None), (8000, None)]
    for i, (mem, cores) in enumerate(asks):
        fit = run([dynamic()], mig_pod(mem, cores), held)
        assert fit.ok, fit.reason_text()
        held.append(allocation(f"p{i}", fit.containers[0]))
    instances = [mig.Instance(g.mig.profile, g.mig.start) for a in held
                 for g in a.mig_grants()]  # fmt: skip
    assert sorted(i.profile for i in instances) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    mig.occupied(mig.MODELS["A100-SXM4-80GB"], instances)  # raises on overlap / bad start
    assert run([dynamic()], mig_pod(1000), held).reason_text() == "1/1 CardInsufficientMemory"


def test_memory_left_but_no_placement_is_refused_with_the_instances_named() -> None:
    """Seven 1g.10gb instances use every compute slice; 10 GiB of memory is still free."""
    held = [allocation(f"p{s}", [mig_grant("1g.10gb", s)]) for s in range(7)]
    refused = run([dynamic()], mig_pod(8000), held)
    assert not refused.ok
    text = refused.reason_text()
    assert text.startswith("1/1 CardMigTopologyInfeasible (1g.10gb: no free placement")
    assert "1g.10gb@6" in text


def test_the_operator_geometries_bound_the_packing() -> None:
    card = dynamic(geometries=[{"3g.40gb": 1, "1g.10gb": 4}])
    held = [allocation("a", [mig_grant("3g.40gb", 4)])]
    small = run([card], mig_pod(8000), held)
    assert small.ok and small.containers[0][0].mig.profile == "1g.10gb"
    refused = run([card], mig_pod(15000, 25), held)  # 2g.20gb, or larger: none allowed
    assert "2g.20gb: outside the allowed geometries" in refused.reason_text()
    # a geometry with only wide profiles: a small ask is charged the allowed profile
    wide = run([dynamic(geometries=[{"3g.40gb": 2}])], mig_pod(8000), held)
    assert wide.ok and wide.containers[0][0].mig.profile == "3g.40gb"
    assert wide.containers[0][0].memory_mib == 40960


def test_a_card_holding_libvgpu_slices_is_refused_for_mig_with_the_reason() -> None:
    held = [allocation("a", [slice_grant()])]
    fit = run([dynamic()], mig_pod(8000), held)
    assert not fit.ok
    assert "1/1 CardMigTopologyInfeasible (the card holds 1 libvgpu slice(s)" in fit.reason_text()


def test_a_card_holding_mig_instances_is_refused_for_libvgpu_and_takes_it_when_empty() -> None:
    hami_core = mig_pod(1000, 10, mode="hami-core")
    fit = run([dynamic()], hami_core, [allocation("a", [mig_grant("1g.10gb", 6)])])
    assert not fit.ok
    assert "holds 1 MIG instance(s)" in fit.reason_text()
    empty = run([dynamic()], hami_core)
    assert empty.ok and empty.containers[0][0].mig is None
    assert empty.containers[0][0].memory_mib == 1000  # a slice: charged what it asked


def test_two_cards_a_mig_pod_goes_to_the_one_without_slices() -> None:
    held = [allocation("a", [slice_grant("GPU-0")])]
    fit = run([dynamic("GPU-0"), dynamic("GPU-1", index=1)], mig_pod(8000), held)
    assert fit.ok and fit.containers[0][0].uuid == "GPU-1"


def test_static_mig_cards_stay_refused_and_plain_cards_do_not_serve_mig() -> None:
    static = device("GPU-s", mode="mig", type="NVIDIA-A100-SXM4-80GB")
    assert run([static], pod(container(mem=1000))).reason_text() == "1/1 CardMigTopologyInfeasible"
    plain = device("GPU-p", type="NVIDIA-A100-SXM4-80GB")
    assert run([plain], mig_pod(1000)).reason_text() == "1/1 CardTypeMismatch"


def test_an_expired_reservation_frees_its_placement() -> None:
    stale = allocation("gone", [mig_grant("7g.80gb", 0)]).model_copy(
        update={"state": AllocationState.RESERVED, "expires_at": -1.0})
    assert run([dynamic()], mig_pod(8000), [stale]).ok


def test_mig_pods_of_other_shapes_never_fly_together() -> None:
    """A crossed guess between pods of one layout is repaired by trading cards; a MIG placement
    belongs to its card, so such pods compete instead."""
    a = allocation("a", [mig_grant("1g.10gb", 6)])
    b = allocation("b", [mig_grant("3g.40gb", 4, uuid="GPU-1")])
    same = allocation("c", [mig_grant("1g.10gb", 5)])
    assert competes(a, b, exchangeable=lambda: True)
    assert not competes(a, same)


# --- the ledger's MIG records, validated as every reader validates a ledger value ----------------


def _ledger(*allocations: Allocation) -> NodeLedger:
    return NodeLedger(node="n", allocations={a.pod_uid: a for a in allocations})


def _registration(**kw: Any) -> NodeRegistration:
    return NodeRegistration(node="n", devices=[dynamic(**kw)])


def _odd(grant: DeviceGrant, **changes: Any) -> DeviceGrant:
    return grant.model_copy(update={"mig": grant.mig.model_copy(update=changes)})


@pytest.mark.parametrize(
    ("grants", "code", "says"),
    [
        ([[mig_grant("3g.40gb", 0)], [mig_grant("3g.40gb", 4)]], None, ""),
        ([[mig_grant("3g.40gb", 0)], [mig_grant("1g.10gb", 2)]], "mig_overlap", "overlaps"),
        ([[mig_grant("4g.40gb", 0)], [mig_grant("4g.40gb", 0, uuid="GPU-x")]], None, ""),
        ([[_odd(mig_grant("1g.10gb", 0), profile="1g.11gb")]], "mig_profile", "no MIG profile"),
        ([[_odd(mig_grant("3g.40gb", 0), start=2)]], "mig_placement", "slice 2 size 4"),
        ([[_odd(mig_grant("1g.10gb", 0), size=3)]], "mig_placement", "not a placement"),
        ([[mig_grant("1g.10gb", 0).model_copy(update={"memory_mib": 100})]], "mig_charge",
         "not the profile's size"),
        ([[mig_grant("1g.10gb", 0)], [slice_grant()]], "mig_mixed", "1 libvgpu slice(s)"),
        ([[mig_grant("4g.40gb", 0)], [mig_grant("3g.40gb", 4)], [mig_grant("1g.10gb", 0)]],
         "mig_overlap", "overlaps"),
    ],
)
def test_ledger_mig_records_are_validated(grants, code, says) -> None:
    held = [allocation(f"p{i}", g) for i, g in enumerate(grants)]
    problem = ledger_problem("n", _ledger(*held), _registration(), Bounds())
    assert (problem.code if problem else None) == code, problem
    assert says in (problem.detail if problem else "")


def test_ledger_mig_records_outside_the_card_geometries_are_refused() -> None:
    held = [allocation("a", [mig_grant("1g.10gb", 0)])]
    ok = _registration(geometries=[{"1g.10gb": 7}])
    assert ledger_problem("n", _ledger(*held), ok, Bounds()) is None
    narrow = _registration(geometries=[{"3g.40gb": 2}])
    problem = ledger_problem("n", _ledger(*held), narrow, Bounds())
    assert problem is not None and problem.code == "mig_geometry"


def test_lapsed_reservations_do_not_count_as_overlap() -> None:
    stale = allocation("old", [mig_grant("7g.80gb", 0)]).model_copy(
        update={"state": AllocationState.RESERVED, "expires_at": 10.0})
    new = allocation("new", [mig_grant("1g.10gb", 6)])
    assert mig_problem("n", _ledger(stale, new), _registration(), at=20.0) is None
    assert mig_problem("n", _ledger(stale, new), _registration(), at=5.0) is not None


@pytest.mark.parametrize(
    ("capability", "code"),
    [
        (MigCapability(model="A100-SXM4-80GB"), None),
        (MigCapability(model="A30"), "mig_model"),  # not this card's model
        (MigCapability(model="B300"), "mig_model"),
        (MigCapability(model="A100-SXM4-80GB", geometries=[{"7g.80gb": 2}]), "mig_geometry"),
        (MigCapability(model="A100-SXM4-80GB", geometries=[{"9g.90gb": 1}]), "mig_geometry"),
    ],
)
def test_registered_capabilities_are_validated(capability, code) -> None:
    reg = NodeRegistration(node="n", devices=[dynamic().model_copy(update={"mig": capability})])
    problem = registration_problem("n", reg, Bounds())
    assert (problem.code if problem else None) == code, problem


# --- the cluster as the durable record: placements in tessera.io/mig-instances -------------------


def test_placements_survive_a_ledger_rebuilt_from_the_pods() -> None:
    from tessera.scheduler.validation import allocation_from_pod

    containers = [[], [mig_grant("3g.40gb", 4), slice_grant("GPU-1")], [mig_grant("1g.10gb", 0)]]
    text = hami.encode_mig_instances(containers)
    assert text == ";3g.40gb@4/4::;1g.10gb@0/1:;"
    assert hami.encode_mig_instances([[slice_grant()]]) == ""  # other pods carry nothing
    spec = pod(container("a"), container("b"), init=[container("i", gpus=None)])
    spec["spec"]["nodeName"] = "n"
    spec["metadata"]["annotations"] = {
        hami.ANN_DEVICES_TO_ALLOCATE: hami.encode_pod_devices(containers),
        hami.ANN_MIG_INSTANCES: text,
    }
    rebuilt = allocation_from_pod(spec, "n")
    assert rebuilt is not None
    got = [[(g.mig.profile, g.mig.start, g.mig.size, g.mig.state) if g.mig else None
            for g in c] for c in rebuilt.containers]  # fmt: skip
    assert got == [[], [("3g.40gb", 4, 4, "planned"), None], [("1g.10gb", 0, 1, "planned")]]
    # unreadable placements: the grants still hold their capacity (as slices)
    spec["metadata"]["annotations"][hami.ANN_MIG_INSTANCES] = "3g.40gb@x/4:;"
    rebuilt = allocation_from_pod(spec, "n")
    assert rebuilt is not None and not rebuilt.mig_grants()
    assert hami.scheduler_owned(hami.ANN_MIG_INSTANCES)  # admission denies it from a user
    # the node agent's record, once the instance exists, carries its UUID: adopted by it
    made = [[_made(mig_grant("1g.10gb", 6))]]
    text = hami.encode_mig_instances(made)
    assert text == "1g.10gb@6/1=MIG-aa:;"
    (g,) = hami.apply_mig_instances([[slice_grant()]], text)[0]
    assert (g.mig.mig_uuid, g.mig.state) == ("MIG-aa", "created")
    with pytest.raises(ValueError):
        hami.apply_mig_instances([[slice_grant()]], "1g.10gb@6/1=GPU-x,y:;")


def _made(g: DeviceGrant) -> DeviceGrant:
    return g.model_copy(update={"mig": g.mig.model_copy(update={"mig_uuid": "MIG-aa",
                                                                "state": "created"})})


@pytest.mark.parametrize("text", ["", "3g.40gb@4/4:", "3g.40gb@4/4:;;", "3g.40gb@4:;",
                                  "a@b/c:;", ":;"])
def test_malformed_placements_are_refused(text) -> None:
    with pytest.raises(ValueError):
        hami.apply_mig_instances([[mig_grant("3g.40gb", 4), slice_grant()]][:1] if text != ":;"
                                 else [[mig_grant("3g.40gb", 4), slice_grant()]], text)
