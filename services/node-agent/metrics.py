"""The node agent's own Prometheus metrics, served at /metrics on TESSERA_LISTEN (beside the
probes), on a registry per agent (no global state).

Counted as they happen: kubelet handshake calls (latency and outcome per RPC), driver events,
failures of the health watch (NVML errors), per-node configuration changes. Read at scrape time:
GPUs by health, prepared containers and the state of each one's region file (libvgpu's shared
state: present, missing, damaged), and the watchdog's own counters (polls, breaches and actions
by reason, processes ended, NVML errors and missing NVML entry points).

libvgpu's own missing CUDA/NVML entry points are not here: libvgpu logs them inside the
container, and nothing in the region it shares with the agent carries them.
"""

from __future__ import annotations

from collections import Counter as CounterType
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera.models import DeviceInfo
from tessera.region import RegionFormatError, read_region

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Snapshot(Collector):
    def __init__(self, devices: Callable[[], list[DeviceInfo]],
                 regions: Callable[[], list[Path]]) -> None:
        self.devices = devices
        self.regions = regions

    def collect(self) -> Iterator[Metric]:
        gpus = GaugeMetricFamily("tessera_node_agent_gpus", "GPUs advertised, by health",
                                 labels=["health"])
        devices = self.devices()
        healthy = sum(1 for d in devices if d.healthy)
        gpus.add_metric(["healthy"], healthy)
        gpus.add_metric(["unhealthy"], len(devices) - healthy)
        yield gpus
        regions = GaugeMetricFamily(
            "tessera_node_agent_regions", "prepared containers by region file state (missing: "
            "libvgpu has no shared state, usage is unknown)", labels=["state"])
        counts = {"present": 0, "missing": 0, "damaged": 0}
        for f in self.regions():
            counts[_region_state(f)] += 1
        for state, n in counts.items():
            regions.add_metric([state], n)
        yield regions


def _region_state(path: Path) -> str:
    if not path.is_file():
        return "missing"
    try:
        read_region(path)
    except (RegionFormatError, OSError, ValueError):
        return "damaged"  # truncated, overwritten or of another layout: usage is unknown
    return "present"


class WatchdogView(Protocol):
    """What the metrics read of the watchdog (watchdog.Watchdog): its counters."""

    stats: CounterType[str]
    probe: object


class _WatchdogSnapshot(Collector):
    """The watchdog's counters, read at scrape time (`watchdog()` None: it is not running)."""

    def __init__(self, watchdog: Callable[[], WatchdogView | None]) -> None:
        self.watchdog = watchdog

    def collect(self) -> Iterator[Metric]:
        wd = self.watchdog()
        up = GaugeMetricFamily("tessera_node_agent_watchdog_up", "1 while the watchdog polls "
                               "NVML (0: off, or NVML unusable)")  # fmt: skip
        up.add_metric([], 1 if wd is not None else 0)
        yield up
        stats: CounterType[str] = wd.stats if wd is not None else CounterType()
        errors: CounterType[str] = getattr(getattr(wd, "probe", None), "errors", None) or (
            CounterType())
        polls = CounterMetricFamily("tessera_node_agent_watchdog_polls", "watchdog polls")
        polls.add_metric([], stats["polls"])
        yield polls
        failed = CounterMetricFamily("tessera_node_agent_watchdog_failures",
                                     "watchdog polls that failed and events not published",
                                     labels=["stage"])  # fmt: skip
        failed.add_metric(["poll"], stats["poll_failed"])
        failed.add_metric(["publish"], stats["publish_failed"])
        yield failed
        actions = CounterMetricFamily(
            "tessera_node_agent_watchdog_actions", "breach episodes by reason (memory, compute, "
            "tampered) and the action taken (observed, killed)", labels=["reason", "action"])
        for key, n in sorted(stats.items()):
            if key.startswith("action:"):
                _, reason, action = key.split(":", 2)
                actions.add_metric([reason, action], n)
        yield actions
        killed = CounterMetricFamily("tessera_node_agent_watchdog_killed_processes",
                                     "processes the watchdog ended (enforcement kill)")
        killed.add_metric([], stats["killed"])
        yield killed
        nvml = CounterMetricFamily(
            "tessera_node_agent_watchdog_nvml_errors", "NVML calls of the watchdog that failed, "
            "by entry point (and return code)", labels=["entry_point", "code"])
        missing = GaugeMetricFamily(
            "tessera_node_agent_watchdog_missing_entry_points", "1 per NVML capability the "
            "driver lacks (the watchdog degrades: process_list, process_utilization, "
            "enumerate)", labels=["entry_point"])
        for key, n in sorted(errors.items()):
            name, _, code = key.partition(":")
            if name == "missing":
                missing.add_metric([code], 1)
            else:
                nvml.add_metric([name, code], n)
        yield nvml
        yield missing


class NodeAgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        r = self.registry
        self.handshake_seconds = Histogram(
            "tessera_node_agent_handshake_seconds", "kubelet handshake call latency, by RPC",
            ["rpc"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.handshakes = Counter(
            "tessera_node_agent_handshakes", "kubelet handshake calls by RPC and result "
            "(ok, refused: a HandshakeError sent back to kubelet, error: an internal failure)",
            ["rpc", "result"], registry=r,
        )  # fmt: skip
        self.driver_events = Counter(
            "tessera_node_agent_driver_events", "driver events (XIDs) seen", registry=r
        )
        self.nvml_errors = Counter(
            "tessera_node_agent_nvml_errors", "failures of the health watch (NVML errors)",
            registry=r,
        )  # fmt: skip
        self.config_changes = Counter(
            "tessera_node_agent_config_changes", "per-node device configuration changes, by "
            "result (applied; refused: invalid, or it would shrink below what is allocated)",
            ["result"], registry=r,
        )  # fmt: skip

    def watch(self, devices: Callable[[], list[DeviceInfo]],
              regions: Callable[[], list[Path]]) -> None:
        """Register the scrape-time figures (once the agent has its state and store)."""
        self.registry.register(_Snapshot(devices, regions))

    def watch_watchdog(self, watchdog: Callable[[], WatchdogView | None]) -> None:
        """Register the watchdog's counters (0 / `up` 0 while there is no watchdog)."""
        self.registry.register(_WatchdogSnapshot(watchdog))

    def handshake(self, rpc: str, seconds: float, result: str) -> None:
        self.handshake_seconds.labels(rpc=rpc).observe(seconds)
        self.handshakes.labels(rpc=rpc, result=result).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
