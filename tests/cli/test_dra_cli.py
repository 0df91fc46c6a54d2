"""`tessera up --dra`'s parts: the DeviceClass it installs (the same as the example an operator
applies) and the node agent settings of a DRA node (its kubelet's plugin and CDI dirs)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tessera.simnodes import SimNode
from tessera_cli.dra import device_class
from tessera_cli.stack import default_services

ROOT = Path(__file__).resolve().parents[2]


def test_the_deviceclass_example_is_the_one_tessera_up_installs() -> None:
    example = ROOT / "examples" / "dra" / "deviceclass.yaml"
    assert yaml.safe_load(example.read_text()) == device_class()


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
