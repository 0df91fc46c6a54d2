"""The kubelet gRPC APIs Tessera speaks, as generated stubs.

    from tessera.kubeapi import dp, dp_grpc, pr, pr_grpc

``dp`` / ``dp_grpc``: device plugin API v1beta1 (messages / Registration + DevicePlugin
services); ``pr`` / ``pr_grpc``: pod-resources API v1 (PodResourcesLister). For Dynamic Resource
Allocation: ``reg`` / ``reg_grpc``: plugin registration v1 (Registration, served by every
kubelet plugin in kubelet's plugins_registry dir); ``dra`` / ``dra_grpc``: the kubelet DRA API
v1 (DRAPlugin: NodePrepareResources, NodeUnprepareResources); ``drahealth`` /
``drahealth_grpc``: DRA resource health v1alpha1 (DRAResourceHealth.NodeWatchResources;
``drahealth_v1`` for v1). The stubs are generated from ``protos/`` on first import (see
:mod:`tessera.kubeapi.stubs`) and never committed. Also the constants of the device plugin
protocol.
"""

from __future__ import annotations

from tessera.kubeapi.stubs import ensure_stubs

# Stubs import as subpackages of this package: tessera.kubeapi.deviceplugin.v1beta1.api_pb2.
__path__.append(str(ensure_stubs()))

from tessera.kubeapi.deviceplugin.v1beta1 import api_pb2 as dp  # noqa: E402
from tessera.kubeapi.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc  # noqa: E402
from tessera.kubeapi.dra.v1 import api_pb2 as dra  # noqa: E402
from tessera.kubeapi.dra.v1 import api_pb2_grpc as dra_grpc  # noqa: E402
from tessera.kubeapi.drahealth.v1 import api_pb2 as drahealth_v1  # noqa: E402
from tessera.kubeapi.drahealth.v1 import api_pb2_grpc as drahealth_v1_grpc  # noqa: E402
from tessera.kubeapi.drahealth.v1alpha1 import api_pb2 as drahealth  # noqa: E402
from tessera.kubeapi.drahealth.v1alpha1 import api_pb2_grpc as drahealth_grpc  # noqa: E402
from tessera.kubeapi.pluginregistration.v1 import api_pb2 as reg  # noqa: E402
from tessera.kubeapi.pluginregistration.v1 import api_pb2_grpc as reg_grpc  # noqa: E402
from tessera.kubeapi.podresources.v1 import api_pb2 as pr  # noqa: E402
from tessera.kubeapi.podresources.v1 import api_pb2_grpc as pr_grpc  # noqa: E402

DEVICE_PLUGIN_VERSION = "v1beta1"
KUBELET_SOCKET_NAME = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
PRE_START_TIMEOUT_S = 30.0

# DRA kubelet plugins (k8s.io/kubelet/pkg/apis/dra/v1, pluginregistration/v1).
DRA_PLUGIN_TYPE = "DRAPlugin"  # PluginInfo.type of a DRA driver
DRA_PLUGIN_SERVICE_V1 = "v1.DRAPlugin"  # listed in PluginInfo.supported_versions
PLUGINS_REGISTRY_DIR = "plugins_registry"  # under kubelet's root: registration sockets
PLUGINS_DIR = "plugins"  # under kubelet's root: <driver>/dra.sock by convention

__all__ = [
    "DEVICE_PLUGIN_VERSION",
    "DRA_PLUGIN_SERVICE_V1",
    "DRA_PLUGIN_TYPE",
    "HEALTHY",
    "KUBELET_SOCKET_NAME",
    "PLUGINS_DIR",
    "PLUGINS_REGISTRY_DIR",
    "PRE_START_TIMEOUT_S",
    "UNHEALTHY",
    "dp",
    "dp_grpc",
    "dra",
    "dra_grpc",
    "drahealth",
    "drahealth_grpc",
    "drahealth_v1",
    "drahealth_v1_grpc",
    "pr",
    "pr_grpc",
    "reg",
    "reg_grpc",
]
