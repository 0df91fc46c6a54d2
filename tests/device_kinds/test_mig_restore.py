"""A dynamic-MIG grant read back from its pod without the node agent's signature (the ledger
rebuilt after NATS lost its store, `tessera.restore`) holds its instance's size, as the card
really holds it: the profile's memory and compute, not the smaller request. Two claims of more
instances than the card can hold are never both restored. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    MigCapability,
    MigInstanceGrant,
)
from tessera.restore import RestoreReport, RestoreRules, checked_restore, within_request
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
TYPE = "NVIDIA-A100-SXM4-80GB"
CARD = DeviceInfo(uuid="GPU-mig-0", index=0, type=TYPE, memory_mib=81920, mode="mig",
                  mig=MigCapability(model="A100-SXM4-80GB"))  # fmt: skip
DEVICES = {CARD.uuid: CARD}


def instance(profile: str, start: int, memory: int, cores: int, size: int) -> DeviceGrant:
    return DeviceGrant(uuid=CARD.uuid, type=TYPE, memory_mib=memory, cores=cores,
                       mig=MigInstanceGrant(profile=profile, start=start, size=size))  # fmt: skip


# As the scheduler grants them on an A100 80GB (tessera/mig.py): 3g.40gb is 4 memory slices of
# 8 (40960 MiB) and 3 compute slices of 7 (42 %); 7g.80gb the whole card.
G3 = instance("3g.40gb", 0, 40960, 42, 4)
G7 = instance("7g.80gb", 0, 81920, 100, 8)


def gpu_pod(uid: str, memory: int, cores: int = 0) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": memory}
    if cores:
        limits["nvidia.com/gpucores"] = cores
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}


def allocation(uid: str, grant: DeviceGrant) -> Allocation:
    return Allocation(pod_uid=uid, namespace="ns", name=uid, node="n", containers=[[grant]],
                      state=AllocationState.ALLOCATED)  # fmt: skip


@pytest.mark.parametrize("devices", [DEVICES, None], ids=["registered", "not-registered-yet"])
def test_an_instance_keeps_its_profiles_size_not_the_request(devices) -> None:
    # 20000 MiB is covered by 1g.20gb; 3g.40gb is what the scheduler grants when no smaller
    # profile had a free placement: the card holds 40960 MiB for it.
    restored, problems = within_request(allocation("a", G3), gpu_pod("a", 20000), devices,
                                        SETTINGS)  # fmt: skip
    assert problems == []
    assert restored.containers == [[G3]]


@pytest.mark.parametrize("devices", [DEVICES, None], ids=["registered", "not-registered-yet"])
def test_an_instance_charged_other_than_its_profile_is_set_to_the_profile(devices) -> None:
    for wrong in (G3.model_copy(update={"memory_mib": 81920, "cores": 100}),  # more
                  G3.model_copy(update={"memory_mib": 20000, "cores": 10}),  # less
                  G3.model_copy(update={"mig": G3.mig.model_copy(update={"size": 8})})):
        restored, problems = within_request(allocation("a", wrong), gpu_pod("a", 20000),
                                            devices, SETTINGS)  # fmt: skip
        assert restored.containers == [[G3]]
        assert len(problems) == 1 and "as MIG 3g.40gb, which holds 40960 MiB / 42%" in problems[0]


def test_a_profile_that_does_not_cover_the_request_is_reported() -> None:
    small = instance("1g.10gb", 0, 10240, 14, 1)
    restored, problems = within_request(allocation("a", small), gpu_pod("a", 30000), DEVICES,
                                        SETTINGS)  # fmt: skip
    assert restored.containers == [[small]]  # what the card holds for it, no more
    assert problems and "does not cover its ask of 30000 MiB" in problems[0]


def test_an_instance_the_card_cannot_hold_is_cut_as_a_slice() -> None:
    plain = CARD.model_copy(update={"mig": None, "mode": "hami-core"})
    restored, problems = within_request(allocation("a", G7), gpu_pod("a", 20000),
                                        {plain.uuid: plain}, SETTINGS)  # fmt: skip
    grant = restored.containers[0][0]
    assert grant.mig is None and grant.memory_mib == 20000
    assert "does not serve dynamic MIG" in problems[0]
    unknown = G3.model_copy(update={"mig": G3.mig.model_copy(update={"profile": "5g.50gb"})})
    restored, problems = within_request(allocation("a", unknown), gpu_pod("a", 20000), DEVICES,
                                        SETTINGS)  # fmt: skip
    assert restored.containers[0][0].mig is None and "no MIG profile '5g.50gb'" in problems[0]


def test_two_claims_of_the_whole_card_are_not_both_restored() -> None:
    """Two unsigned records each claiming the card's 7g.80gb instance for a 20000 MiB ask: cut
    to the request, both fitted (40000 of 81920 MiB) and the ledger held two whole-card
    instances; held at their size, the second is refused."""
    pods = {u: gpu_pod(u, 20000) for u in ("first", "second")}
    found = [(allocation(u, G7), None) for u in pods]
    report = RestoreReport()
    accepted = checked_restore("n", found, pods, DEVICES, [], RestoreRules(SETTINGS), report)
    assert [a.pod_uid for a, _ in accepted] == ["first"]
    assert accepted[0][0].containers == [[G7]]
    assert report.refused == ["ns/second on n: not restored: GPU GPU-mig-0 would hold 163840 "
                              "MiB of 81920 MiB with the pods already restored"]  # fmt: skip
