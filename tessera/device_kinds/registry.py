"""Which family a resource name belongs to, which kind serves a device. One process-wide registry.

Families and kinds register themselves when their folder is imported; `load()` imports every
folder named in BUILTIN (a vendor is added by one line there) and is idempotent. Lookups are
dict reads: the scheduler asks per node and per request, never per card in its inner loop.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tessera.hami import RequestError

from .base import DeviceFamily, DeviceKind, HamiRegistration, ResourceNames, Take

if TYPE_CHECKING:
    from tessera.hami import ContainerRequest
    from tessera.models import DeviceInfo
    from tessera.settings import TesseraSettings

    from .node import NodeFamily

# The family of a request that names none explicitly (ContainerRequest.family's default); its
# admission also sees containers naming no family's resources.
DEFAULT_FAMILY = "nvidia"
# The folders that register the built-in families and kinds (a vendor adds its line here).
BUILTIN: tuple[str, ...] = (
    "tessera.device_kinds.nvidia",
    "tessera.device_kinds.ascend",
    "tessera.device_kinds.cambricon",
    "tessera.device_kinds.hygon",
)

_families: dict[str, DeviceFamily] = {}
_kinds: dict[str, DeviceKind] = {}  # kind name -> kind
_by_mode: dict[str, DeviceKind] = {}  # DeviceInfo.mode -> kind
_nodes: dict[str, NodeFamily] = {}  # family name -> its node-agent side
_type_families: dict[str, DeviceFamily] = {}  # device type -> family (family_of_type)
_names_cache: dict[int, tuple[Any, dict[str, DeviceFamily]]] = {}  # id(settings) -> names
_asking_cache: dict[int, tuple[Any, frozenset[str]]] = {}  # id(settings) -> device_resources
_loaded = False
# Bumped by every register/unregister: callers that keep what a mode maps to start again.
version = 0
_on_change: list[Callable[[], None]] = []


def on_change(forget: Callable[[], None]) -> None:
    """Call `forget` whenever a family or kind is registered or unregistered (a caller that
    keeps what a mode maps to, per device, drops it then)."""
    _on_change.append(forget)


def _changed() -> None:
    global version
    version += 1
    _names_cache.clear()
    _asking_cache.clear()
    _type_families.clear()
    for forget in _on_change:
        forget()


def register(family: DeviceFamily, *kinds: DeviceKind) -> None:
    """Register a family and its kinds (at import of the family's folder). A mode served by two
    kinds, or a family name taken by another object, is a programming error."""
    known = _families.get(family.name)
    if known is not None and known is not family:
        raise ValueError(f"device family {family.name!r} is registered twice")
    _families[family.name] = family
    for kind in kinds:
        if kind.family is not family:
            raise ValueError(f"kind {kind.name!r} belongs to {kind.family.name!r}, "
                             f"not {family.name!r}")  # fmt: skip
        for mode in kind.modes:
            mode = mode.lower()
            other = _by_mode.get(mode)
            if other is not None and other is not kind:
                raise ValueError(f"mode {mode!r} is served by {other.name!r} and {kind.name!r}")
            _by_mode[mode] = kind
        _kinds[kind.name] = kind
    _changed()


def unregister(name: str) -> None:
    """Forget a family, its kinds and its node side (tests register families of their own)."""
    family_ = _families.pop(name, None)
    for kind_name, kind in list(_kinds.items()):
        if kind.family is family_:
            del _kinds[kind_name]
    for mode, kind in list(_by_mode.items()):
        if kind.family is family_:
            del _by_mode[mode]
    _nodes.pop(name, None)
    _changed()


def register_node(node_family: NodeFamily) -> None:
    """Register a family's node-agent side (imported by the node agent only)."""
    _nodes[node_family.family.name] = node_family


def load() -> None:
    """Import every built-in folder (each registers itself)."""
    global _loaded
    if _loaded:
        return
    for module in BUILTIN:
        importlib.import_module(module)
    _loaded = True


def families() -> list[DeviceFamily]:
    load()
    return list(_families.values())


def family(name: str) -> DeviceFamily:
    load()
    found = _families.get(name)
    if found is None:
        raise KeyError(f"no device family {name!r} (known: {', '.join(sorted(_families))})")
    return found


def kinds() -> list[DeviceKind]:
    load()
    return list(_kinds.values())


def kind_for_mode(mode: str) -> DeviceKind | None:
    """The kind serving devices registered in `mode` (None: no kind knows the mode)."""
    load()
    kind = _by_mode.get(mode)
    return kind if kind is not None else _by_mode.get(mode.lower())


def kind_of(device: DeviceInfo) -> DeviceKind | None:
    return kind_for_mode(device.mode)


def rounded_take(device: DeviceInfo | None, request: ContainerRequest,
                 grant_type: str = "") -> Take | None:  # fmt: skip
    """What a grant of `request` may hold on `device` when its kind rounds requests up
    (`DeviceKind.rounded_take`: an Ascend template); None: the request's own amounts. A device
    not known (its node not registered yet) is told by the grant's type when its family has
    one kind. Only for a request of the kind's own family (a grant on another family's device
    is never rounded up)."""
    kind = kind_of(device) if device is not None else None
    if kind is None and grant_type:
        family = family_of_type(grant_type)
        own = [k for k in _kinds.values() if k.family is family]
        kind = own[0] if len(own) == 1 else None
    if kind is None or kind.family.name != request.family:
        return None
    return kind.rounded_take(request)


def family_of_mode(mode: str) -> str:
    """The family name of a device in `mode` ('' when no kind serves the mode)."""
    kind = kind_for_mode(mode)
    return kind.family.name if kind is not None else ""


def family_of_type(device_type: str) -> DeviceFamily:
    """The family of a device or grant by its type (`type_prefixes`); a type no family claims
    is the default family's (HAMi's NVIDIA registrations name any model)."""
    found = _type_families.get(device_type)
    if found is None:
        load()
        found = next((f for f in _families.values()
                      if device_type.startswith(f.type_prefixes) and f.type_prefixes),
                     _families[DEFAULT_FAMILY])  # fmt: skip
        if len(_type_families) < 4096:
            _type_families[device_type] = found
    return found


def counts_in_quota(family_name: str) -> bool:
    """Whether requests of the family count against Tessera's namespace quota."""
    load()
    found = _families.get(family_name)
    return found is not None and found.counts_in_quota


def register_annotations(devices: Sequence[DeviceInfo]) -> dict[str, str]:
    """Each family's node annotation (HAMi's hami.io/node-…-register) for the node's devices,
    grouped by the kind serving each; the default family's always (empty: none of its devices).
    A mode no kind serves is the default family's (as the scheduler reads it)."""
    load()
    default = _families[DEFAULT_FAMILY]
    grouped: dict[str, tuple[DeviceFamily, list[DeviceInfo]]] = {default.name: (default, [])}
    for device in devices:
        kind = kind_for_mode(device.mode)
        fam = kind.family if kind is not None else default
        grouped.setdefault(fam.name, (fam, []))[1].append(device)
    return {fam.register_annotation: fam.encode_register(members)
            for fam, members in grouped.values()}


def hami_registrations(
    annotations: Mapping[str, Any], capacity: Mapping[str, Any], settings: TesseraSettings,
) -> tuple[HamiRegistration, ...]:
    """Every family's devices on a node as HAMi's scheduler would read them
    (`DeviceFamily.hami_registration`), the default family's excepted (NVIDIA's register
    annotation is read with its devices: services/scheduler/foreign.py)."""
    load()
    found = (f.hami_registration(annotations, capacity, settings)
             for name, f in _families.items() if name != DEFAULT_FAMILY)
    return tuple(r for r in found if r is not None)


HANDSHAKE_TIME_FORMAT = "%Y.%m.%d %H:%M:%S"  # HAMi's device plugins' (Go's 2006.01.02 15:04:05)


def handshake_annotations(devices: Sequence[DeviceInfo], now: float | None = None,
                          ) -> dict[str, str]:  # fmt: skip
    """HAMi's `hami.io/node-handshake-<device>` = `Reported_<time>` of each family with
    devices here that has one (Ascend's per chip type, Hygon's `-dcu`): what HAMi's device
    plugins patch with the register annotation every 30 s (HAMi's protocol: the scheduler
    reads a stale or `Requesting_` one as a node whose plugin is gone)."""
    load()
    value = "Reported_" + time.strftime(HANDSHAKE_TIME_FORMAT, time.localtime(now))
    out: dict[str, str] = {}
    for device in devices:
        kind = kind_for_mode(device.mode)
        key = getattr(kind.family, "handshake_annotation", "") if kind is not None else ""
        if key:
            out[key] = value
    return out


def node_family(name: str) -> NodeFamily | None:
    load()
    return _nodes.get(name)


# --- resource names ---------------------------------------------------------------------------

def resource_map(settings: TesseraSettings) -> dict[str, DeviceFamily]:
    """Every resource name in effect -> its family (kept per settings object)."""
    load()
    cached = _names_cache.get(id(settings))
    if cached is not None and cached[0] is settings:
        return cached[1]
    mapping: dict[str, DeviceFamily] = {}
    for fam in _families.values():
        for name in fam.resource_names(settings).all():
            other = mapping.get(name)
            if other is not None and other is not fam:
                raise ValueError(f"resource {name} is named by families {other.name!r} and "
                                 f"{fam.name!r}")  # fmt: skip
            mapping[name] = fam
    _names_cache[id(settings)] = (settings, mapping)
    return mapping


def device_resources(settings: TesseraSettings) -> frozenset[str]:
    """Every resource name in effect that asks for devices, of any family: count, memory
    (percentage) and cores (not NVIDIA's priority: it asks for nothing by itself). Kept per
    settings object."""
    cached = _asking_cache.get(id(settings))
    if cached is not None and cached[0] is settings:
        return cached[1]
    load()
    names: set[str] = set()
    for fam in _families.values():
        n = fam.resource_names(settings)
        names.update(x for x in (n.count, n.memory, n.memory_percentage, n.cores) if x)
    found = frozenset(names)
    _asking_cache[id(settings)] = (settings, found)
    return found


def family_for_resource(name: str, settings: TesseraSettings) -> DeviceFamily | None:
    return resource_map(settings).get(name)


def names_of(family_name: str, settings: TesseraSettings) -> ResourceNames:
    return family(family_name).resource_names(settings)


def families_named(container: Mapping[str, Any], settings: TesseraSettings) -> list[DeviceFamily]:
    """The families whose resources the container names in its limits or requests (in
    registration order)."""
    mapping = resource_map(settings)
    resources = container.get("resources")
    named: list[DeviceFamily] = []
    if isinstance(resources, dict):
        for section in ("limits", "requests"):
            values = resources.get(section)
            if isinstance(values, dict):
                for key in values:
                    fam = mapping.get(key) if isinstance(key, str) else None
                    if fam is not None and fam not in named:
                        named.append(fam)
    return named


def request_reader(
    settings: TesseraSettings,
) -> Callable[[Mapping[str, Any], TesseraSettings], ContainerRequest | None]:
    """`read_request`, or the default family's own reader while it is the only family (the
    scheduler reads every pod it decides: no lookups then)."""
    if not _loaded:
        load()
    if len(_families) == 1:
        return _families[DEFAULT_FAMILY].reader
    return read_request


def read_request(
    container: Mapping[str, Any], settings: TesseraSettings
) -> ContainerRequest | None:
    """The container's device request, whichever family it names (None: none). A container
    names one family: naming two is a RequestError saying so."""
    named = families_named(container, settings)
    if not named:
        return None
    if len(named) > 1:
        raise RequestError(
            f"container {container.get('name', '?')}: asks devices of "
            f"{' and '.join(f.name for f in named)}; a container takes devices of one family "
            "(put each family's devices in its own container)")
    return named[0].read_request(container, settings)
