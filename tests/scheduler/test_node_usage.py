"""The index keeps a node's usage from each change (node_usage.py): after any sequence of
copy-on-write ledger changes and clock moves (forward past expiries and hand-overs, or back),
its cards are exactly what counting every allocation afresh (`build_cards`) gives."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tessera.scheduler.cards import build_cards
from tessera.scheduler.index import ClusterIndex

from tessera.models import Allocation, AllocationState, DeviceGrant, NodeLedger

from .factories import node

UIDS = [f"u{i}" for i in range(6)]
GPUS = 3


def allocation(uid: str, draw: Any) -> Allocation:
    gpu = draw(st.integers(0, GPUS))  # GPU-3 is not on the node: never charged
    state = draw(st.sampled_from(list(AllocationState)))
    grants = [DeviceGrant(uuid=f"{'n1'}-gpu-{gpu}", type="NVIDIA-A100", memory_mib=draw(
        st.integers(0, 4000)), cores=draw(st.integers(0, 50)))]  # fmt: skip
    init = draw(st.booleans())
    return Allocation(
        pod_uid=uid, namespace="ns", name=uid, node="n1",
        containers=[grants, [grants[0].model_copy(update={"memory_mib": 100})]] if init
        else [grants],
        init_count=1 if init else 0, init_done=draw(st.booleans()), state=state,
        expires_at=draw(st.one_of(st.none(), st.floats(0, 100))),
        preempted_by=draw(st.sampled_from(["", "nominee"])),
        preempted_until=draw(st.one_of(st.none(), st.floats(0, 100))),
    )  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_usage_from_changes_equals_a_full_count(data: st.DataObject) -> None:
    registration = node("n1", gpus=GPUS)
    registration = registration.model_copy(update={"devices": [
        d.model_copy(update={"uuid": f"n1-gpu-{i}"}) for i, d in enumerate(registration.devices)
    ]})  # fmt: skip
    index = ClusterIndex()
    now = 0.0
    index.set_registration("n1", registration, now)
    ledger = NodeLedger(node="n1")
    revision = 0
    for _step in range(data.draw(st.integers(1, 12))):
        action = data.draw(st.sampled_from(["change", "change", "remove", "time", "time-back"]))
        if action == "change":
            allocations = dict(ledger.allocations)
            uid = data.draw(st.sampled_from(UIDS))
            allocations[uid] = allocation(uid, data.draw)
            ledger = ledger.model_copy(update={"allocations": allocations})
        elif action == "remove" and ledger.allocations:
            uid = data.draw(st.sampled_from(sorted(ledger.allocations)))
            ledger = ledger.model_copy(update={"allocations": {
                k: a for k, a in ledger.allocations.items() if k != uid
            }})  # fmt: skip
        elif action == "time":
            now += data.draw(st.floats(0, 40))
        else:
            now = max(0.0, now - data.draw(st.floats(0, 20)))
        if action in ("change", "remove"):
            revision += 1
            index.set_ledger("n1", ledger, revision, now)
        else:
            index.refresh("n1", now)
        entry = index.entries["n1"]
        assert entry.cards == build_cards(registration, ledger.allocations.values(), now)
        expiries = [a.expires_at for a in ledger.allocations.values()
                    if a.state == AllocationState.RESERVED and a.expires_at is not None]
        assert entry.reserved_until == min(expiries, default=None)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_start_up_count_equals_a_full_count(data: st.DataObject) -> None:
    """At start-up rows are built once, after listing, without remembering each uid; the first
    change afterwards is counted in full."""
    registration = node("n1", gpus=GPUS)
    registration = registration.model_copy(update={"devices": [
        d.model_copy(update={"uuid": f"n1-gpu-{i}"}) for i, d in enumerate(registration.devices)
    ]})  # fmt: skip
    uids = data.draw(st.lists(st.sampled_from(UIDS), unique=True))
    ledger = NodeLedger(node="n1", allocations={u: allocation(u, data.draw) for u in uids})
    now = data.draw(st.floats(0, 100))
    index = ClusterIndex()
    index.defer_rebuilds()
    index.set_registration("n1", registration, now)
    index.set_ledger("n1", ledger, 1, now)
    index.flush_rebuilds(now)
    entry = index.entries["n1"]
    assert entry.cards == build_cards(registration, ledger.allocations.values(), now)
    later = now + data.draw(st.floats(0, 50))
    uid = data.draw(st.sampled_from(UIDS))
    ledger = ledger.model_copy(update={
        "allocations": {**ledger.allocations, uid: allocation(uid, data.draw)}
    })  # fmt: skip
    index.set_ledger("n1", ledger, 2, later)
    assert entry.cards == build_cards(registration, ledger.allocations.values(), later)
