"""A ledger write that charges what was charged before (a claim, a bind, the agent's Allocate)
keeps the node's row of the index (`ClusterIndex._kept_row`, `NodeUsage.version`) instead of
building it again. Whatever the sequence of writes, clock moves, cordons and registrations, the
index must read exactly as one built afresh from the same state at the same time."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tessera.scheduler.index import ClusterIndex

from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
)

from .factories import node

UIDS = [f"u{i}" for i in range(5)]
GPUS = 3


def registration_of(healthy: list[bool]) -> NodeRegistration:
    base = node("n1", gpus=GPUS)
    return base.model_copy(update={"devices": [
        d.model_copy(update={"uuid": f"n1-gpu-{i}", "healthy": healthy[i], "split_count": 3})
        for i, d in enumerate(base.devices)
    ]})  # fmt: skip


def grants(draw: Any) -> list[list[DeviceGrant]]:
    gpu = draw(st.integers(0, GPUS - 1))
    return [[DeviceGrant(uuid=f"n1-gpu-{gpu}", type="NVIDIA-A100",
                         memory_mib=draw(st.sampled_from([0, 1000, 30_000, 90_000])),
                         cores=draw(st.sampled_from([0, 10, 60])))]]  # fmt: skip


def allocation(uid: str, draw: Any, containers: list[list[DeviceGrant]]) -> Allocation:
    return Allocation(
        pod_uid=uid, namespace="ns", name=uid, node="n1", containers=containers,
        state=draw(st.sampled_from(list(AllocationState))),
        expires_at=draw(st.one_of(st.none(), st.floats(0, 100))),
        preempted_by=draw(st.sampled_from(["", "", "nominee"])),
        preempted_until=draw(st.one_of(st.none(), st.floats(0, 100))),
    )  # fmt: skip


def view(index: ClusterIndex) -> tuple:
    """Everything the decision reads about the node."""
    entry = index.entries["n1"]
    slot = entry.slot
    cards = [(c.uuid, c.used_mem, c.used_cores, c.used_slots, c.cordoned) for c in entry.cards]
    arrays = [*ClusterIndex._ARRAYS, "bound_mem_at", "bound_pct_at", "bound_cores",
              "bound_computing", "bound_idle"]  # fmt: skip
    index._grow_bounds()
    rows = tuple(getattr(index, a)[..., slot].tolist() for a in arrays)
    return cards, entry.score, entry.reserved_until, rows, sorted(index.sweepable)


def fresh(registration: NodeRegistration, ledger: NodeLedger, cordon: frozenset[str],
          now: float) -> tuple:  # fmt: skip
    index = ClusterIndex()
    index.set_registration("n1", registration, now)
    index.set_cordon("n1", cordon, now)
    index.set_ledger("n1", ledger, 1, now)
    return view(index)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_kept_rows_read_as_rows_built_afresh(data: st.DataObject) -> None:
    draw = data.draw
    registration = registration_of([True] * GPUS)
    index = ClusterIndex()
    now, revision, cordon = 10.0, 0, frozenset[str]()
    index.set_registration("n1", registration, now)
    ledger = NodeLedger(node="n1")
    kept = 0
    for _step in range(draw(st.integers(1, 14))):
        action = draw(st.sampled_from(
            ["same-grants", "same-grants", "same-grants", "new", "remove", "claim", "unclaim",
             "time", "time-back", "cordon", "registration"]
        ))  # fmt: skip
        allocations = dict(ledger.allocations)
        claims = dict(ledger.claims)
        if action == "same-grants" and allocations:
            uid = draw(st.sampled_from(sorted(allocations)))
            allocations[uid] = allocation(uid, draw, allocations[uid].containers)
        elif action in ("new", "same-grants"):
            uid = draw(st.sampled_from(UIDS))
            allocations[uid] = allocation(uid, draw, grants(draw))
        elif action == "remove" and allocations:
            del allocations[draw(st.sampled_from(sorted(allocations)))]
        elif action == "claim" and allocations:
            uid = draw(st.sampled_from(sorted(allocations)))
            claims[uid] = InFlightClaim(pod_uid=uid, namespace="ns", name=uid, taken_at=now,
                                        expires_at=now + draw(st.floats(-5, 30)))  # fmt: skip
        elif action == "unclaim" and claims:
            del claims[draw(st.sampled_from(sorted(claims)))]
        elif action == "time":
            now += draw(st.floats(0, 40))
        elif action == "time-back":
            now = max(0.0, now - draw(st.floats(0, 20)))
        elif action == "cordon":
            cordon = frozenset(draw(st.sets(st.sampled_from([f"n1-gpu-{i}" for i in range(GPUS)]))))
            index.set_cordon("n1", cordon, now)
        elif action == "registration":
            registration = registration_of(draw(st.lists(st.booleans(), min_size=GPUS,
                                                         max_size=GPUS)))  # fmt: skip
            index.set_registration("n1", registration, now)
        if allocations != ledger.allocations or claims != ledger.claims:
            ledger = ledger.model_copy(update={"allocations": allocations, "claims": claims})
            revision += 1
            version = index.entries["n1"].usage.version
            index.set_ledger("n1", ledger, revision, now)
            kept += index.entries["n1"].usage.version == version
        elif action in ("time", "time-back"):
            index.refresh("n1", now)
        assert view(index) == fresh(registration, ledger, cordon, now), action
