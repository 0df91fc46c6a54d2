"""The kubelet gRPC APIs Tessera speaks, as generated stubs.

    from tessera.kubeapi import dp, dp_grpc, pr, pr_grpc

``dp`` / ``dp_grpc``: device plugin API v1beta1 (messages / Registration + DevicePlugin
services); ``pr`` / ``pr_grpc``: pod-resources API v1 (PodResourcesLister). The stubs are
generated from ``protos/`` on first import (see :mod:`tessera.kubeapi.stubs`) and never
committed. Also the constants of the device plugin protocol.
"""

from __future__ import annotations

from tessera.kubeapi.stubs import ensure_stubs

# Stubs import as subpackages of this package: tessera.kubeapi.deviceplugin.v1beta1.api_pb2.
__path__.append(str(ensure_stubs()))

from tessera.kubeapi.deviceplugin.v1beta1 import api_pb2 as dp  # noqa: E402
from tessera.kubeapi.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc  # noqa: E402
from tessera.kubeapi.podresources.v1 import api_pb2 as pr  # noqa: E402
from tessera.kubeapi.podresources.v1 import api_pb2_grpc as pr_grpc  # noqa: E402

DEVICE_PLUGIN_VERSION = "v1beta1"
KUBELET_SOCKET_NAME = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
PRE_START_TIMEOUT_S = 30.0

__all__ = [
    "DEVICE_PLUGIN_VERSION",
    "HEALTHY",
    "KUBELET_SOCKET_NAME",
    "PRE_START_TIMEOUT_S",
    "UNHEALTHY",
    "dp",
    "dp_grpc",
    "pr",
    "pr_grpc",
]
