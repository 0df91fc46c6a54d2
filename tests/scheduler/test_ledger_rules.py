"""The ledger's pure mutate functions: what each write does, and that none modifies its input
(the index hands its own objects in as CAS hints)."""

from __future__ import annotations

from functools import partial

import pytest
from tessera.scheduler.ledger import (
    AlreadyBoundError,
    ClaimHeldError,
    NodeFullError,
    ReservationGoneError,
    ReservationRequest,
    bound_mutate,
    claim_mutate,
    init_done_mutate,
    release_mutate,
    reserve_mutate,
    sweep_mutate,
)
from tessera.scheduler.rules import FitContext, PodOptions

from tessera.bus import NoChange
from tessera.codec import encode
from tessera.hami import parse_pod_request
from tessera.models import Allocation, AllocationState, DeviceGrant, InFlightClaim, NodeLedger
from tessera.settings import TesseraSettings

from .factories import GIB, container, node, pod

NOW = 1000.0


def allocation(uid: str, state: AllocationState, expires_at: float | None = None,
               memory: int = 10 * GIB, card: int = 0) -> Allocation:  # fmt: skip
    return Allocation(
        pod_uid=uid, namespace="ns", name=uid, node="n", state=state, expires_at=expires_at,
        containers=[[DeviceGrant(uuid=f"GPU-n-{card}", type="T", memory_mib=memory, cores=0)]],
        init_count=1 if uid == "init" else 0,
    )  # fmt: skip


def ledger(*allocations: Allocation, claim: InFlightClaim | None = None) -> NodeLedger:
    claims = {claim.pod_uid: claim} if claim else {}
    return NodeLedger(node="n", allocations={a.pod_uid: a for a in allocations}, claims=claims)


def reservation(memory_mib: int) -> ReservationRequest:
    spec = pod(container(mem=memory_mib), uid="new")
    return ReservationRequest(
        registration=node("n", gpus=1), cordoned=frozenset(),
        request=parse_pod_request(spec, TesseraSettings()),
        ctx_factory=lambda: FitContext(PodOptions()),
        template=Allocation(pod_uid="new", namespace="ns", name="new", node="n", containers=[]),
        now=NOW, ttl_s=30,
    )  # fmt: skip


def claim_by(uid: str, expires_at: float) -> InFlightClaim:
    return InFlightClaim(pod_uid=uid, namespace="ns", name=uid, expires_at=expires_at)


CASES = [
    ("reserve fits", partial(reserve_mutate, reservation(20 * GIB)),
     ledger(allocation("a", AllocationState.ALLOCATED)), None),
    ("reserve refuses a full card", partial(reserve_mutate, reservation(75 * GIB)),
     ledger(allocation("a", AllocationState.ALLOCATED)), NodeFullError),
    ("reserve ignores an expired reservation", partial(reserve_mutate, reservation(75 * GIB)),
     ledger(allocation("old", AllocationState.RESERVED, NOW - 1)), None),
    ("claim free node", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5)), None),
    ("claim held by another shape on another card", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5),
            allocation("b", AllocationState.BOUND, memory=GIB, card=1),
            claim=claim_by("b", NOW + 1)),
     ClaimHeldError),
    ("claim held by another shape on the same card", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5),
            allocation("b", AllocationState.BOUND, memory=GIB), claim=claim_by("b", NOW + 1)),
     ClaimHeldError),
    ("claim beside the same shape", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5),
            allocation("b", AllocationState.BOUND), claim=claim_by("b", NOW + 1)),
     None),
    ("claim capped at one per node", partial(claim_mutate, "a", "me", NOW, 30, max_in_flight=1),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5),
            allocation("b", AllocationState.BOUND), claim=claim_by("b", NOW + 1)),
     ClaimHeldError),
    ("claim lapsed is taken over", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5),
            allocation("b", AllocationState.BOUND, memory=GIB), claim=claim_by("b", NOW - 1)),
     None),
    ("claim without reservation", partial(claim_mutate, "a", "me", NOW, 30), ledger(),
     ReservationGoneError),
    ("claim of an expired reservation", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.RESERVED, NOW - 1)), ReservationGoneError),
    ("claim after bind", partial(claim_mutate, "a", "me", NOW, 30),
     ledger(allocation("a", AllocationState.BOUND)), AlreadyBoundError),
    ("mark bound", partial(bound_mutate, "a", NOW),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 5)), None),
    ("release", partial(release_mutate, "a", []),
     ledger(allocation("a", AllocationState.BOUND), claim=claim_by("a", NOW + 5)), None),
    ("release unknown", partial(release_mutate, "zz", []), ledger(), NoChange),
    ("init done", partial(init_done_mutate, "init"),
     ledger(allocation("init", AllocationState.ALLOCATED)), None),
    ("sweep", partial(sweep_mutate, NOW, frozenset(), []),
     ledger(allocation("a", AllocationState.RESERVED, NOW - 1), claim=claim_by("b", NOW - 1)),
     None),
    ("sweep nothing due", partial(sweep_mutate, NOW, frozenset(), []),
     ledger(allocation("a", AllocationState.RESERVED, NOW + 1)), NoChange),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate", "current", "error"), CASES, ids=[c[0] for c in CASES])
def test_mutates_are_copy_on_write(case: str, mutate, current: NodeLedger, error) -> None:  # type: ignore[no-untyped-def]
    before = encode(current)
    if error is None:
        mutate(current)
    else:
        with pytest.raises(error):
            mutate(current)
    assert encode(current) == before


def test_writes_do_what_they_say() -> None:
    reserved = reserve_mutate(reservation(20 * GIB), ledger())
    new = reserved.allocations["new"]
    assert new.state == "reserved" and new.expires_at == NOW + 30
    assert new.containers[0][0].memory_mib == 20 * GIB
    claimed = claim_mutate("new", "me", NOW + 1, 45, reserved)
    assert set(claimed.claims) == {"new"}
    assert claimed.allocations["new"].expires_at == NOW + 46  # kept alive while binding
    bound = bound_mutate("new", NOW + 2, claimed)
    assert bound.allocations["new"].state == "bound" and bound.allocations["new"].expires_at is None
    removed: list[Allocation] = []
    released = release_mutate("new", removed, bound)
    assert released.allocations == {} and released.claims == {} and removed[0].pod_uid == "new"


def test_sweep_keeps_pods_found_bound_and_reports_the_dropped() -> None:
    removed: list[Allocation] = []
    withdrawn: list[str] = []
    swept = sweep_mutate(NOW, frozenset({"kept"}), removed, ledger(
        allocation("kept", AllocationState.RESERVED, NOW - 1),
        allocation("lapsed", AllocationState.RESERVED, NOW - 1),
        allocation("live", AllocationState.RESERVED, NOW + 1),
    ), registration=node("n", gpus=1), withdrawn=withdrawn)  # fmt: skip
    assert swept.allocations["kept"].state == "bound"
    assert set(swept.allocations) == {"kept", "live"}
    assert [a.pod_uid for a in removed] == ["lapsed"] and withdrawn == []


def test_sweep_never_adopts_a_bound_pod_onto_room_given_away() -> None:
    """A pod found bound in the cluster after its reservation lapsed: while it held nothing,
    its room went to another pod. Marking it bound would overfill the card: it is dropped and
    named as withdrawn (its grant must go). Without the registration it cannot be checked:
    withdrawn too. Its own room still free: adopted as before."""
    card = node("n", gpus=1).devices[0].memory_mib
    taken = ledger(
        allocation("kept", AllocationState.RESERVED, NOW - 1, memory=card - GIB),
        allocation("other", AllocationState.ALLOCATED, memory=2 * GIB),
    )
    for registration in (node("n", gpus=1), None):
        removed: list[Allocation] = []
        withdrawn: list[str] = []
        swept = sweep_mutate(NOW, frozenset({"kept"}), removed, taken,
                             registration=registration, withdrawn=withdrawn)  # fmt: skip
        assert set(swept.allocations) == {"other"}
        assert [a.pod_uid for a in removed] == ["kept"] and withdrawn == ["kept"]
    free = ledger(allocation("kept", AllocationState.RESERVED, NOW - 1, memory=card - 3 * GIB),
                  allocation("other", AllocationState.ALLOCATED, memory=2 * GIB))  # fmt: skip
    withdrawn = []
    swept = sweep_mutate(NOW, frozenset({"kept"}), [], free, registration=node("n", gpus=1),
                         withdrawn=withdrawn)  # fmt: skip
    assert swept.allocations["kept"].state == "bound" and withdrawn == []


def test_reserve_reuses_the_decisions_fit_only_on_the_value_it_was_made_on() -> None:
    """The filter hands the fit it made on the index's cards to the reservation; the write uses
    it only when it starts from that very ledger value and nothing in it depends on the clock
    (else it fits again on what it read)."""
    from dataclasses import replace

    from tessera.scheduler.placement import PodFit

    base = reservation(20 * GIB)
    held = ledger(allocation("a", AllocationState.ALLOCATED))
    real = reserve_mutate(base, held).allocations["new"].containers
    # A stand-in fit (a uuid of its own), to see which one the write used.
    marked = PodFit(ok=True, containers=[[DeviceGrant(uuid="GPU-decided", type="T",
                                                      memory_mib=1, cores=0)]])  # fmt: skip
    assert real != marked.containers
    used = reserve_mutate(replace(base, decided=(held, marked)), held)
    assert used.allocations["new"].containers == marked.containers
    # Another value of the same content (a fresh read): fitted again.
    copy = held.model_copy()
    assert reserve_mutate(replace(base, decided=(held, marked)), copy).allocations[
        "new"].containers == real  # fmt: skip
    # A reservation past its expiry in it: its charge depends on the clock, fitted again.
    lapsed = ledger(allocation("a", AllocationState.ALLOCATED),
                    allocation("old", AllocationState.RESERVED, expires_at=NOW - 1))  # fmt: skip
    assert reserve_mutate(replace(base, decided=(lapsed, marked)), lapsed).allocations[
        "new"].containers == real  # fmt: skip
    # A pod marked for a nominee: what it holds depends on the nomination's deadline.
    victim = allocation("a", AllocationState.ALLOCATED).model_copy(
        update={"preempted_by": "other", "preempted_until": NOW + 5})
    marked_node = ledger(victim)
    assert reserve_mutate(replace(base, decided=(marked_node, marked)), marked_node).allocations[
        "new"].containers == real  # fmt: skip
    # Finished pods are dropped by the write; the decided fit still stands beside them.
    done = ledger(allocation("a", AllocationState.ALLOCATED),
                  allocation("gone", AllocationState.RELEASED))  # fmt: skip
    written = reserve_mutate(replace(base, decided=(done, marked)), done)
    assert set(written.allocations) == {"a", "new"}
    assert written.allocations["new"].containers == marked.containers
