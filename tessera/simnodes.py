"""Simulated GPU nodes: what the local stack asks kube-sim to play (TESSERA_KUBE_SIM_NODES).

Shared by the stack runner (tessera_cli.stack), which writes the list, and kube-sim, which reads
it; a nodes file (`tessera up --nodes-file`) holds the same records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field


class SimNode(BaseModel):
    """One simulated node: its GPUs are served by a node agent with the static device source."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63)
    gpus: int = Field(4, ge=0, le=64)
    gpu_memory_mib: int = Field(24576, ge=1)
    gpu_model: str = "NVIDIA A10"
    numa_nodes: int = Field(1, ge=1)
    labels: dict[str, str] = Field(default_factory=dict)
    # MIG (tessera.mig): the node's migStrategy, and the instances every GPU holds for the static
    # strategies ('<profile>@<start>,…'; default: the model's smallest profile at every start).
    mig: Literal["none", "single", "mixed", "dynamic"] = "none"
    mig_instances: str = ""
    # DRA mode (docs/dra.md): the node's agent is a kubelet DRA plugin, not a device plugin.
    dra: bool = False


def make_nodes(
    count: int,
    gpus: int,
    gpu_memory_mib: int,
    gpu_model: str,
    numa_nodes: int = 1,
    prefix: str = "sim-node",
) -> list[SimNode]:
    return [
        SimNode(
            name=f"{prefix}-{i}",
            gpus=gpus,
            gpu_memory_mib=gpu_memory_mib,
            gpu_model=gpu_model,
            numa_nodes=numa_nodes,
        )
        for i in range(count)
    ]


def load_nodes(path: Path) -> list[SimNode]:
    """Nodes from YAML or JSON: a list of nodes, or `{"nodes": [...]}`."""
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict):
        data = data.get("nodes")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of nodes")
    return [SimNode.model_validate(item) for item in data]
