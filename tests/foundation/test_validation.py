"""The pure bus-value checks (tessera.validation), table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.models import (
    Allocation,
    DeviceGrant,
    DeviceInfo,
    InFlightClaim,
    LimitsSetRequest,
    NodeLedger,
    NodeRegistration,
    QuotaAmount,
    QuotaState,
)
from tessera.validation import (
    MARK_SKEW_S,
    MAX_NOMINATION_S,
    Bounds,
    ledger_problem,
    limits_problem,
    model_memory_ceiling,
    quota_problem,
    registration_problem,
)


def device(**overrides: Any) -> DeviceInfo:
    values: dict[str, Any] = {"uuid": "GPU-a", "index": 0, "type": "NVIDIA-A10",
                              "memory_mib": 24576, "physical_memory_mib": 24576}  # fmt: skip
    values.update(overrides)
    return DeviceInfo(**values)


@pytest.mark.parametrize(
    ("devices", "bounds", "code"),
    [
        ([device()], Bounds(), None),
        ([device(memory_mib=245760, physical_memory_mib=245760)], Bounds(), "memory_out_of_range"),
        ([device(memory_mib=245760)], Bounds(), "memory_out_of_range"),  # 10x the physical
        ([device(memory_mib=49152)], Bounds(memory_scaling=2.0), None),  # scaling allows it
        ([device(type="NVIDIA-A100-SXM4-80GB", memory_mib=81920, physical_memory_mib=81920)],
         Bounds(), None),
        ([device(type="NVIDIA-A100-SXM4-40GB", memory_mib=81920, physical_memory_mib=81920)],
         Bounds(), "memory_out_of_range"),
        ([device(type="NVIDIA-Foo", memory_mib=400 * 1024, physical_memory_mib=400 * 1024)],
         Bounds(), "memory_out_of_range"),
        ([device(physical_memory_mib=0, memory_mib=0)], Bounds(), "memory_out_of_range"),
        ([device(cores=1000)], Bounds(), "cores_out_of_range"),
        ([device(cores=200)], Bounds(core_scaling=2.0), None),
        ([device(split_count=5000)], Bounds(), "split_count_out_of_range"),
        ([device(), device(index=1)], Bounds(), "device_uuid"),
        ([device(), device(uuid="GPU-b")], Bounds(), "device_index"),
        ([device(uuid="GPU,a:")], Bounds(), "device_uuid"),
        ([device(uuid=f"GPU-{i}", index=i) for i in range(65)], Bounds(), "device_count"),
        ([device(numa=99)], Bounds(), "numa_out_of_range"),
    ],
)  # fmt: skip
def test_registration_bounds(devices: list[DeviceInfo], bounds: Bounds, code: str | None) -> None:
    problem = registration_problem("n1", NodeRegistration(node="n1", devices=devices), bounds)
    assert (problem.code if problem else None) == code


def test_registration_under_another_key_is_rejected() -> None:
    problem = registration_problem("n2", NodeRegistration(node="n1", devices=[device()]), Bounds())
    assert problem is not None and problem.code == "key_mismatch"


def test_model_names_bound_the_memory() -> None:
    assert model_memory_ceiling("NVIDIA-A10") == int(24576 * 1.1)
    assert model_memory_ceiling("NVIDIA-A100-SXM4-80GB") == int(80 * 1024 * 1.1)
    assert model_memory_ceiling("NVIDIA-Unknown") is None


def allocation(memory: int = 1000, cores: int = 10, **overrides: Any) -> Allocation:
    values: dict[str, Any] = {
        "pod_uid": "u1", "namespace": "ns", "name": "p", "node": "n1",
        "containers": [[DeviceGrant(uuid="GPU-a", type="t", memory_mib=memory, cores=cores)]],
    }  # fmt: skip
    values.update(overrides)
    return Allocation(**values)


REGISTRATION = NodeRegistration(node="n1", devices=[device()])


@pytest.mark.parametrize(
    ("ledger", "registration", "code"),
    [
        (NodeLedger(node="n1", allocations={"u1": allocation()}), REGISTRATION, None),
        (NodeLedger(node="n1", allocations={"u1": allocation(memory=24577)}), REGISTRATION,
         "grant_above_capacity"),
        (NodeLedger(node="n1", allocations={"u1": allocation(cores=101)}), REGISTRATION,
         "grant_above_capacity"),
        # Without the registration, the absolute bounds still apply.
        (NodeLedger(node="n1", allocations={"u1": allocation(memory=10**7)}), None,
         "grant_above_capacity"),
        (NodeLedger(node="n1", allocations={"u2": allocation()}), REGISTRATION, "key_mismatch"),
        (NodeLedger(node="n2", allocations={}), REGISTRATION, "key_mismatch"),
        (NodeLedger(node="n1", allocations={"u1": allocation(init_count=3)}), REGISTRATION,
         "container_count"),
        # A claim whose allocation was swept is legitimate (it lapses by itself).
        (NodeLedger(node="n1", claim=InFlightClaim(pod_uid="x", namespace="ns", name="p",
                                                   expires_at=1.0)), REGISTRATION, None),
    ],
)  # fmt: skip
def test_ledger_bounds(
    ledger: NodeLedger, registration: NodeRegistration | None, code: str | None
) -> None:
    problem = ledger_problem("n1", ledger, registration, Bounds())
    assert (problem.code if problem else None) == code


def test_quota_and_limits_bounds() -> None:
    assert quota_problem("ns", QuotaState(namespace="ns")) is None
    bad = quota_problem("ns", QuotaState(namespace="ns", limits=QuotaAmount(memory_mib=-5)))
    assert bad is not None and bad.code == "quota_out_of_range"
    assert quota_problem("other", QuotaState(namespace="ns")).code == "key_mismatch"  # type: ignore[union-attr]
    devices = [device()]
    ok = LimitsSetRequest(container="c", memory_mib=2000)
    assert limits_problem(ok, devices) is None
    too_much = limits_problem(LimitsSetRequest(container="c", memory_mib=10**6), devices)
    assert too_much is not None and "not enough memory" in too_much.detail
    unknown = limits_problem(LimitsSetRequest(container="c", device_uuid="GPU-z"), devices)
    assert unknown is not None and unknown.code == "limits_unknown_device"


# --- preemption marks -----------------------------------------------------------------------

NOW = 1_000_000.0


def nomination(until: float = NOW + 45, **victim: Any) -> NodeLedger:
    """A victim marked for nominee `nom`, whose reservation lasts until `until`, as the
    scheduler's nomination writes it; `victim` overrides the victim's fields."""
    nominee = allocation(pod_uid="nom", name="nominee", expires_at=until)
    marked = allocation(**{"preempted_by": "nom", "preempted_until": until, "state": "bound",
                           **victim})  # fmt: skip
    return NodeLedger(node="n1", allocations={"u1": marked, "nom": nominee})


def mark_code(ledger: NodeLedger, now: float | None = NOW) -> str | None:
    problem = ledger_problem("n1", ledger, REGISTRATION, Bounds(), now)
    return problem.code if problem else None


def test_the_schedulers_nomination_is_valid() -> None:
    assert mark_code(nomination()) is None
    assert mark_code(nomination(until=NOW + MAX_NOMINATION_S - 1)) is None


@pytest.mark.parametrize(
    ("ledger", "code"),
    [
        # A mark naming nobody in the entry: the running pod's capacity would be free.
        (NodeLedger(node="n1", allocations={"u1": allocation(
            state="bound", preempted_by="ghost", preempted_until=NOW + 600)}),
         "preemption_mark_unbacked"),
        # The nominee is a running pod, not a reservation (nothing holds what the mark frees).
        (nomination().model_copy(update={"allocations": {
            **nomination().allocations,
            "nom": allocation(pod_uid="nom", name="nominee", state="bound")}}),
         "preemption_mark_unbacked"),
        # The mark outlasts the nominee's reservation (extended by the node's writer).
        (nomination(preempted_until=NOW + 4000), "preemption_mark_unbacked"),
        # Beyond any nomination's deadline (a day's grace + an hour).
        (nomination(until=NOW + MAX_NOMINATION_S + 10), "preemption_mark_too_long"),
        # Half a mark, a self-mark, an endless one.
        (nomination(preempted_until=None), "preemption_mark"),
        (nomination(preempted_by=""), "preemption_mark"),
        (nomination(preempted_by="u1"), "preemption_mark"),
        (nomination(preempted_until=float("inf")), "preemption_mark"),
    ],
)  # fmt: skip
def test_forged_preemption_marks_are_rejected(ledger: NodeLedger, code: str) -> None:
    assert mark_code(ledger) == code


def test_a_nominee_marked_itself_cannot_back_marks() -> None:
    ledger = nomination()
    ledger.allocations["nom"] = ledger.allocations["nom"].model_copy(
        update={"preempted_by": "u1", "preempted_until": NOW + 45}
    )
    assert mark_code(ledger) == "preemption_mark_unbacked"


def test_a_lapsed_mark_frees_nothing_and_is_accepted() -> None:
    """After the deadline the sweeper drops the nominee's reservation; the victim keeps its old
    mark until released, which no longer counts (cards.counts_against_capacity)."""
    ledger = NodeLedger(node="n1", allocations={"u1": allocation(
        state="bound", preempted_by="gone", preempted_until=NOW - 1)})  # fmt: skip
    assert mark_code(ledger) is None
    # Within the clock-skew allowance too; beyond it, the mark is in force and unbacked.
    ledger.allocations["u1"].preempted_until = NOW + MARK_SKEW_S
    assert mark_code(ledger) is None
    ledger.allocations["u1"].preempted_until = NOW + MARK_SKEW_S + 1
    assert mark_code(ledger) == "preemption_mark_unbacked"
    # A released victim frees nothing either way.
    ledger.allocations["u1"].state = "released"
    assert mark_code(ledger) is None


def test_without_a_clock_only_the_timeless_checks_apply() -> None:
    ghost = NodeLedger(node="n1", allocations={"u1": allocation(
        state="bound", preempted_by="ghost", preempted_until=NOW + 600)})  # fmt: skip
    assert mark_code(ghost, now=None) is None
    assert mark_code(nomination(preempted_by="u1"), now=None) == "preemption_mark"
