"""`tessera up --dra`: the local stack in DRA mode.

Every simulated node's agent is a kubelet DRA plugin (`TESSERA_DRA=true`, its kubelet's
directories under the stack's socket root, CDI specs in `<node>/cdi`), the webhook converts
HAMi pods into ResourceClaims (`TESSERA_ALLOCATION_MODE=dra`), and Tessera's DeviceClass is
installed once kube-sim answers. A nodes file may put only some nodes in DRA mode (`dra: true`):
one cluster, both modes, on different nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DRIVER = "gpu.tessera.io"
DEVICE_CLASS_PATH = "/apis/resource.k8s.io/v1/deviceclasses"


def device_class() -> dict[str, Any]:
    """Tessera's DeviceClass: the driver's devices; `nvidia.com/gpu` mapped to it (KEP-5004),
    so a pod the webhook never converted still gets a whole card through DRA."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {
            "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }


def node_env(node_dir: Path) -> dict[str, str]:
    """A DRA node agent's settings: kubelet's plugin directories of its simulated kubelet."""
    return {
        "TESSERA_DRA": "true",
        "TESSERA_DRA_KUBELET_DIR": str(node_dir),
        "TESSERA_DRA_CDI_DIR": str(node_dir / "cdi"),
    }


def install_device_class(kubeconfig: Path) -> str:
    """Create the DeviceClass (kept when it exists); a line saying what happened."""
    from .kube import ApiError, KubeClient, load_kubeconfig

    with KubeClient(load_kubeconfig(kubeconfig)) as client:
        try:
            client.post(DEVICE_CLASS_PATH, device_class())
        except ApiError as error:
            if error.status == 409:
                return f"DeviceClass {DRIVER} already installed"
            raise
    return f"DeviceClass {DRIVER} installed"


def slice_published(api_url: str, node: str) -> bool:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api_url}/apis/resource.k8s.io/v1/resourceslices/"
                                    f"{node}-{DRIVER}", timeout=2) as reply:  # fmt: skip
            return bool(json.loads(reply.read()).get("spec", {}).get("devices"))
    except (OSError, ValueError):
        return False
