"""One GPU identity everywhere: the dashboard and the CLI show the same short form of a UUID
(tessera.gpuid.short_uuid), and the page shows the one the state gives it."""

from __future__ import annotations

from pathlib import Path

from metrics_testkit import allocation, ledger, registration
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView

from tessera.gpuid import short_uuid
from tessera_cli.pods import describe_gpus

STATIC = Path(__file__).resolve().parents[2] / "services" / "metrics" / "static"


def test_short_form() -> None:
    uuid = "GPU-3fe337b5-1a2b-4c3d-8e9f-0123456789ab"
    assert short_uuid(uuid) == "GPU-3fe337b5"
    assert short_uuid("MIG-0f1e2d3c-aaaa-bbbb-cccc-dddddddddddd") == "MIG-0f1e2d3c"
    assert short_uuid("GPU-1") == "GPU-1" and short_uuid("odd") == "odd"


def test_dashboard_and_cli_show_the_same_identity() -> None:
    uuid = "GPU-3fe337b5-1a2b-4c3d-8e9f-0123456789ab"
    node = registration("n1", gpus=1)
    node = node.model_copy(update={"devices": [node.devices[0].model_copy(update={"uuid": uuid})]})
    view = ClusterView()
    view.put_node("n1", node)
    view.put_ledger("n1", ledger("n1", allocation("n1", "team-a", "train", [[(uuid, 2000, 30)]])))
    gpu = dashboard_state(view, 1_800_000_000.0)["nodes"][0]["gpus"][0]
    assert gpu["uuid"] == uuid and gpu["slices"][0]["pod"] == "train"
    cli = describe_gpus([[{"uuid": uuid, "memory_mib": 2000, "cores": 30}]])
    assert gpu["short_uuid"] == short_uuid(uuid) == "GPU-3fe337b5"
    assert cli == f"{gpu['short_uuid']}:2000MiB/30%"
    script = (STATIC / "app.js").read_text()
    assert "gpu.short_uuid" in script and "uuid.slice(" not in script
