"""The DRA kubelet protos match kubelet's wire format: field numbers, packages and the gRPC method
paths of k8s.io/kubelet/pkg/apis/{pluginregistration/v1,dra/v1,dra-health/v1alpha1,v1}."""

from __future__ import annotations

import pytest

from tessera.kubeapi import dra, drahealth, drahealth_v1, reg

PLUGIN_REGISTRATION = {
    "PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "RegistrationStatus": {"plugin_registered": 1, "error": 2},
    "RegistrationStatusResponse": {},
    "InfoRequest": {},
}
DRA_V1 = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
}
HEALTH_V1ALPHA1 = {
    "NodeWatchResourcesRequest": {},
    "DeviceIdentifier": {"pool_name": 1, "device_name": 2},
    "DeviceHealth": {"device": 1, "health": 2, "last_updated_time": 3},
    "NodeWatchResourcesResponse": {"devices": 1},
}
HEALTH_V1 = {
    **HEALTH_V1ALPHA1,
    "DeviceHealth": {
        "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4,
        "message": 5,
    },
}


@pytest.mark.parametrize(
    ("module", "table"),
    [(reg, PLUGIN_REGISTRATION), (dra, DRA_V1), (drahealth, HEALTH_V1ALPHA1),
     (drahealth_v1, HEALTH_V1)],
)
def test_field_numbers_match_kubelet(module, table):
    for message, fields in table.items():
        descriptor = getattr(module, message).DESCRIPTOR
        assert {f.name: f.number for f in descriptor.fields} == fields, message


def test_method_paths_are_kubelets():
    """The package is part of every gRPC method path: kubelet calls exactly these."""
    def paths(module):
        return sorted(
            f"/{service.full_name}/{method.name}"
            for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods
        )

    assert paths(reg) == [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ]
    assert paths(dra) == [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    ]
    assert paths(drahealth) == ["/v1alpha1.DRAResourceHealth/NodeWatchResources"]
    assert paths(drahealth_v1) == ["/v1.DRAResourceHealth/NodeWatchResources"]
    assert [v.name for v in drahealth.HealthStatus.DESCRIPTOR.values] == [
        "UNKNOWN", "HEALTHY", "UNHEALTHY",
    ]
    assert drahealth.HEALTHY == 1 and drahealth.UNHEALTHY == 2


def test_a_prepare_response_round_trips_on_the_wire():
    response = dra.NodePrepareResourcesResponse()
    entry = response.claims["uid-1"]
    entry.devices.add(request_names=["gpu"], pool_name="node-a", device_name="gpu-0",
                      cdi_device_ids=["tessera.io/gpu=uid-1-gpu-0"])
    decoded = dra.NodePrepareResourcesResponse.FromString(response.SerializeToString())
    assert list(decoded.claims["uid-1"].devices[0].cdi_device_ids) == [
        "tessera.io/gpu=uid-1-gpu-0"
    ]
