"""`tessera up --dra`'s parts: the DeviceClass it installs (the same as the example an operator
applies) and the node agent settings of a DRA node (its kubelet's plugin and CDI dirs)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tessera.simnodes import SimNode
from tessera_cli.dra import claim_grants, device_class, mig_device_class, mps_device_class
from tessera_cli.stack import default_services

ROOT = Path(__file__).resolve().parents[2]


def test_the_deviceclass_example_is_the_one_tessera_up_installs() -> None:
    example = ROOT / "examples" / "dra" / "deviceclass.yaml"
    assert yaml.safe_load(example.read_text()) == device_class()
    more = ROOT / "examples" / "dra" / "deviceclasses-mig-mps.yaml"
    assert list(yaml.safe_load_all(more.read_text())) == [mig_device_class(), mps_device_class()]


def test_a_mig_partition_claim_shows_the_profile_s_slice() -> None:
    """`tessera get pods` / `describe`: a partition is allocated whole (no consumedCapacity), so
    the pod's GPUS column is the partition's own memory and compute."""
    pod = {"metadata": {"namespace": "ns", "name": "p"}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
        "containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}]}}
    claim = {"status": {"allocation": {"devices": {"results": [{
        "driver": "gpu.tessera.io", "pool": "node-a", "device": "gpu-0-mig-3g-40gb-4"}]}}}}
    partition = {"name": "gpu-0-mig-3g-40gb-4",
                 "attributes": {"uuid": {"string": "GPU-0"},
                                "type": {"string": "NVIDIA-A100-SXM4-80GB"}},
                 "capacity": {"memory": {"value": "40Gi"}, "cores": {"value": "42"}}}
    slices = {"node-a": {"spec": {"devices": [partition]}}}
    grants, lines = claim_grants(None, pod, {("ns", "c"): claim}, slices)
    assert grants == [[{"uuid": "GPU-0", "type": "NVIDIA-A100-SXM4-80GB", "memory_mib": 40960,
                        "cores": 42}]]  # fmt: skip
    assert lines == ["c: node-a/gpu-0-mig-3g-40gb-4"]


def test_dra_nodes_run_the_driver_and_the_webhook_converts_only_when_all_are(
    tmp_path: Path,
) -> None:
    mixed = [SimNode(name="a"), SimNode(name="b", dra=True)]
    services = {s.name: s for s in default_services(mixed, tmp_path)}
    assert "TESSERA_DRA" not in services["node-agent/a"].env
    b = services["node-agent/b"].env
    assert b["TESSERA_DRA"] == "true"
    assert b["TESSERA_DRA_CDI_DIR"] == str(Path(b["TESSERA_DRA_KUBELET_DIR"]) / "cdi")
    assert Path(b["TESSERA_DRA_KUBELET_DIR"]).name == "b"  # its own kubelet's directory
    assert "TESSERA_ALLOCATION_MODE" not in services["admission"].env  # pods choose per pod
    every = {s.name: s for s in default_services([SimNode(name="c", dra=True)], tmp_path)}
    assert every["admission"].env["TESSERA_ALLOCATION_MODE"] == "dra"
