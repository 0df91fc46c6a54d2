"""The webhook's rules for the vendors' pods (in process): each pod as HAMi's docs write it is
admitted and routed to Tessera's scheduler, Ascend memory rewritten to its template, the
vendors' selection annotations read without a warning, impossible requests denied with a
sentence."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest
from tessera.admission.rules import Admitted, Denial, decide

from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()


def pod(limits: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default", "annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "image": "x",
                                     "resources": {"limits": limits}}]}}


def admitted(spec: dict[str, Any]) -> tuple[Admitted, dict[str, Any]]:
    decision = decide(spec, "default", SETTINGS)
    assert isinstance(decision, Admitted), decision
    return decision, jsonpatch.apply_patch(spec, decision.patch)


@pytest.mark.parametrize("limits", [
    {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 2000},
    {"huawei.com/Ascend310P": 1, "huawei.com/Ascend310P-memory": 4096},
    {"cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vmemory": 16,
     "cambricon.com/mlu.smlu.vcore": 50},
    {"hygon.com/dcunum": 1, "hygon.com/dcumem": 2000, "hygon.com/dcucores": 60},
])
def test_each_vendors_pod_is_ours_to_schedule(limits: dict[str, Any]) -> None:
    decision, after = admitted(pod(limits))
    assert after["spec"]["schedulerName"] == SETTINGS.scheduler_name
    assert decision.quota is not None


def test_ascend_memory_is_rewritten_to_the_template_and_910c_to_a_module() -> None:
    decision, after = admitted(pod({"huawei.com/Ascend910B3": 1,
                                    "huawei.com/Ascend910B3-memory": 2000}))
    limits = after["spec"]["containers"][0]["resources"]["limits"]
    assert limits["huawei.com/Ascend910B3-memory"] == 16384
    assert any("vir05_1c_16g" in c for c in decision.changes)
    _, after = admitted(pod({"huawei.com/Ascend910C": 1}))
    assert after["spec"]["containers"][0]["resources"]["limits"]["huawei.com/Ascend910C"] == 2
    decision, _ = admitted(pod({"huawei.com/Ascend910B3": 1,
                                "huawei.com/Ascend910B3-memory": 90000}))
    assert any("no vNPU template of Ascend910B3 covers 90000" in w for w in decision.warnings)


def test_vendor_selection_annotations_are_known() -> None:
    for limits, knobs in [
        ({"huawei.com/Ascend910B3": 1}, {"hami.io/use-Ascend910B3-uuid": "x"}),
        ({"cambricon.com/vmlu": 1}, {"cambricon.com/use-mlutype": "MLU370"}),
        ({"hygon.com/dcunum": 1}, {"hygon.com/nouse-dcutype": "K100"}),
    ]:
        decision, _ = admitted(pod(limits, knobs))
        assert not any("not a key" in w for w in decision.warnings), decision.warnings


@pytest.mark.parametrize(("limits", "annotations", "words"), [
    ({"huawei.com/Ascend910B3": 2, "huawei.com/Ascend910B3-memory": 4000}, {}, "one NPU per"),
    ({"huawei.com/Ascend910C": 3}, {}, "modules of two"),
    ({"cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vcore": 101}, {}, "at most 100"),
    ({"hygon.com/dcunum": 2, "hygon.com/dcucores": 50}, {}, "one DCU per container"),
    ({"huawei.com/Ascend910B3": 1}, {"huawei.com/vnpu-mode": "hami-core"}, "templates only"),
])
def test_what_no_vendor_can_serve_is_denied_with_a_sentence(limits, annotations, words) -> None:
    decision = decide(pod(limits, annotations), "default", SETTINGS)
    assert isinstance(decision, Denial), decision
    assert words in decision.message


@pytest.mark.parametrize(("limits", "key"), [
    ({"cambricon.com/vmlu": 1}, "hami.io/cambricon-mlu-devices-allocated"),
    ({"hygon.com/dcunum": 1}, "hami.io/dcu-devices-to-allocate"),
    ({"huawei.com/Ascend910B3": 1}, "hami.io/Ascend910B3-devices-allocated"),
])
def test_a_user_cannot_write_a_vendors_grant_record(limits, key) -> None:
    """A vendor's record is what a rebuilt ledger reads back: the user's pod may not carry one
    (as NVIDIA's hami.io/vgpu-devices-allocated)."""
    decision = decide(pod(limits, {key: "MLU-x,MLU370-X4,24576,100:;"}), "default", SETTINGS)
    assert isinstance(decision, Denial), decision
    assert key in decision.message


def quota_used(hard: dict[str, str], pods: list[dict[str, Any]]) -> dict[str, str]:
    """`status.used` as kube-controller-manager's quota controller computes it (kube-sim's copy:
    an extended resource is charged in its `requests.` form only)."""
    from tessera.kube_sim.quota_usage import usage

    return usage({"spec": {"hard": hard}}, pods)


def test_ascend_core_is_rewritten_to_the_templates_so_resource_quota_counts_what_is_held(
) -> None:  # fmt: skip
    """A pod asking 1 AI core holds vir05_1c_16g's 5: admission rewrites `-core` to 5 (limits
    and requests), as it rewrites `-memory` to the template's, so a ResourceQuota on
    `requests.huawei.com/Ascend910B3-core` counts 5 per pod, not the 1 asked."""
    npu = "huawei.com/Ascend910B3"
    asked = {npu: 1, f"{npu}-memory": 2000, f"{npu}-core": 1}
    written = pod(asked)
    written["spec"]["containers"][0]["resources"]["requests"] = dict(asked)
    decision, after = admitted(written)
    resources = after["spec"]["containers"][0]["resources"]
    assert resources["limits"][f"{npu}-core"] == resources["requests"][f"{npu}-core"] == 5
    assert f"main: {npu}-core 1 → 5 (template vir05_1c_16g's AI cores)" in decision.changes
    hard = {f"requests.{npu}-core": "10", f"requests.{npu}-memory": "65536"}
    assert quota_used(hard, [after, after]) == {f"requests.{npu}-core": "10",
                                                f"requests.{npu}-memory": "32768"}
    # a whole NPU holds the chip's 20 AI cores; a 910C module's count is two NPUs of 20 each
    _, whole = admitted(pod({npu: 1, f"{npu}-core": 3}))
    assert whole["spec"]["containers"][0]["resources"]["limits"][f"{npu}-core"] == 20
    _, module = admitted(pod({"huawei.com/Ascend910C": 1, "huawei.com/Ascend910C-core": 2}))
    assert module["spec"]["containers"][0]["resources"]["limits"]["huawei.com/Ascend910C-core"] \
        == 20
    # admitted again (a re-review, an UPDATE): nothing more to change
    again = decide(after, "default", SETTINGS)
    assert isinstance(again, Admitted) and not any("-core" in c for c in again.changes)
    # no `-core` named: none added (HAMi reads a `-core` as its soft split)
    _, plain = admitted(pod({npu: 1, f"{npu}-memory": 2000}))
    assert f"{npu}-core" not in plain["spec"]["containers"][0]["resources"]["limits"]
    # a request no template covers is left as written (it pends with the reason)
    _, uncovered = admitted(pod({npu: 1, f"{npu}-memory": 90000, f"{npu}-core": 1}))
    assert uncovered["spec"]["containers"][0]["resources"]["limits"][f"{npu}-core"] == 1
