"""Ascend vNPU templates: a request gets the smallest covering template, templates never overlap
a chip's capacity, whole chips and 910C module pairs (HAMi's device ConfigMap is the table)."""

from __future__ import annotations

import pytest

from tessera.device_kinds.ascend import chips as ch
from tessera.device_kinds.ascend import templates as tp
from tessera.device_kinds.ascend.dcmi_fake import (
    DCMI_ERR_RESOURCE_OCCUPIED,
    DCMI_OK,
    SimulatedDcmi,
)

B3 = ch.chip_for_type(ch.DEFAULT_CHIPS, "Ascend910B3")
A910 = ch.chip_for_type(ch.DEFAULT_CHIPS, "Ascend910A")
P310 = ch.chip_for_type(ch.DEFAULT_CHIPS, "Ascend310P")
C910 = ch.chip_for_type(ch.DEFAULT_CHIPS, "Ascend910C")


def test_hamis_table_names_every_chip_and_its_resources() -> None:
    words = {c.common_word for c in ch.DEFAULT_CHIPS}
    assert {"Ascend910A", "Ascend910B2", "Ascend910B3", "Ascend910B4", "Ascend310P",
            "Ascend910C"} <= words
    assert B3.resource_name == "huawei.com/Ascend910B3"
    assert B3.resource_memory_name == "huawei.com/Ascend910B3-memory"
    assert B3.resource_core_name == "huawei.com/Ascend910B3-core"
    assert [t.name for t in B3.templates] == ["vir05_1c_16g", "vir10_3c_32g"]
    assert ch.chip_for_resource(ch.DEFAULT_CHIPS, "huawei.com/Ascend310P-memory") is P310
    assert ch.chip_for_name(ch.DEFAULT_CHIPS, "910B3") is B3


@pytest.mark.parametrize(("memory", "cores", "template"), [
    (1, 0, "vir05_1c_16g"),
    (2000, 0, "vir05_1c_16g"),  # HAMi's doc example: 2000 MiB → the smallest template
    (16384, 0, "vir05_1c_16g"),  # exactly a template
    (16385, 0, "vir10_3c_32g"),  # one MiB more: the next one
    (8000, 6, "vir10_3c_32g"),  # the AI cores asked decide too
    (32768, 10, "vir10_3c_32g"),
])
def test_a_request_is_rounded_up_to_the_smallest_covering_template(
    memory: int, cores: int, template: str
) -> None:
    cut = tp.covering_cut(B3, memory, cores)
    assert cut is not None and cut.template == template
    spec = B3.template(template)
    assert (cut.memory_mib, cut.ai_core, cut.ai_cpu) == (spec.memory, spec.ai_core, spec.ai_cpu)


def test_above_every_template_takes_the_whole_chip_and_above_the_chip_nothing() -> None:
    whole = tp.covering_cut(B3, 40000)
    assert whole is not None and whole.whole and whole.memory_mib == 65536
    assert tp.covering_cut(B3, None).whole  # no -memory: a whole NPU
    assert tp.covering_cut(B3, 65537) is None
    assert tp.covering_cut(B3, 1000, 21) is None  # more AI cores than the chip has
    reason = tp.uncovered_reason(B3, 70000, 0)
    assert "Ascend910B3" in reason and "vir10_3c_32g" in reason and "65536" in reason
    # 310P: capacity 24576 but 21527 allocatable: HAMi gives the allocatable memory
    assert tp.covering_cut(P310, 20000).memory_mib == 21527


def test_templates_never_overlap_the_chips_capacity() -> None:
    # 910B3: 20 AI cores, 7 AI CPUs, 64 GiB: two vir10_3c_32g fill the AI cores
    big = tp.covering_cut(B3, 20000)
    small = tp.covering_cut(B3, 1000)
    use = tp.chip_use([big, big])
    assert tp.refusal(B3, use, small) == tp.INSUFFICIENT_MEMORY  # 64 GiB all cut
    use = tp.chip_use([big, small])  # 15 cores, 48 GiB, 4 AI CPUs
    assert tp.refusal(B3, use, small) is None
    assert tp.refusal(B3, use, big) == tp.INSUFFICIENT_MEMORY
    # 910B2: six vir03_1c_8g hold all 6 AI CPUs (48 GiB, 18 cores): a seventh does not fit
    b2 = ch.chip_for_type(ch.DEFAULT_CHIPS, "Ascend910B2")
    v3 = tp.covering_cut(b2, 8000)
    assert tp.refusal(b2, tp.chip_use([v3] * 6), v3) == tp.INSUFFICIENT_CORE
    assert tp.refusal(b2, tp.chip_use([v3] * 5), v3) is None
    # a chip whose AI cores run out before its memory
    (lean,) = ch.parse_chips([{
        "chipName": "x", "commonWord": "AscendLean", "resourceName": "huawei.com/AscendLean",
        "resourceMemoryName": "huawei.com/AscendLean-memory", "memoryAllocatable": 65536,
        "memoryCapacity": 65536, "aiCore": 8, "templates": [{"name": "t", "memory": 4096,
                                                              "aiCore": 4}]}])
    t4 = tp.covering_cut(lean, 100)
    assert tp.refusal(lean, tp.chip_use([t4, t4]), t4) == tp.INSUFFICIENT_CORE
    # 910A: 30 AI cores; three vir08 (24 cores) leave 6: a fourth does not fit, a vir04 does
    v8, v4 = tp.covering_cut(A910, 8000), tp.covering_cut(A910, 4000)
    assert (v8.template, v4.template) == ("vir08", "vir04")
    assert tp.refusal(A910, tp.chip_use([v8] * 3), v8) is not None
    assert tp.refusal(A910, tp.chip_use([v8] * 3), v4) is None


def test_a_whole_chip_needs_an_idle_chip_and_excludes_vnpus() -> None:
    whole, small = tp.whole_chip(B3), tp.covering_cut(B3, 1000)
    assert tp.refusal(B3, tp.ChipUse(), whole) is None
    assert tp.refusal(B3, tp.chip_use([small]), whole) == tp.EXCLUSIVE_CONFLICT
    assert tp.refusal(B3, tp.chip_use([whole]), small) == tp.EXCLUSIVE_CONFLICT


def test_a_recorded_grant_reads_back_as_its_cut_without_rounding_again() -> None:
    cut = tp.covering_cut(B3, 2000)
    assert tp.cut_of_grant(B3, cut.memory_mib, cut.ai_core) == cut
    assert tp.cut_of_grant(B3, 65536, 20).whole


def test_910c_takes_whole_modules_of_two_dies() -> None:
    assert C910.module_pairs and not B3.module_pairs
    assert tp.whole_modules(range(8), 2) == [0, 1]
    assert tp.whole_modules([1, 2, 3, 5, 6, 7], 4) == [2, 3, 6, 7]  # modules 1 and 3
    assert tp.whole_modules([1, 2, 4, 7], 2) is None  # no module with both dies free
    assert tp.whole_modules(range(8), 3) is None  # odd: never half a module


def test_operator_table_in_hamis_yaml_forms() -> None:
    doc = {"vnpus": {"configs": [{
        "chipName": "910B3", "commonWord": "Ascend910B3",
        "resourceName": "huawei.com/Ascend910B3",
        "resourceMemoryName": "huawei.com/Ascend910B3-memory",
        "memoryAllocatable": 65536, "memoryCapacity": 65536, "aiCore": 20, "aiCPU": 7,
        "templates": [{"name": "big", "memory": 32768, "aiCore": 10, "aiCPU": 3},
                      {"name": "small", "memory": 8192, "aiCore": 2, "aiCPU": 1}],
    }]}}
    (chip,) = ch.parse_chips(doc)
    assert [t.name for t in chip.templates] == ["small", "big"]  # sorted smallest first
    assert ch.parse_chips(doc["vnpus"]["configs"]) == (chip,)
    with pytest.raises(ValueError, match="larger than the chip"):
        ch.parse_chips([{**doc["vnpus"]["configs"][0],
                         "templates": [{"name": "x", "memory": 70000, "aiCore": 1}]}])
    with pytest.raises(ValueError, match="non-empty list"):
        ch.parse_chips({"vnpus": []})


def test_the_simulated_driver_refuses_what_would_overlap(tmp_path) -> None:
    dcmi = SimulatedDcmi("n1", B3, 2, state_path=str(tmp_path / "dcmi.json"))
    assert dcmi.get_card_num_list() == [0, 1]
    assert dcmi.get_device_chip_info(0, 0)["chip_name"] == "910B3"
    assert dcmi.create_vdevice(0, 0, "vir10_3c_32g")[0] == DCMI_OK
    ret, first = dcmi.create_vdevice(0, 0, "vir10_3c_32g")
    assert ret == DCMI_OK and first >= 100
    assert dcmi.create_vdevice(0, 0, "vir05_1c_16g")[0] == DCMI_ERR_RESOURCE_OCCUPIED
    assert dcmi.create_vdevice(1, 0, "vir05_1c_16g")[0] == DCMI_OK  # the other chip is free
    # the vNPUs outlive this process's view, as the driver's do
    again = SimulatedDcmi("n1", B3, 2, state_path=str(tmp_path / "dcmi.json"))
    assert len(again.vdevices()) == 3
    assert again.destroy_vdevice(0, 0, first) == DCMI_OK
    assert again.create_vdevice(0, 0, "vir05_1c_16g")[0] == DCMI_OK
