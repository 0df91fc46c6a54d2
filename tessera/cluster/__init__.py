"""The cluster port and its implementations (see port.py)."""

from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.port import (
    ClusterError,
    ClusterPort,
    ConflictError,
    KubeObject,
    NotFoundError,
    ObjectRef,
    WatchEvent,
    WebhookCertificatePort,
)

__all__ = [
    "ClusterError",
    "ClusterPort",
    "ConflictError",
    "InMemoryCluster",
    "KubeObject",
    "NotFoundError",
    "ObjectRef",
    "WatchEvent",
    "WebhookCertificatePort",
]
