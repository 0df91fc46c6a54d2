"""Pick the cluster port implementation from settings."""

from __future__ import annotations

import os

from tessera.cluster.port import ClusterPort
from tessera.settings import TesseraSettings


def cluster_from_settings(settings: TesseraSettings) -> ClusterPort | None:
    """The Kubernetes adapter (a real API server, or kube-sim through its kubeconfig), or None
    when the service runs without a cluster (bus-only, e.g. quota limits set from the CLI)."""
    mode = settings.cluster
    if mode == "auto":
        has_config = os.environ.get("TESSERA_KUBECONFIG") or os.environ.get(
            "KUBERNETES_SERVICE_HOST"
        )
        mode = "kubernetes" if has_config else "none"
    if mode == "none":
        return None
    from tessera.cluster.kubernetes_api import KubernetesCluster  # heavy import, only when used

    return KubernetesCluster.from_environment()
