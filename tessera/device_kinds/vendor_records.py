"""HAMi's per-vendor pod annotations for a pod's grants (what HAMi's scheduler and the vendor's
device plugin write, and the vendor's tools read): each non-NVIDIA family's
`…-devices-to-allocate` / `…-devices-allocated` with its own grants, and what the family adds
(Ascend's `huawei.com/<chip>` runtime info, Cambricon's `CAMBRICON_DSMLU_*`). Tessera's own record
stays `hami.io/vgpu-devices-allocated` for every family. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from . import registry

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo


def vendor_pod_annotations(
    containers: Sequence[Sequence[DeviceGrant]], devices: Mapping[str, DeviceInfo]
) -> dict[str, str]:
    families = {}
    for grants in containers:
        for g in grants:
            family = registry.family_of_type(g.type)
            if family.name != registry.DEFAULT_FAMILY:
                families[family.name] = family
    out: dict[str, str] = {}
    for family in families.values():
        own = [[g for g in grants if registry.family_of_type(g.type) is family]
               for grants in containers]
        text = family.encode_grants(own)
        for key in (family.to_allocate_annotation, family.allocated_annotation):
            if key:
                out[key] = text
        extra = getattr(family, "pod_annotations", None)
        if extra is not None:
            out |= extra(own, devices)
    return out
