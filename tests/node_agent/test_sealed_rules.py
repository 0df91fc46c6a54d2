"""The pure rules behind the sealed-capacity check (grant_check): which sealed containers hold
memory now, when a grant is refused beside them, and when the ledger can be put back on the
cards the containers sealed."""

from __future__ import annotations

import pytest
from tessera.node_agent.grant_check import (
    GrantRefused,
    check_sealed_capacity,
    counted_sealed,
    sealed_disagreements,
    sealed_repair,
)

from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo

CARDS = {u: DeviceInfo(uuid=u, index=i, type="NVIDIA", memory_mib=16000, cores=100)
         for i, u in enumerate(("GPU-a", "GPU-b"))}  # fmt: skip


def grant(uuid: str, mib: int) -> DeviceGrant:
    return DeviceGrant(uuid=uuid, type="NVIDIA", memory_mib=mib, cores=30)


def allocation(uid: str, containers: list[list[DeviceGrant]], init_count: int = 0,
               state: AllocationState = AllocationState.ALLOCATED) -> Allocation:
    return Allocation(pod_uid=uid, namespace="team", name=uid, node="n1", containers=containers,
                      init_count=init_count, state=state,
                      container_names=[f"c{i}" for i in range(len(containers))])


def test_finished_init_containers_hold_nothing_and_waiting_ones_count_their_peak():
    pod = allocation("p", [[grant("GPU-a", 9000)], [grant("GPU-a", 7000)], [grant("GPU-a", 4000)]],
                     init_count=2)
    sealed = {("p", 0): {"GPU-a": 9000}, ("p", 1): {"GPU-a": 7000}}
    # Only init containers sealed, the app not yet: they run one at a time, the largest counts.
    assert counted_sealed(sealed, {"p": pod}, ("other", 0)) == {("p", -1): {"GPU-a": 9000}}
    # The app container is being sealed: the init containers have finished.
    assert counted_sealed(sealed, {"p": pod}, ("p", 2)) == {}
    sealed[("p", 2)] = {"GPU-a": 4000}
    assert counted_sealed(sealed, {"p": pod}, ("q", 0)) == {("p", 2): {"GPU-a": 4000}}


def test_a_grant_beside_what_is_sealed_fits_or_is_refused():
    sealed = {("running", 0): {"GPU-a": 10000}}
    check_sealed_capacity("pod team/new", [grant("GPU-a", 6000)], sealed, CARDS)
    check_sealed_capacity("pod team/new", [grant("GPU-b", 16000)], sealed, CARDS)
    with pytest.raises(GrantRefused, match="would put it at 16001 MiB of 16000 MiB"):
        check_sealed_capacity("pod team/new", [grant("GPU-a", 6001)], sealed, CARDS)


def test_the_ledger_goes_back_to_the_sealed_card_only_where_it_fits():
    moved = allocation("running", [[grant("GPU-b", 10000)]])
    sealed = {("running", 0): {"GPU-a": 10000}}
    assert sealed_disagreements(sealed, {"running": moved.containers}, {"running": "team/r"}) == [
        "pod team/r container #0 has sealed 10000 MiB on GPU-a but the ledger grants it GPU-b"]
    changed, unrepaired = sealed_repair({"running": moved}, sealed, CARDS)
    assert changed["running"].containers == [[grant("GPU-a", 10000)]] and unrepaired == []
    # A pod the scheduler placed on the free-looking card since: putting it back would
    # overcommit the ledger, so it is left and said so.
    newcomer = allocation("newcomer", [[grant("GPU-a", 10000)]], state=AllocationState.BOUND)
    changed, unrepaired = sealed_repair({"running": moved, "newcomer": newcomer}, sealed, CARDS)
    assert changed == {} and unrepaired == ["team/running container #0"]
