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

A card in mode `mps` is published as the same device with `mode: mps` (the DeviceClass
`mps.gpu.tessera.io` selects those; a claim on one is prepared with MPS sharing,
`tessera/dra_config.py`).
A card in dynamic MIG is published as its MIG partitions instead (`partitions.py`): devices
consuming the card's counter set. The API keeps devices and counter sets in different slices
of the pool (`Only one of Devices and SharedCounters can be set in a ResourceSlice`, at most 8
counter sets a slice, at most 64 devices in a slice where any consumes counters or carries a
taint), so a node's pool is one or more slices (`build_slices`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tessera import dra_names as names
from tessera.dra_grants import SLICED_MODES, device_name, offered_profiles, partition_name
from tessera.dra_grants import model_of as mig_model_of
from tessera.models import DeviceInfo

from . import partitions

MAX_DEVICES = 128
MAX_DEVICES_WITH_COUNTERS_OR_TAINTS = 64
MAX_COUNTER_SETS = 8
_VERSION_PART = re.compile(r"\d+")


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
        "attributes": card_attributes(device, driver_version),
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
    return _tainted(entry, device, taint_time)


def card_attributes(device: DeviceInfo, driver_version: str) -> dict[str, Any]:
    return {
        names.ATTR_UUID: {"string": device.uuid},
        names.ATTR_INDEX: {"int": device.index},
        names.ATTR_TYPE: {"string": device.type},
        names.ATTR_MODEL: {"string": model_of(device.type)},
        names.ATTR_NUMA: {"int": device.numa},
        names.ATTR_MODE: {"string": device.mode},
        names.ATTR_MIG_CAPABLE: {"bool": device.mig is not None or device.mode == "mig"},
        names.ATTR_DRIVER_VERSION: {"version": semver(driver_version)},
    }


def _tainted(entry: dict[str, Any], device: DeviceInfo, taint_time: str) -> dict[str, Any]:
    """An unhealthy card's device (or each of its partitions) carries the taint."""
    if not device.healthy:
        entry["taints"] = [{
            "key": names.TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule",
            "timeAdded": taint_time,
        }]  # fmt: skip
    return entry


def published(devices: Iterable[DeviceInfo]) -> list[DeviceInfo]:
    """The cards the pool offers, by index: libvgpu-sliced and MPS cards whole, cards in
    dynamic MIG as their partitions."""
    return sorted((d for d in devices if d.mode in SLICED_MODES
                   or mig_model_of(d) is not None), key=lambda d: d.index)  # fmt: skip


def device_names(device: DeviceInfo) -> list[str]:
    """The names the card is published under (one, or each of its MIG partitions)."""
    model = mig_model_of(device)
    if model is None:
        return [device_name(device)]
    return [partition_name(device, p.name, s)
            for p in offered_profiles(model, device) for s in p.starts]  # fmt: skip


def pool_entries(devices: Iterable[DeviceInfo], *, driver_version: str, default_cores: int,
                 taint_time: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """(devices, counter sets) of the node's pool."""
    entries: list[dict[str, Any]] = []
    counter_sets: list[dict[str, Any]] = []
    for d in published(devices):
        model = mig_model_of(d)
        if model is None:
            entries.append(device_entry(d, driver_version=driver_version,
                                        default_cores=default_cores, taint_time=taint_time))
            continue
        counter_sets.append(partitions.counter_set(d, model))
        entries += [_tainted(e, d, taint_time) for e in partitions.partition_entries(
            d, model, card_attributes(d, driver_version))]  # fmt: skip
    return entries, counter_sets


def slice_name(node: str, part: int = 0) -> str:
    """The pool's first slice keeps the node's one name; further slices are numbered."""
    base = f"{node}-{names.DRIVER_NAME}"
    return base if part == 0 else f"{base}-{part}"


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def build_slices(
    node: str,
    devices: Iterable[DeviceInfo],
    *,
    generation: int,
    driver_version: str,
    default_cores: int = 0,
    taint_time: str = "1970-01-01T00:00:00Z",
    node_uid: str = "",
) -> list[dict[str, Any]]:
    """The node's pool: slices of devices, then slices of counter sets (`spec.pool.generation`
    moves whenever anything in the pool does; every slice carries the pool's slice count)."""
    entries, counter_sets = pool_entries(devices, driver_version=driver_version,
                                         default_cores=default_cores, taint_time=taint_time)
    limited = any(e.get("consumesCounters") or e.get("taints") for e in entries)
    size = MAX_DEVICES_WITH_COUNTERS_OR_TAINTS if limited else MAX_DEVICES
    parts: list[dict[str, Any]] = [{"devices": c} for c in _chunks(entries, size)] or [
        {"devices": []}]
    parts += [{"sharedCounters": c} for c in _chunks(counter_sets, MAX_COUNTER_SETS)]
    out = []
    for i, part in enumerate(parts):
        metadata: dict[str, Any] = {
            "name": slice_name(node, i),
            "labels": {"app.kubernetes.io/managed-by": "tessera-node-agent"},
        }
        if node_uid:  # owned by the Node: a deleted node's slices go with it (as kubelet's)
            metadata["ownerReferences"] = [{
                "apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                "controller": True,
            }]  # fmt: skip
        out.append({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": {
                "driver": names.DRIVER_NAME,
                "nodeName": node,
                "pool": {"name": node, "generation": generation,
                         "resourceSliceCount": len(parts)},
                **part,
            },
        })  # fmt: skip
    return out


def build_slice(node: str, devices: Iterable[DeviceInfo], **kwargs: Any) -> dict[str, Any]:
    """The pool's first slice (the whole pool on a node without MIG partitions)."""
    return build_slices(node, devices, **kwargs)[0]


def same_devices(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether a stored slice already says what `b` says (its devices, its counter sets), so no
    write is due."""
    if a is None:
        return False
    spec_a, spec_b = a.get("spec") or {}, b["spec"]
    return (spec_a.get("devices") == spec_b.get("devices")
            and spec_a.get("sharedCounters") == spec_b.get("sharedCounters")
            and spec_a.get("nodeName") == spec_b["nodeName"])  # fmt: skip
