"""The .proto files match kubelet's wire format (field numbers from the published APIs), and the
stubs regenerate by themselves where the package directory cannot be written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.kubeapi import dp, pr

# message -> {field: number}, from the device plugin v1beta1 and pod-resources v1 APIs.
DEVICE_PLUGIN = {
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "ListAndWatchResponse": {"devices": 1},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3,
    },
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "CDIDevice": {"name": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {
        "envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5,
    },
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
}
POD_RESOURCES = {
    "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5},
    "ContainerResources": {
        "name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5,
    },
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
    "DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
    "ClaimResource": {
        "cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4, "share_id": 5,
    },
    "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
    "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
    "GetPodResourcesResponse": {"pod_resources": 1},
}


@pytest.mark.parametrize(("module", "table"), [(dp, DEVICE_PLUGIN), (pr, POD_RESOURCES)])
def test_field_numbers_match_kubelet(module, table):
    for message, fields in table.items():
        descriptor = getattr(module, message).DESCRIPTOR
        actual = {f.name: f.number for f in descriptor.fields}
        assert actual == fields, message


def test_packages_and_services_are_kubelets():
    assert dp.DESCRIPTOR.package == "v1beta1" and pr.DESCRIPTOR.package == "v1"
    assert dp.DESCRIPTOR.name == "deviceplugin/v1beta1/api.proto"
    services = {
        s.name: [m.name for m in s.methods] for s in dp.DESCRIPTOR.services_by_name.values()
    }
    assert services == {
        "Registration": ["Register"],
        "DevicePlugin": [
            "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
            "PreStartContainer",
        ],
    }
    lister = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert [m.name for m in lister.methods] == ["List", "GetAllocatableResources", "Get"]


def test_stubs_generate_into_the_cache_when_the_package_is_read_only(tmp_path: Path):
    """A normal (non-editable) install: the package with its protos, where `generated/` cannot
    be created (a file blocks it: even root cannot write there)."""
    import tessera.kubeapi as kubeapi

    site = tmp_path / "site"
    package = site / "tessera" / "kubeapi"
    shutil.copytree(Path(kubeapi.__file__).parent, package,
                    ignore=shutil.ignore_patterns("generated", "__pycache__"))
    shutil.copytree(Path(kubeapi.__file__).parent.parent.parent / "protos", package / "protos")
    (site / "tessera" / "__init__.py").write_text("")
    (package / "generated").write_text("not a directory")
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = (
        "import tessera.kubeapi as k; print(k.__file__); "
        "print(k.dp.RegisterRequest(version='v1beta1').version)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path).stdout
    assert out.splitlines() == [str(package / "__init__.py"), "v1beta1"]
    assert list((tmp_path / "cache" / "tessera" / "kubeapi").glob("*/COMPLETE"))
