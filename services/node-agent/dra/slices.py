"""The node's GPUs as a ResourceSlice (`resource.k8s.io/v1`): pure, from the advertised devices.

One pool per node (named after it) in one slice. Each GPU the node offers for libvgpu slices
(mode `hami-core`) is one device `gpu-<index>`:

- attributes: `uuid`, `index`, `type` (HAMi's `NVIDIA-<name>`), `model`, `numa`, `mode`,
  `migCapable`, `driverVersion` (semver);
- `allowMultipleAllocations: true` and three consumable capacities (KEP-5075) whose request
  policies mirror HAMi's units and the node's configuration:
  - `memory`: the advertised memory (physical × memory scaling) in bytes, consumed in whole MiB
    (`validRange {min: 1Mi, step: 1Mi}`); a request that names no memory takes the whole card's
    (HAMi: neither gpumem nor a percentage = 100 %);
  - `cores`: 100 × core scaling, consumed in whole percent of one card, at most 100 per
    allocation (HAMi clamps above 100); default `default_cores` (HAMi's `defaultCores`, 0);
  - `slots`: the split count, one per allocation (`validRange {min: 1, max: 1}`): what bounds how
    many allocations share a card (HAMi's `CardTimeSlicingExhausted`).
- an unhealthy GPU carries the taint `gpu.tessera.io/unhealthy` (NoSchedule): the allocator
  places nothing new on it, running pods keep it (as the device plugin's `Unhealthy`).

MIG- and MPS-mode cards are not published yet (a MIG instance is no libvgpu slice, an MPS
client needs its daemon's pipe directory in the container: docs/dra.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tessera.models import DeviceInfo

from . import names

SLICED_MODES = frozenset({"hami-core"})
_VERSION_PART = re.compile(r"\d+")


def device_name(device: DeviceInfo) -> str:
    return f"gpu-{device.index}"


def semver(version: str) -> str:
    """NVIDIA's driver version (`550.54.15`, `560.35.03`) as the semantic version DRA's
    `version` attribute requires: three numeric parts, no leading zeros."""
    parts = [int(p) for p in _VERSION_PART.findall(version)[:3]]
    parts += [0] * (3 - len(parts))
    return ".".join(str(p) for p in parts)


def model_of(device_type: str) -> str:
    """`NVIDIA-A100-SXM4-80GB` → `A100-SXM4-80GB`; `NVIDIA-NVIDIA H200` → `H200`."""
    model = device_type.removeprefix("NVIDIA-").removeprefix("NVIDIA ").strip()
    return model.replace(" ", "-") or device_type


def device_entry(device: DeviceInfo, *, driver_version: str, default_cores: int,
                 taint_time: str) -> dict[str, Any]:  # fmt: skip
    cores_max = min(100, device.cores)
    entry: dict[str, Any] = {
        "name": device_name(device),
        "attributes": {
            names.ATTR_UUID: {"string": device.uuid},
            names.ATTR_INDEX: {"int": device.index},
            names.ATTR_TYPE: {"string": device.type},
            names.ATTR_MODEL: {"string": model_of(device.type)},
            names.ATTR_NUMA: {"int": device.numa},
            names.ATTR_MODE: {"string": device.mode},
            names.ATTR_MIG_CAPABLE: {"bool": device.mig is not None or device.mode == "mig"},
            names.ATTR_DRIVER_VERSION: {"version": semver(driver_version)},
        },
        "allowMultipleAllocations": True,
        "capacity": {
            names.CAP_MEMORY: {
                "value": f"{device.memory_mib}Mi",
                "requestPolicy": {
                    "default": f"{device.memory_mib}Mi",
                    "validRange": {"min": "1Mi", "step": "1Mi"},
                },
            },
            names.CAP_CORES: {
                "value": str(device.cores),
                "requestPolicy": {
                    "default": str(min(default_cores, cores_max)),
                    "validRange": {"min": "0", "max": str(cores_max), "step": "1"},
                },
            },
            names.CAP_SLOTS: {
                "value": str(device.split_count),
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
            },
        },
    }
    if not device.healthy:
        entry["taints"] = [{
            "key": names.TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule",
            "timeAdded": taint_time,
        }]  # fmt: skip
    return entry


def published(devices: Iterable[DeviceInfo]) -> list[DeviceInfo]:
    """The devices a ResourceSlice offers: libvgpu-sliced cards, by index."""
    return sorted((d for d in devices if d.mode in SLICED_MODES), key=lambda d: d.index)


def slice_name(node: str) -> str:
    return f"{node}-{names.DRIVER_NAME}"


def build_slice(
    node: str,
    devices: Iterable[DeviceInfo],
    *,
    generation: int,
    driver_version: str,
    default_cores: int = 0,
    taint_time: str = "1970-01-01T00:00:00Z",
    node_uid: str = "",
) -> dict[str, Any]:
    """The node's one ResourceSlice (`spec.pool.generation` moves whenever its devices do)."""
    metadata: dict[str, Any] = {
        "name": slice_name(node),
        "labels": {"app.kubernetes.io/managed-by": "tessera-node-agent"},
    }
    if node_uid:  # owned by the Node: a deleted node's slice goes with it (as kubelet's plugins)
        metadata["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
            "controller": True,
        }]  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": names.DRIVER_NAME,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                device_entry(
                    d,
                    driver_version=driver_version,
                    default_cores=default_cores,
                    taint_time=taint_time,
                )
                for d in published(devices)
            ],
        },
    }


def same_devices(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether a stored slice already says what `b` says (its devices), so no write is due."""
    if a is None:
        return False
    spec_a, spec_b = a.get("spec") or {}, b["spec"]
    return (spec_a.get("devices") == spec_b["devices"]
            and spec_a.get("nodeName") == spec_b["nodeName"])  # fmt: skip
