"""`tessera describe pod` on an elastic pod (issue 33): each GPU's guarantee and burst limit,
the reclaim policy and wait, and the reclaim events among the pod's events."""

from __future__ import annotations

from tessera import elastic, hami
from tessera_cli.describe import render_pod

UUID = "GPU-0b5e7c1a-2f4d-4e6a-9b8c-7d6e5f4a3b2c"


def test_guarantee_and_burst_limit_per_gpu() -> None:
    pod = {
        "metadata": {"name": "trainer", "namespace": "ml", "annotations": {
            hami.ANN_DEVICES_ALLOCATED: f"{UUID},NVIDIA-A10,4096,20:;",
            elastic.ANN_BURST_ALLOCATED: f"{UUID},12288,90:;",
            elastic.ANN_GPUMEM_RECLAIM: "evict", elastic.ANN_GPUMEM_WAIT: "30"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "train"}]},
        "status": {"phase": "Running"},
    }  # fmt: skip
    events = [{"type": "Warning", "reason": "GpuMemoryReclaimed", "message": "8.00 GiB held "
               "beyond its guarantee are needed by ml/infer", "source": {"component": "tessera"}}]
    text = render_pod(pod, events)
    assert "4096 MiB guaranteed, up to 12288 MiB, 20% compute guaranteed, up to 90%" in text
    assert "reclaimable (policy evict)" in text and "wait up to 30 s" in text
    assert "GpuMemoryReclaimed" in text
    assert "compute beyond the guarantee is lent" in text  # a compute burst (90 %) too


def test_compute_only_burst_and_its_reclaim_events() -> None:
    pod = {
        "metadata": {"name": "trainer", "namespace": "ml", "annotations": {
            hami.ANN_DEVICES_ALLOCATED: f"{UUID},NVIDIA-A10,4096,30:;",
            elastic.ANN_BURST_ALLOCATED: f"{UUID},0,100:;"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "train"}]},
        "status": {"phase": "Running"},
    }  # fmt: skip
    events = [{"type": "Normal", "reason": "ComputeReclaimed", "count": 2,
               "message": "compute lent beyond the guarantee of train on GPU-0b5e taken back "
               "once for ml/infer", "source": {"component": "tessera"}}]
    text = render_pod(pod, events)
    assert "4096 MiB, 30% compute guaranteed, up to 100%" in text
    assert "memory beyond the guarantee" not in text  # no memory burst asked
    assert "taken back when a neighbour wakes (2 ComputeReclaimed events)" in text
    assert "ComputeReclaimed" in text.split("Events:")[1]


def test_a_hard_slice_reads_as_before() -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "ml", "annotations": {
            hami.ANN_DEVICES_ALLOCATED: f"{UUID},NVIDIA-A10,4096,20:;"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "main"}]},
        "status": {"phase": "Running"},
    }  # fmt: skip
    text = render_pod(pod, [])
    assert "4096 MiB, 20% compute" in text and "guaranteed" not in text
    assert "Elastic:" not in text
