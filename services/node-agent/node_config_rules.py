"""Per-node device configuration, the pure part: reading the ConfigMap, layering its entries,
and deciding whether a new configuration may be applied on this node now.

The ConfigMap `tessera-node-config` holds one key, `config.json`, in HAMi's device-plugin form
(its `nodeconfig` list with HAMi's field names) plus a `defaults` entry the chart renders:

    {"defaults": {"devicesplitcount": 10, "devicememoryscaling": 1, "devicecorescaling": 1},
     "nodeconfig": [{"name": "gpu-a", "devicesplitcount": 4,
                     "filterdevices": {"uuid": ["GPU-..."], "index": [3]}}]}

Layers, lowest first: the agent's settings (chart `config`), `defaults`, the node's entry, the
entry set on the bus (`tessera node-config set`). A field absent from a layer falls through.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.models import (
    NODE_CONFIG_KEY,
    NODE_CONFIG_MAP,
    Allocation,
    DeviceFilter,
    DeviceInfo,
    NodeDeviceConfig,
    NodeLedger,
)
from tessera.settings import TesseraSettings
from tessera.validation import Bounds

from .devices import DeviceConfig, PhysicalGpu

MAX_CONFIG_BYTES = 256 * 1024
MAX_NODE_ENTRIES = 5000


class NodeConfigError(ValueError):
    """A configuration that cannot be used; the message says which field and why."""


class NodeEntry(NodeDeviceConfig):
    name: str = Field(min_length=1, max_length=253)


class ConfigFile(BaseModel):
    """The `config.json` of the ConfigMap."""

    model_config = ConfigDict(extra="forbid")
    defaults: NodeDeviceConfig = Field(default_factory=NodeDeviceConfig)
    nodeconfig: list[NodeEntry] = Field(default_factory=list, max_length=MAX_NODE_ENTRIES)


def _explain(error: ValidationError, where: str) -> str:
    problems = []
    for item in error.errors()[:5]:
        path = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            problems.append(f"{path}: unknown key (known: {', '.join(KNOWN_KEYS)})")
        else:
            got = item.get("input")
            shown = f" (got {got!r})" if isinstance(got, (int, float, str)) else ""
            problems.append(f"{path}: {item['msg']}{shown}")
    return f"{where}: " + "; ".join(problems)


KNOWN_KEYS = ("devicesplitcount", "devicememoryscaling", "devicecorescaling", "operatingmode",
              "migstrategy", "filterdevices", "memoryreclaim")  # fmt: skip


def parse_entry(raw: Any, where: str = "node config") -> NodeDeviceConfig:
    """One entry (as sent on the bus), validated."""
    if not isinstance(raw, dict):
        raise NodeConfigError(f"{where}: must be an object of {', '.join(KNOWN_KEYS)}")
    try:
        return NodeDeviceConfig.model_validate(raw)
    except ValidationError as exc:
        raise NodeConfigError(_explain(exc, where)) from None


def parse_config_map(config_map: dict[str, Any]) -> ConfigFile:
    """The ConfigMap's content; NodeConfigError names what is wrong."""
    where = f"ConfigMap {NODE_CONFIG_MAP}"
    data = config_map.get("data") or {}
    text = data.get(NODE_CONFIG_KEY) if isinstance(data, dict) else None
    if text is None:
        raise NodeConfigError(f"{where}: no key {NODE_CONFIG_KEY!r}")
    if not isinstance(text, str) or len(text.encode()) > MAX_CONFIG_BYTES:
        raise NodeConfigError(f"{where}: {NODE_CONFIG_KEY} must be JSON text under 256 KiB")
    try:
        parsed = ConfigFile.model_validate_json(text)
    except ValidationError as exc:
        raise NodeConfigError(_explain(exc, f"{where} {NODE_CONFIG_KEY}")) from None
    names = [e.name for e in parsed.nodeconfig]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise NodeConfigError(f"{where}: node {twice[0]!r} has more than one entry")
    return parsed


def entry_for(config: ConfigFile | None, node: str) -> NodeDeviceConfig | None:
    if config is None:
        return None
    for entry in config.nodeconfig:
        if entry.name == node:
            return NodeDeviceConfig.model_validate(entry.model_dump(exclude={"name"}))
    return None


def base_entry(settings: TesseraSettings) -> NodeDeviceConfig:
    """The chart's defaults (the agent's settings) as an entry."""
    return NodeDeviceConfig(
        devicesplitcount=settings.device_split_count,
        devicememoryscaling=settings.device_memory_scaling,
        devicecorescaling=settings.device_core_scaling,
        migstrategy=settings.mig_strategy,
        filterdevices=DeviceFilter(),
        memoryreclaim=settings.memory_reclaim_enforcement,
    )


@dataclass(frozen=True)
class Layered:
    """The merged entry and the layers it came from (lowest first)."""

    merged: NodeDeviceConfig
    sources: tuple[str, ...]
    node_specific: NodeDeviceConfig  # the node entry and the local one, merged (no defaults)


def layer(
    settings: TesseraSettings, config: ConfigFile | None, node: str,
    local: NodeDeviceConfig | None,
) -> Layered:
    merged = base_entry(settings)
    sources = ["settings"]
    specific = NodeDeviceConfig()
    if config is not None:
        merged = config.defaults.over(merged)
        sources.append(f"{NODE_CONFIG_MAP}:defaults")
    own = entry_for(config, node)
    if own is not None:
        merged, specific = own.over(merged), own.over(specific)
        sources.append(f"{NODE_CONFIG_MAP}:{node}")
    if local is not None:
        merged, specific = local.over(merged), local.over(specific)
        sources.append("local (tessera node-config set)")
    return Layered(merged, tuple(sources), specific)


def resolve(merged: NodeDeviceConfig, settings: TesseraSettings) -> DeviceConfig:
    base = DeviceConfig.of(settings)
    filters = merged.filterdevices or DeviceFilter()
    return DeviceConfig(
        split_count=merged.devicesplitcount or base.split_count,
        memory_scaling=merged.devicememoryscaling or base.memory_scaling,
        core_scaling=merged.devicecorescaling or base.core_scaling,
        mode=merged.operatingmode,
        mig_strategy=merged.migstrategy or base.mig_strategy,
        exclude_uuids=frozenset(filters.uuid),
        exclude_indices=frozenset(filters.index),
        memory_reclaim=merged.memoryreclaim or base.memory_reclaim,
    )


def node_problem(
    layered: Layered, config: DeviceConfig, gpus: list[PhysicalGpu], bounds: Bounds
) -> str | None:
    """What this node cannot do with `config` (None: it can)."""
    if config.memory_scaling > bounds.memory_scaling + 1e-9:
        return (f"devicememoryscaling {config.memory_scaling:g} is above the cluster's ceiling "
                f"{bounds.memory_scaling:g} (raise TESSERA_MAX_DEVICE_MEMORY_SCALING for every "
                "service, chart global.config.maxDeviceMemoryScaling)")  # fmt: skip
    if config.core_scaling > bounds.core_scaling + 1e-9:
        return (f"devicecorescaling {config.core_scaling:g} is above the cluster's ceiling "
                f"{bounds.core_scaling:g} (raise TESSERA_MAX_DEVICE_CORE_SCALING for every "
                "service, chart global.config.maxDeviceCoreScaling)")  # fmt: skip
    if config.split_count > bounds.max_split_count:
        return f"devicesplitcount {config.split_count} is above {bounds.max_split_count}"
    # A filter in this node's own entry must name GPUs this node has (a typo would otherwise
    # silently offer a GPU meant to be kept out); the shared defaults may name any.
    own = layered.node_specific.filterdevices
    if own is not None:
        uuids = {g.uuid for g in gpus}
        indices = {g.index for g in gpus}
        unknown = [u for u in own.uuid if u not in uuids]
        if unknown:
            return f"filterdevices.uuid: this node has no GPU {unknown[0]}"
        missing = [i for i in own.index if i not in indices]
        if missing:
            return (f"filterdevices.index: this node has no GPU index {missing[0]} "
                    f"(it has {', '.join(str(i) for i in sorted(indices)) or 'none'})")
    if config.mode == "mig":
        plain = [g for g in gpus if config.offers(g) and not g.mig]
        if plain:
            return (f"operatingmode mig: GPU {plain[0].index} ({plain[0].uuid}) is not in MIG "
                    "mode (enable MIG with nvidia-smi first, or filter the GPU out)")
    return None


@dataclass
class GpuUsage:
    memory_mib: int = 0
    cores: int = 0
    slots: int = 0
    pods: int = 0


def usage_of(allocation: Allocation) -> dict[str, GpuUsage]:
    """What one pod holds per GPU: app containers and sidecars summed, init containers by max
    (while they still run), as the scheduler counts it."""
    def per(grants_list: Iterable[list]) -> dict[str, GpuUsage]:
        out: dict[str, GpuUsage] = {}
        for grants in grants_list:
            for g in grants:
                u = out.setdefault(g.uuid, GpuUsage())
                u.memory_mib += g.memory_mib
                u.cores += g.cores
                u.slots += 1
        return out

    usage = per(allocation.app_grants())
    if allocation.init_count and not allocation.init_done:
        for grants in allocation.init_grants():
            for uuid, u in per([grants]).items():
                have = usage.setdefault(uuid, GpuUsage())
                have.memory_mib = max(have.memory_mib, u.memory_mib)
                have.cores = max(have.cores, u.cores)
                have.slots = max(have.slots, u.slots)
    return usage


def allocated(ledger: NodeLedger | None) -> dict[str, GpuUsage]:
    """Per GPU, what every active allocation of the node holds."""
    total: dict[str, GpuUsage] = {}
    for allocation in (ledger.allocations.values() if ledger else ()):
        if not allocation.active:
            continue
        for uuid, u in usage_of(allocation).items():
            t = total.setdefault(uuid, GpuUsage())
            t.memory_mib += u.memory_mib
            t.cores += u.cores
            t.slots += u.slots
            t.pods += 1
    return total


def shrink_problems(devices: list[DeviceInfo], usage: dict[str, GpuUsage]) -> list[str]:
    """Where `devices` would offer less than is allocated (empty: nothing)."""
    offered = {d.uuid: d for d in devices}
    problems = []
    for uuid, u in sorted(usage.items()):
        if u.slots == 0 and u.memory_mib == 0 and u.cores == 0:
            continue
        d = offered.get(uuid)
        if d is None:
            problems.append(f"GPU {uuid} holds {u.pods} pod(s) and would no longer be offered")
            continue
        if u.memory_mib > d.memory_mib:
            problems.append(f"GPU {d.index} ({uuid}): {u.memory_mib} MiB allocated, the new "
                            f"configuration offers {d.memory_mib} MiB")  # fmt: skip
        if u.cores > d.cores:
            problems.append(f"GPU {d.index} ({uuid}): {u.cores}% compute allocated, the new "
                            f"configuration offers {d.cores}%")  # fmt: skip
        if u.slots > d.split_count:
            problems.append(f"GPU {d.index} ({uuid}): {u.slots} containers hold slots, the new "
                            f"split count is {d.split_count}")  # fmt: skip
    return problems


def describe(config: DeviceConfig) -> str:
    parts = [f"split {config.split_count}", f"memory ×{config.memory_scaling:g}",
             f"cores ×{config.core_scaling:g}"]  # fmt: skip
    if config.mode:
        parts.append(f"mode {config.mode}")
    if config.mig_strategy != "none":
        parts.append(f"migstrategy {config.mig_strategy}")
    if config.memory_reclaim != "evict":
        parts.append(f"memoryreclaim {config.memory_reclaim}")
    skipped = sorted(config.exclude_uuids) + [f"index {i}" for i in sorted(config.exclude_indices)]
    if skipped:
        parts.append(f"skipping {', '.join(skipped)}")
    return ", ".join(parts)


def effective_entry(config: DeviceConfig) -> dict[str, Any]:
    """The applied configuration in the ConfigMap's own form (for `get` and the state file)."""
    entry = NodeDeviceConfig(
        devicesplitcount=config.split_count,
        devicememoryscaling=config.memory_scaling,
        devicecorescaling=config.core_scaling,
        operatingmode=config.mode,  # type: ignore[arg-type]
        migstrategy=config.mig_strategy,  # type: ignore[arg-type]
        filterdevices=DeviceFilter(uuid=sorted(config.exclude_uuids),
                                   index=sorted(config.exclude_indices)),
        memoryreclaim=config.memory_reclaim,  # type: ignore[arg-type]
    )
    return entry.model_dump(exclude_none=True)


def mode_change_problems(
    old: list[DeviceInfo], new: list[DeviceInfo], usage: dict[str, GpuUsage]
) -> list[str]:
    """Where a GPU holding pods would change its sharing mode (hami-core / mig / mps): never
    two modes on one card, so the switch waits until the card is empty."""
    before = {d.uuid: d.mode for d in old}
    problems = []
    for d in new:
        u = usage.get(d.uuid)
        was = before.get(d.uuid)
        if u is not None and u.pods and was is not None and was != d.mode:
            problems.append(f"GPU {d.index} ({d.uuid}) holds {u.pods} pod(s) in {was} mode and "
                            f"cannot switch to {d.mode} until they are gone")
    return problems
