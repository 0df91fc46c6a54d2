"""The quota rules on their own: fit, zero and unset limits, idempotency, ResourceQuota parsing,
charges as HAMi counts them, and reconciliation decisions."""

from __future__ import annotations

import pytest
from tessera.quota import arithmetic as qa

from tessera.bus import NoChange
from tessera.hami import parse_pod_request, quota_charge
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    QuotaAmount,
    QuotaCharge,
    QuotaRequest,
    QuotaState,
)
from tessera.settings import TesseraSettings

NS = "team-a"


def req(uid: str = "p1", mem: int = 0, cores: int = 0, gpus: int = 1, **kw: object) -> QuotaRequest:
    return QuotaRequest(namespace=NS, pod_uid=uid, memory_mib=mem, cores=cores, gpus=gpus, **kw)


def state(limits: QuotaAmount, *charges: QuotaCharge) -> QuotaState:
    return QuotaState(namespace=NS, limits=limits, charges={c.pod_uid: c for c in charges})


def charge(uid: str, mem: int = 0, cores: int = 0, gpus: int = 1, at: float = 100.0) -> QuotaCharge:
    return QuotaCharge(pod_uid=uid, memory_mib=mem, cores=cores, gpus=gpus, at=at)


def test_unset_limits_are_unlimited() -> None:
    assert qa.refusal(None, req(mem=10**9)) is None
    assert qa.refusal(state(QuotaAmount(), charge("x", mem=10**9)), req(mem=10**9)) is None


def test_fits_up_to_the_limit_exactly_and_no_further() -> None:
    s = state(QuotaAmount(memory_mib=4000), charge("a", mem=3000))
    assert qa.refusal(s, req(mem=1000)) is None
    reason = qa.refusal(s, req(mem=1001))
    assert reason is not None
    assert "exceeding resource quota" in reason
    assert "gpumem 3000 used + 1001 requested > 4000 MiB" in reason


def test_every_limited_dimension_is_checked() -> None:
    s = state(QuotaAmount(memory_mib=10_000, cores=100, gpus=2), charge("a", 1000, 80, 1))
    reason = qa.refusal(s, req(mem=1000, cores=30, gpus=2))
    assert reason is not None
    assert "gpucores" in reason and "gpu 1 used + 2 requested > 2" in reason
    assert "gpumem" not in reason


def test_explicit_zero_blocks_even_requests_without_memory_or_cores() -> None:
    s = state(QuotaAmount(memory_mib=0))
    # A whole-card request (percentage) reaches admission as 0 MiB; it must still be refused.
    reason = qa.refusal(s, req(mem=0, cores=0, gpus=1))
    assert reason is not None and "blocked" in reason
    # A pod that asks no GPU at all is not the quota's business.
    assert qa.refusal(s, req(mem=0, cores=0, gpus=0)) is None


def test_reserve_is_idempotent_and_a_resize_replaces_the_old_charge() -> None:
    s = qa.reserve(state(QuotaAmount(memory_mib=4000)), req("p1", mem=3000), at=1.0)
    with pytest.raises(NoChange):
        qa.reserve(s, req("p1", mem=3000), at=2.0)
    # The same pod asking 4000 instead of 3000 fits: its own old charge is not counted twice.
    resized = qa.reserve(s, req("p1", mem=4000), at=3.0)
    assert resized.used().memory_mib == 4000
    assert s.used().memory_mib == 3000  # the input state is left as it was
    with pytest.raises(qa.QuotaRefused):
        qa.reserve(resized, req("p2", mem=1), at=4.0)


def test_reserve_without_pod_uid_is_refused_as_input() -> None:
    with pytest.raises(qa.QuotaInputError):
        qa.reserve(None, req(uid=""), at=1.0)


def test_release_only_frees_charges_made_before_the_release() -> None:
    s = state(QuotaAmount(), charge("p1", mem=10, at=50.0))
    with pytest.raises(NoChange):
        qa.release(s, "p1", charged_before=40.0)
    assert qa.release(s, "p1", charged_before=60.0).charges == {}
    with pytest.raises(NoChange):
        qa.release(s, "nobody")


def test_set_limits_keeps_charges_and_reports_usage_above_a_lowered_limit() -> None:
    s = state(QuotaAmount(memory_mib=4000), charge("a", mem=3000))
    lowered = qa.set_limits(s, NS, QuotaAmount(memory_mib=2000), "cli")
    assert "a" in lowered.charges
    assert qa.over_limit(lowered) == ["gpumem"]
    with pytest.raises(NoChange):
        qa.set_limits(lowered, NS, QuotaAmount(memory_mib=2000), "cli")


@pytest.mark.parametrize(
    "limits", [QuotaAmount(memory_mib=-1), QuotaAmount(cores=-100), QuotaAmount(gpus=10**12)]
)
def test_negative_or_absurd_limits_are_input_errors(limits: QuotaAmount) -> None:
    with pytest.raises(qa.QuotaInputError):
        qa.check_limits(limits)


@pytest.mark.parametrize("namespace", ["", "Team-A", "a" * 64, "bad.name", "-x", "x y"])
def test_invalid_namespace_names_are_input_errors(namespace: str) -> None:
    with pytest.raises(qa.QuotaInputError):
        qa.check_namespace(namespace)


def test_absurd_request_is_an_input_error() -> None:
    with pytest.raises(qa.QuotaInputError, match="absurdly large"):
        qa.check_request(req(mem=qa.MAX_MEMORY_MIB + 1))


def test_limits_from_a_resource_quota_follow_the_configured_resource_names() -> None:
    keys = qa.ResourceQuotaKeys.from_resource_names(
        "vendor.io/gpu", "vendor.io/vmem", "vendor.io/vcores"
    )
    hard = {
        "limits.vendor.io/vmem": "8000",
        "limits.vendor.io/vcores": 150,
        "requests.vendor.io/gpu": "4",
        "limits.vendor.io/gpu": "3",
        "limits.nvidia.com/gpumem": "1",  # not the configured name: ignored
        "pods": "10",
    }
    limits, problems = qa.limits_from_hard(hard, keys)
    assert limits == QuotaAmount(memory_mib=8000, cores=150, gpus=3)
    assert problems == []


def test_malformed_or_negative_resource_quota_values_are_reported_not_applied() -> None:
    keys = qa.ResourceQuotaKeys.from_resource_names(
        "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores"
    )
    hard = {"limits.nvidia.com/gpumem": "lots", "limits.nvidia.com/gpucores": "-5",
            "limits.nvidia.com/gpu": "1.5"}
    limits, problems = qa.limits_from_hard(hard, keys)
    assert limits == QuotaAmount(gpus=2)  # fractional counts round up, as Kubernetes does
    assert len(problems) == 2
    assert any("gpumem" in p for p in problems) and any("negative" in p for p in problems)


def test_several_resource_quotas_in_a_namespace_the_tightest_wins() -> None:
    merged = qa.tightest([QuotaAmount(memory_mib=8000), QuotaAmount(memory_mib=6000, gpus=2)])
    assert merged == QuotaAmount(memory_mib=6000, gpus=2)


def test_deleting_the_last_resource_quota_clears_only_limits_it_set() -> None:
    from_rq = qa.limits_from_quotas(None, NS, {"gpu": QuotaAmount(memory_mib=100)})
    assert from_rq.source == "resourcequota/gpu"
    cleared = qa.limits_from_quotas(from_rq, NS, {})
    assert cleared.limits == QuotaAmount()
    by_hand = qa.set_limits(None, NS, QuotaAmount(memory_mib=100), "cli")
    with pytest.raises(NoChange):
        qa.limits_from_quotas(by_hand, NS, {})


def grant(mem: int, cores: int = 0) -> DeviceGrant:
    return DeviceGrant(uuid="GPU-x", type="NVIDIA-A100", memory_mib=mem, cores=cores)


def alloc(uid: str, containers: list[list[DeviceGrant]], init_count: int = 0,
          state_: AllocationState = AllocationState.BOUND, held: bool = True) -> Allocation:
    return Allocation(pod_uid=uid, namespace=NS, name=uid, node="n1", containers=containers,
                      init_count=init_count, state=state_, quota_held=held, created_at=10.0)


def test_an_allocation_is_charged_as_hami_charges_the_pod() -> None:
    # Init container: 1 GPU × 5000. App containers: 2 GPUs × 2000 and 1 GPU × 1000.
    pod = {
        "metadata": {"name": "p", "namespace": NS},
        "spec": {
            "initContainers": [{"name": "i", "resources": {"limits": {
                "nvidia.com/gpu": 1, "nvidia.com/gpumem": 5000, "nvidia.com/gpucores": 10}}}],
            "containers": [
                {"name": "a", "resources": {"limits": {
                    "nvidia.com/gpu": 2, "nvidia.com/gpumem": 2000, "nvidia.com/gpucores": 30}}},
                {"name": "b", "resources": {"limits": {
                    "nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 20}}},
            ],
        },
    }
    expected = quota_charge(parse_pod_request(pod, TesseraSettings()))
    a = alloc("p", [[grant(5000, 10)], [grant(2000, 30), grant(2000, 30)], [grant(1000, 20)]],
              init_count=1)
    c = qa.charge_from_allocation(a)
    assert (c.memory_mib, c.cores, c.gpus) == expected == (5000, 80, 3)


def test_reconcile_drops_old_unbacked_charges_keeps_young_ones_and_restores_missing() -> None:
    backed = {"live": alloc("live", [[grant(1000)]]), "lost": alloc("lost", [[grant(700, 50)]])}
    s = state(
        QuotaAmount(memory_mib=5000),
        charge("live", mem=1000, at=10.0),
        charge("leaked", mem=2000, at=10.0),  # reserved, then the scheduler crashed
        charge("young", mem=500, at=95.0),  # reserved just now, ledger entry not written yet
    )
    out = qa.reconcile(s, NS, backed, now=100.0, grace_s=30.0)
    assert set(out.charges) == {"live", "young", "lost"}
    assert out.charges["lost"].memory_mib == 700 and out.charges["lost"].cores == 50
    assert out.used().memory_mib == 1000 + 500 + 700
    with pytest.raises(NoChange):
        qa.reconcile(out, NS, backed, now=100.0, grace_s=30.0)


def test_a_charge_that_only_shrinks_is_never_refused() -> None:
    """A DRA pod's claim unprepared while it keeps others: its charge shrinks, even in a
    namespace whose limit was lowered below its use (it gives back; refusing it left the freed
    claim charged until the pod's release). Growing any dimension is still judged."""
    s = state(QuotaAmount(memory_mib=1000, gpus=2), charge("p1", mem=3000, gpus=2))
    shrunk = qa.reserve(s, req("p1", mem=2000, gpus=1), at=5.0)
    assert shrunk.used().memory_mib == 2000 and shrunk.used().gpus == 1
    with pytest.raises(qa.QuotaRefused):
        qa.reserve(s, req("p1", mem=1000, gpus=3), at=5.0)  # fewer MiB, one GPU more


def test_a_charge_handed_on_is_backed_by_the_dra_booking_it_came_from() -> None:
    """A shared DRA claim handed on: its charge moved in one quota write, the ledger entry moves
    after it. A node agent stopped between the two for longer than the grace leaves the next
    pod's charge without an entry of its own; the booking it came from backs it (dropping it
    would leave the slice the ended pod's ledger entry books outside the quota)."""
    first = alloc("first", [[grant(1000)]])
    handed = charge("next", mem=3000, at=10.0).model_copy(update={"handed_from": "first"})
    s = state(QuotaAmount(memory_mib=4000), charge("first", mem=1000, at=10.0), handed)
    with pytest.raises(NoChange):
        qa.reconcile(s, NS, {"first": first}, now=100.0, grace_s=30.0)
    # with neither pod booked (both gone), both go as any unbacked charge
    out = qa.reconcile(s, NS, {}, now=100.0, grace_s=30.0)
    assert out.charges == {}
    # the hand-on's write records where the charge came from
    moved = qa.hand_on(s, req("other", mem=1000, handed_from="first"), 50.0, None, None)
    assert moved.charges["other"].handed_from == "first" and "first" not in moved.charges
