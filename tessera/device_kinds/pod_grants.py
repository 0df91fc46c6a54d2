"""A pod's grants in HAMi's per-family pod annotations, written and read back. Pure.

HAMi keeps one pair of keys per device type (`pkg/device/<vendor>/device.go`: each vendor's
`InRequestDevices` / `SupportDevices` entry, patched by its `PatchAnnotations` only when the pod
holds devices of that type), each listing every container in order with that type's devices
only (`UUID,TYPE,MEM,CORES:` per device, `;` per container, empty containers kept):

- NVIDIA: `hami.io/vgpu-devices-to-allocate`, `hami.io/vgpu-devices-allocated`;
- Ascend (per chip): `hami.io/<commonWord>-devices-to-allocate`, `…-devices-allocated`;
- Cambricon MLU: `hami.io/cambricon-mlu-devices-to-allocate`, `…-devices-allocated`;
- Hygon DCU: `hami.io/dcu-devices-to-allocate`, `hami.io/dcu-devices-allocated`.

So an MLU pod carries no `hami.io/vgpu-…` key (HAMi's NVIDIA tools would read its MLUs as
GPUs). A *role* names the pair's half: `TO_ALLOCATE` (the scheduler writes it at bind) or
`ALLOCATED` (the node agent writes it once the pod is allocated: Tessera's durable, signed
record). Readers take the pod's whole record back as one text in the form every family shares
(`pod_grants_text`): for a pod of one family that is its annotation as written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from . import registry

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo

    from .base import DeviceFamily

TO_ALLOCATE = "to-allocate"
ALLOCATED = "allocated"
ROLES = (TO_ALLOCATE, ALLOCATED)


def _key(family: DeviceFamily, role: str) -> str:
    return family.to_allocate_annotation if role == TO_ALLOCATE else family.allocated_annotation


def role_keys(role: str) -> tuple[str, ...]:
    """Every family's key for `role` (clearing a record clears them all)."""
    if role not in ROLES:
        raise ValueError(f"unknown grant record role {role!r}")
    return _role_keys(role, registry.version)


@cache
def _role_keys(role: str, _version: int) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for f in registry.families() if (k := _key(f, role))))


@cache
def _pairs(_version: int) -> tuple[tuple[str, str], ...]:
    """(allocated key, to-allocate key) of every family, in registry order."""
    return tuple(dict.fromkeys((f.allocated_annotation, f.to_allocate_annotation)
                               for f in registry.families()))  # fmt: skip


def all_keys() -> tuple[str, ...]:
    """Both roles' keys of every family (what a reader of grant records must keep)."""
    return (*role_keys(TO_ALLOCATE), *role_keys(ALLOCATED))


def is_grant_key(key: str) -> bool:
    """Whether `key` is a family's grant record (only the scheduler and node agents write
    one: admission denies it from anyone else, as NVIDIA's)."""
    return key in _key_set(registry.version)


@cache
def _key_set(_version: int) -> frozenset[str]:
    return frozenset(all_keys())


def by_family(
    containers: Sequence[Sequence[DeviceGrant]],
) -> list[tuple[DeviceFamily, list[list[DeviceGrant]]]]:
    """The families the pod holds devices of (first appearance order), each with every
    container's grants of that family (the other containers empty)."""
    families: dict[str, DeviceFamily] = {}
    for grants in containers:
        for g in grants:
            family = registry.family_of_type(g.type)
            families.setdefault(family.name, family)
    if len(families) == 1:  # the common case: one family, the grants as they are
        (family,) = families.values()
        return [(family, [list(c) for c in containers])]
    return [(family, [[g for g in grants if registry.family_of_type(g.type) is family]
                      for grants in containers])
            for family in families.values()]  # fmt: skip


def grant_annotations(
    containers: Sequence[Sequence[DeviceGrant]], roles: Sequence[str]
) -> dict[str, str]:
    """Each held family's key of each role with the family's grants (HAMi's encoding)."""
    out: dict[str, str] = {}
    for family, own in by_family(containers):
        text = family.encode_grants(own)
        for role in roles:
            key = _key(family, role)
            if key:
                out[key] = text
    return out


def family_extras(
    containers: Sequence[Sequence[DeviceGrant]], devices: Mapping[str, DeviceInfo]
) -> dict[str, str]:
    """What each held family adds for its vendor's tools once the pod is allocated (Ascend's
    `huawei.com/<chip>` runtime info, Cambricon's `CAMBRICON_DSMLU_*`): `pod_annotations`."""
    out: dict[str, str] = {}
    for family, own in by_family(containers):
        extra = getattr(family, "pod_annotations", None)
        if extra is not None:
            out |= extra(own, devices)
    return out


def pod_grants_text(annotations: Mapping[str, Any], role: str | None = None) -> str | None:
    """The pod's grants as one text (`hami.encode_pod_devices`' form), from each family's key
    of `role` (None: each family's `-allocated`, else its `-to-allocate`, as a reader of the
    record takes it); None when no family's key holds a record. One family: its value as
    written (so a signature over it verifies). Several: their containers merged, in registry
    order. ValueError when a value to merge is malformed."""
    if role is not None and role not in ROLES:
        raise ValueError(f"unknown grant record role {role!r}")
    found: list[str] = []
    for allocated, to_allocate in _pairs(registry.version):
        if role is None:
            text = annotations.get(allocated) or annotations.get(to_allocate)
        else:
            text = annotations.get(allocated if role == ALLOCATED else to_allocate)
        if text:
            found.append(text)
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    return _merge(found)


def _merge(texts: list[str]) -> str:
    from tessera import hami

    merged: list[list[str]] = []
    for text in texts:
        if not isinstance(text, str):
            raise ValueError("a grant record is not a string")
        for index, devices in enumerate(hami.parse_pod_devices(text)):
            while len(merged) <= index:
                merged.append([])
            merged[index].extend(f"{u},{t},{m},{c}:" for u, t, m, c in devices)
    return "".join("".join(items) + ";" for items in merged)


def placed_grants(annotations: dict[str, Any], containers: int) -> list[list[DeviceGrant]]:
    """What a pod placed by HAMi's own scheduler holds (a cluster migrating from HAMi), from
    every family's record as HAMi writes it: each family's `-allocated`, or its `-to-allocate`
    while that lists no device (`hami.read_pod_grants`, checked the same way), the families'
    containers merged in registry order. An Ascend, Cambricon or Hygon pod's devices count as
    an NVIDIA pod's do. ValueError naming the key when a record is malformed; [] when the pod
    carries no family's record."""
    from tessera import hami

    merged: list[list[DeviceGrant]] = []
    for allocated, to_allocate in _pairs(registry.version):
        grants = hami.read_pod_grants(annotations, containers, (allocated, to_allocate))
        for index, devices in enumerate(grants):
            while len(merged) <= index:
                merged.append([])
            merged[index].extend(devices)
    return merged


def part_map(devices: Sequence[Any]) -> dict[str, str]:
    """ID of one of the devices HAMi counts -> the registered device spanning it, for devices
    that span several (`DeviceInfo.part_ids`: a 910C module's NPUs); empty when none does.
    `devices` are a registration's (models or their checked wire form)."""
    parts: dict[str, str] = {}
    for device in devices:
        ids = getattr(device, "part_ids", None)
        if isinstance(ids, list) and len(ids) > 1:
            for part in ids:
                parts[part] = device.uuid
    return parts


def onto_devices(containers: list[list[DeviceGrant]], parts: Mapping[str, str],
                 ) -> list[list[DeviceGrant]]:  # fmt: skip
    """A record HAMi wrote, as the registered devices hold it: HAMi lists each NPU of a 910C
    module (HAMi's Ascend plugin registers NPUs), Tessera's registration the module, so each
    container's grants on one module's NPUs become one grant on the module, their memory and
    cores summed (`parts`: `part_map`). Grants on other devices are kept as they are."""
    if not parts:
        return containers
    out: list[list[DeviceGrant]] = []
    for grants in containers:
        merged: dict[str, DeviceGrant] = {}
        for grant in grants:
            uuid = parts.get(grant.uuid, grant.uuid)
            held = merged.get(uuid)
            if held is None:
                merged[uuid] = grant.model_copy(update={"uuid": uuid})
            else:
                merged[uuid] = held.model_copy(update={
                    "memory_mib": held.memory_mib + grant.memory_mib,
                    "cores": held.cores + grant.cores})  # fmt: skip
        out.append(list(merged.values()))
    return out
