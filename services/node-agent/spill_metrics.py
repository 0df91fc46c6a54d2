"""Host memory promised to spills on this node (docs/elastic.md, "Spilling to host memory"), on
the node agent's /metrics at scrape time, so an operator sees it beside the node's memory:

- `tessera_node_agent_spill_bytes{kind="promised"}`: the spill bounds sealed into the limits of
  the node's prepared containers (`tessera.io/gpumem-spill`, limits 1.3), summed — host memory
  libvgpu may take for spills on this node. Nothing reserves it: the scheduler does not place
  by it and kubelet does not know it.
- `tessera_node_agent_spill_bytes{kind="spilled"}`: what those containers hold spilled now,
  summed: per container the larger of what the lease service leased it for spill (`host-spill`,
  the account a tenant cannot write) and its region's `spilled_bytes` (without leases, the only
  figure; a tenant that zeroes it hides nothing the lease service holds).
- `tessera_node_agent_spill_containers`: containers that may spill.
- `tessera_node_agent_host_memory_bytes{kind="total"|"available"}`: the node's MemTotal and
  MemAvailable (/proc/meminfo), to compare the promise with.

A per-container view is the metrics service's `tessera_container_spill_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera.region import RegionFormatError, read_limits, read_region


class SpillingContainer(Protocol):
    """What is read of a prepared container (containers.ContainerDir)."""

    @property
    def limits_dir(self) -> Path: ...

    @property
    def region_file(self) -> Path: ...

    @property
    def key(self) -> str: ...


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """MemTotal and MemAvailable in bytes ({} where the file is unreadable)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return {}
    found: dict[str, int] = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            found[name] = int(fields[0]) * 1024  # kB
    return found


def spill_totals(containers: list[SpillingContainer],
                 leased: Callable[[str], int] | None = None) -> tuple[int, int, int]:  # fmt: skip
    """(promised, spilled, containers that may spill) over `containers`; a container whose
    limits or region cannot be read counts what could be read (its promise without a region:
    nothing spilled yet). `leased`: a container's spill leased from the lease service, by its
    key (0: none)."""
    promised = spilled = count = 0
    for c in containers:
        try:
            limits = read_limits(c.limits_dir)
        except (OSError, ValueError):
            continue  # damaged or half-written: the watchdog and the region metrics say so
        if limits is None or not limits.spill_bytes:
            continue
        promised += limits.spill_bytes
        count += 1
        try:
            usage = read_region(c.region_file)
        except (RegionFormatError, OSError, ValueError):
            usage = None
        held = leased(c.key) if leased is not None else 0
        spilled += max(held, usage.spilled_bytes if usage is not None else 0)
    return promised, spilled, count


class SpillCollector(Collector):
    def __init__(self, containers: Callable[[], list[SpillingContainer]],
                 meminfo: Path = Path("/proc/meminfo"),
                 leased: Callable[[str], int] | None = None) -> None:  # fmt: skip
        self.containers = containers
        self.meminfo = meminfo
        self.leased = leased

    def collect(self) -> Iterator[Metric]:
        promised, spilled, count = spill_totals(self.containers(), self.leased)
        spill = GaugeMetricFamily(
            "tessera_node_agent_spill_bytes", "host memory of this node for GPU allocations "
            "spilled to it (tessera.io/gpumem-spill): promised (the containers' spill bounds, "
            "summed; nothing reserves it) and spilled (held now)", labels=["kind"])
        spill.add_metric(["promised"], promised)
        spill.add_metric(["spilled"], spilled)
        yield spill
        containers = GaugeMetricFamily("tessera_node_agent_spill_containers",
                                       "prepared containers that may spill to host memory")
        containers.add_metric([], count)
        yield containers
        memory = host_memory(self.meminfo)
        if memory:
            host = GaugeMetricFamily("tessera_node_agent_host_memory_bytes", "the node's "
                                     "memory (/proc/meminfo): total and available",
                                     labels=["kind"])  # fmt: skip
            for kind, key in (("total", "MemTotal"), ("available", "MemAvailable")):
                if key in memory:
                    host.add_metric([kind], memory[key])
            yield host
