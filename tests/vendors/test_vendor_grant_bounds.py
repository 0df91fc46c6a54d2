"""A grant checked against its pod's request (the node agent before it seals, the ledger's
rebuild from the pods) may hold what the scheduler grants for that request: for an Ascend vNPU,
the covering template, which holds more AI cores (and memory) than a request asks; never a
bigger template. Pure."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.node_agent.grant_check import GrantRefused, check_grant

from tessera.device_kinds import registry
from tessera.models import Allocation, AllocationState, DeviceGrant, DeviceInfo
from tessera.restore import within_request
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
NPU = "huawei.com/Ascend910B3"
CHIP = DeviceInfo(uuid="NPU-0", index=0, type="Ascend910B3", memory_mib=65536, cores=20,
                  mode="ascend910b3-vnpu")  # fmt: skip
DEVICES = {CHIP.uuid: CHIP}
VIR05 = DeviceGrant(uuid=CHIP.uuid, type=CHIP.type, memory_mib=16384, cores=5)  # vir05_1c_16g
VIR10 = DeviceGrant(uuid=CHIP.uuid, type=CHIP.type, memory_mib=32768, cores=10)  # vir10_3c_32g


def npu_pod(limits: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "npu", "namespace": "ns", "uid": "u-npu", "annotations": {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}


ONE_CORE = {NPU: 1, f"{NPU}-memory": 16384, f"{NPU}-core": 1}  # as admission leaves it
UNREWRITTEN = {NPU: 1, f"{NPU}-memory": 2000}  # HAMi's doc example, memory not rewritten


@pytest.mark.parametrize("limits", [ONE_CORE, UNREWRITTEN])
def test_the_node_agent_seals_the_covering_template(limits: dict[str, Any]) -> None:
    check_grant(npu_pod(limits), 0, [VIR05], DEVICES, SETTINGS)  # no GrantRefused


@pytest.mark.parametrize("limits", [ONE_CORE, UNREWRITTEN])
def test_a_bigger_template_is_refused_as_forged(limits: dict[str, Any]) -> None:
    with pytest.raises(GrantRefused, match="refusing to seal a forged grant"):
        check_grant(npu_pod(limits), 0, [VIR10], DEVICES, SETTINGS)


def allocation(grant: DeviceGrant) -> Allocation:
    return Allocation(pod_uid="u-npu", namespace="ns", name="npu", node="n",
                      containers=[[grant]], state=AllocationState.ALLOCATED)  # fmt: skip


@pytest.mark.parametrize("devices", [DEVICES, None], ids=["registered", "not-registered-yet"])
@pytest.mark.parametrize("limits", [ONE_CORE, UNREWRITTEN])
def test_a_rebuilt_ascend_grant_keeps_its_template(limits: dict[str, Any], devices) -> None:
    restored, problems = within_request(allocation(VIR05), npu_pod(limits), devices, SETTINGS)
    assert problems == []
    assert restored.containers == [[VIR05]]
    # a bigger template than the request rounds up to is cut to the covering one
    restored, problems = within_request(allocation(VIR10), npu_pod(limits), devices, SETTINGS)
    assert restored.containers[0][0].memory_mib == 16384 and restored.containers[0][0].cores == 5
    assert problems and "is granted 32768 MiB / 10%" in problems[0]


def test_kinds_that_grant_the_request_round_nothing() -> None:
    request = registry.read_request({"name": "m", "resources": {"limits": {
        "cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vmemory": 4}}}, SETTINGS)
    assert request is not None
    mlu = DeviceInfo(uuid="MLU-0", index=0, type="MLU370-X4", memory_mib=24576, cores=100,
                     mode="smlu")  # fmt: skip
    assert registry.rounded_take(mlu, request) is None
    assert registry.rounded_take(None, request, "MLU370-X4") is None


def test_a_request_of_another_family_is_never_rounded_up_on_an_npu() -> None:
    """A forged ledger putting an NVIDIA container on an NPU gets no template's room."""
    request = registry.read_request({"name": "m", "resources": {"limits": {
        "nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 5}}}, SETTINGS)
    assert request is not None and request.family == "nvidia"
    assert registry.rounded_take(CHIP, request) is None
    assert registry.rounded_take(None, request, CHIP.type) is None
    npu = registry.read_request({"name": "m", "resources": {"limits": ONE_CORE}}, SETTINGS)
    assert npu is not None
    rounded = registry.rounded_take(CHIP, npu)
    assert rounded is not None and (rounded.memory_mib, rounded.cores) == (16384, 5)
