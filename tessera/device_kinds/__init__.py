"""Device kinds: one narrow interface per vendor and sharing mode (DESIGN.md §8).

`base` holds the interface (DeviceFamily: what pods name; DeviceKind: how a device is shared),
`node` the node agent's half, `registry` the lookups (resource name -> family, device mode ->
kind). Each vendor is a folder registering itself (see README.md).
"""

from . import registry
from .base import (
    AdmissionNotes,
    ContainerEdits,
    DeviceFamily,
    DeviceKind,
    DeviceNode,
    DeviceView,
    GrantContext,
    Mount,
    QuotaCharge,
    ResourceNames,
    Selection,
    Take,
)

__all__ = [
    "AdmissionNotes", "ContainerEdits", "DeviceFamily", "DeviceKind", "DeviceNode", "DeviceView",
    "GrantContext", "Mount", "QuotaCharge", "ResourceNames", "Selection", "Take", "registry",
]  # fmt: skip
