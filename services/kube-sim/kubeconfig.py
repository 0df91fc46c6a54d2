"""The kubeconfig kube-sim writes so clients (services, CLI, kubectl) find it.

Written as JSON, which is YAML (kubectl and every YAML reader take it): the CLI then reads it
without importing a YAML parser (`tessera get pods` starts faster: bench/get_pods_vs_kubectl.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def kubeconfig_text(server: str, cluster: str = "kube-sim") -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": server}}],
        "users": [{"name": "kube-sim-admin", "user": {"token": "kube-sim"}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": "kube-sim-admin"}}],
        "current-context": cluster,
    }
    return json.dumps(config, indent=2) + "\n"


def write_kubeconfig(path: Path, server: str) -> None:
    """Write beside, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(kubeconfig_text(server))
    os.replace(temporary, path)
