"""A card in dynamic MIG as partitionable devices (KEP-4815, `resource.k8s.io/v1`): pure.

The allocator knows nothing of MIG; NVIDIA's placement rules (tessera/mig.py: a profile only at
its documented starts, no memory slice shared, no more compute slices than the card has) become
shared counters it keeps exactly:

- one counter set per card, `gpu-<index>-counters`: a counter `memory-slice-<k>` of 1 for each
  memory slice, and `compute-slices` (7 on an A100/H100/H200, 4 on an A30);
- one device per profile and start the card allows, `gpu-<index>-mig-<profile>-<start>`
  (`gpu-0-mig-3g-40gb-4`), consuming the memory slices its placement spans and its compute
  slices. Two placements that overlap cannot both be allocated (a memory-slice counter would go
  to 2), nor instances using more compute slices than the card has;
- a partition is not shared (no `allowMultipleAllocations`): a MIG instance is one claim's.
  Its capacities are the profile's memory and compute share (HAMi's cores unit), so a selector
  or a capacity request reads them as a whole card's.

The node's operator geometries (`mig_geometries`) restrict which profiles are published (those
some geometry names); which *combinations* a geometry allows is not expressible as counters.
"""

from __future__ import annotations

from typing import Any

from tessera import dra_names as names
from tessera import mig as mig_tables
from tessera.dra_grants import offered_profiles, partition_name
from tessera.models import DeviceInfo


def counter_set_name(device: DeviceInfo) -> str:
    return f"gpu-{device.index}-counters"


def counter_set(device: DeviceInfo, model: mig_tables.MigModel) -> dict[str, Any]:
    counters = {names.COUNTER_MEMORY_SLICE.format(k): {"value": "1"}
                for k in range(model.memory_slices)}  # fmt: skip
    counters[names.COUNTER_COMPUTE_SLICES] = {"value": str(model.compute_slices)}
    return {"name": counter_set_name(device), "counters": counters}


def partition_entries(device: DeviceInfo, model: mig_tables.MigModel,
                      attributes: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Every placement of every offered profile; `attributes`: the card's own (uuid, type, …)."""
    out = []
    for profile in offered_profiles(model, device):
        memory_mib = model.profile_memory_mib(profile)
        for start in profile.starts:
            consumed = {names.COUNTER_MEMORY_SLICE.format(k): {"value": "1"}
                        for k in range(start, start + profile.memory_slices)}  # fmt: skip
            consumed[names.COUNTER_COMPUTE_SLICES] = {"value": str(profile.compute_slices)}
            out.append({
                "name": partition_name(device, profile.name, start),
                "attributes": {
                    **attributes,
                    names.ATTR_MODE: {"string": "mig"},
                    names.ATTR_MIG_PROFILE: {"string": profile.name},
                    names.ATTR_MIG_START: {"int": start},
                    names.ATTR_MIG_SLICES: {"int": profile.memory_slices},
                },
                "capacity": {
                    names.CAP_MEMORY: {"value": f"{memory_mib}Mi"},
                    names.CAP_CORES: {"value": str(model.profile_cores(profile))},
                },
                "consumesCounters": [
                    {"counterSet": counter_set_name(device), "counters": consumed},
                ],
            })  # fmt: skip
    return out
