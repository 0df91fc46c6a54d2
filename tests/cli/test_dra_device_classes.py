"""An upgrade updates Tessera's DeviceClasses (issue 31): `tessera up --dra` installs them, and
where a class of that name exists with another spec (an older release's selector, mapping or
configuration) it is updated as `kubectl apply` would, keeping what others set on its metadata;
a class already as wanted is left alone. Against kube-sim's real HTTP API."""

from __future__ import annotations

import copy

from tessera_cli.dra import DEVICE_CLASS_PATH, device_classes, install_device_class
from tessera_cli.kube import KubeClient, load_kubeconfig

from .conftest import KubeSim


def test_an_older_releases_deviceclass_is_updated_and_a_current_one_kept(
    kube_sim: KubeSim,
) -> None:
    wanted = {c["metadata"]["name"]: c for c in device_classes()}
    older = copy.deepcopy(wanted["gpu.tessera.io"])
    older["spec"] = {"selectors": [{"cel": {"expression": 'device.driver == "gpu.tessera.io"'}}]}
    older["metadata"]["labels"] = {"team": "platform"}  # set by someone else: kept
    with KubeClient(load_kubeconfig(kube_sim.kubeconfig)) as client:
        client.post(DEVICE_CLASS_PATH, older)
        client.post(DEVICE_CLASS_PATH, wanted["mps.gpu.tessera.io"])  # already current

    line = install_device_class(kube_sim.kubeconfig)

    assert "DeviceClass mig.gpu.tessera.io installed" in line, line
    assert "DeviceClass gpu.tessera.io updated" in line, line
    assert "DeviceClass mps.gpu.tessera.io already installed" in line, line
    for name, cls in wanted.items():
        stored = kube_sim.get(f"{DEVICE_CLASS_PATH}/{name}")
        assert stored["spec"] == cls["spec"], name
    updated = kube_sim.get(f"{DEVICE_CLASS_PATH}/gpu.tessera.io")
    assert updated["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert updated["metadata"]["labels"] == {"team": "platform"}
    again = install_device_class(kube_sim.kubeconfig)
    assert again == ("DeviceClass gpu.tessera.io, mig.gpu.tessera.io, mps.gpu.tessera.io "
                     "already installed")  # fmt: skip
