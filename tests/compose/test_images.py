"""The node agent's image ships libvgpu where the Helm chart's init container looks for it."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_node_agent_image_ships_libvgpu_at_the_charts_source_path() -> None:
    values = yaml.safe_load((ROOT / "charts/tessera-node-agent/values.yaml").read_text())
    source = values["libvgpu"]["sourcePath"]
    host_dir = values["hostPaths"]["vgpu"]
    dockerfile = (ROOT / "services/node-agent/Dockerfile").read_text()
    copies = [
        line.split()[-1]
        for line in dockerfile.splitlines()
        if line.startswith("COPY --from=libvgpu")
    ]
    assert copies == [source]
    # The host directory is mounted over its own path in the pod: a library kept there in the
    # image would be hidden.
    assert not source.startswith(host_dir.rstrip("/") + "/")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    agents = [s for name, s in compose["services"].items() if name.startswith("node-agent")]
    assert agents and all(a["environment"]["TESSERA_LIBVGPU_HOST_PATH"] == source for a in agents)
