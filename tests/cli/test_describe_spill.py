"""`tessera describe pod` on a pod that may spill to host memory (docs/elastic.md, "Spilling
to host memory"): how much each container may spill, and that it is slower."""

from __future__ import annotations

from tessera import elastic, hami
from tessera_cli.describe import render_pod

UUID = "GPU-0b5e7c1a-2f4d-4e6a-9b8c-7d6e5f4a3b2c"


def _pod(spill: str | None) -> dict:
    annotations = {hami.ANN_DEVICES_ALLOCATED: f"{UUID},NVIDIA-A10,4096,20:;"}
    if spill is not None:
        annotations[elastic.ANN_GPUMEM_SPILL] = spill
    return {
        "metadata": {"name": "trainer", "namespace": "ml", "annotations": annotations},
        "spec": {"nodeName": "n1", "containers": [{"name": "train"}, {"name": "web"}]},
        "status": {"phase": "Running"},
    }


def test_the_spill_bound_per_container() -> None:
    text = render_pod(_pod("train=16384"), [])
    assert "go to host memory (much slower), at most: train 16384 MiB" in text
    assert "web" not in text.split("Spill:")[1].splitlines()[0]
    assert "Spill:" not in render_pod(_pod(None), [])
