"""The node agent's own Prometheus metrics, served at /metrics on TESSERA_LISTEN (beside the
probes), on a registry per agent (no global state).

Counted as they happen: kubelet handshake calls (latency and outcome per RPC), driver events,
failures of the health watch (NVML errors). Read at scrape time: GPUs by health, prepared
containers and whether each one's region file exists (libvgpu's shared state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera.models import DeviceInfo

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
        files = self.regions()
        present = sum(1 for f in files if f.is_file())
        regions.add_metric(["present"], present)
        regions.add_metric(["missing"], len(files) - present)
        yield regions


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

    def watch(self, devices: Callable[[], list[DeviceInfo]],
              regions: Callable[[], list[Path]]) -> None:
        """Register the scrape-time figures (once the agent has its state and store)."""
        self.registry.register(_Snapshot(devices, regions))

    def handshake(self, rpc: str, seconds: float, result: str) -> None:
        self.handshake_seconds.labels(rpc=rpc).observe(seconds)
        self.handshakes.labels(rpc=rpc, result=result).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
