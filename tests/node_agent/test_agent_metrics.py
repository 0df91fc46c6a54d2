"""The node agent's /metrics: kubelet handshake latency and outcomes, driver events, NVML
errors, GPUs by health and region files, served beside the probes."""

from __future__ import annotations

import asyncio

from node_agent_rig import grants, make_pod, running_rig
from prometheus_client.parser import text_string_to_metric_families
from tessera.node_agent.devices import HealthEvent

from tessera.health import answer


def values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text.decode()) for s in f.samples
    }


def value(text: bytes, name: str, **labels: str) -> float | None:
    return values(text).get((name, tuple(sorted(labels.items()))))


async def until(check, timeout: float = 20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (result := check()):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return result


async def test_handshakes_driver_events_gpus_and_regions(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        metrics = rig.agent.metrics
        gpus = len(rig.gpus)
        assert value(metrics.render(), "tessera_node_agent_gpus", health="healthy") == gpus
        pod = make_pod("placed", [("main", 1)])
        await rig.bind(pod, [grants((rig.gpus[0], 2000, 30))])
        admission = await rig.kubelet.admit_pod(pod)
        assert admission.ok, admission.error
        text = metrics.render()
        assert value(text, "tessera_node_agent_handshakes_total", rpc="Allocate",
                     result="ok") == 1
        assert value(text, "tessera_node_agent_handshake_seconds_count", rpc="Allocate") == 1
        assert value(text, "tessera_node_agent_regions", state="present") + value(
            text, "tessera_node_agent_regions", state="missing") == 1
        # A pod the scheduler never placed here: Allocate is refused, and counted so.
        stray = make_pod("stray", [("main", 1)])
        rig.cluster.add_pod(stray)
        refused = await rig.kubelet.admit_pod(stray)
        assert not refused.ok
        # (kubelet asks GetPreferredAllocation first; that is where the refusal comes)
        assert value(metrics.render(), "tessera_node_agent_handshakes_total",
                     rpc="GetPreferredAllocation", result="refused") == 1
        # A driver event (XID 79 on GPU 0): counted, and the GPU shows unhealthy.
        rig.source.events.put(HealthEvent(rig.gpus[0], "xid", 79))
        await until(lambda: value(metrics.render(), "tessera_node_agent_gpus",
                                  health="unhealthy") == 1)
        assert value(metrics.render(), "tessera_node_agent_driver_events_total") == 1


def test_probe_server_serves_metrics_when_given() -> None:
    reply = answer(b"GET /metrics HTTP/1.1", lambda: True, lambda: b"x_total 1\n")
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"x_total 1\n")
    assert b"version=0.0.4" in reply
    assert answer(b"GET /metrics HTTP/1.1", lambda: True).startswith(b"HTTP/1.1 404")
    assert answer(b"GET /metrics HTTP/1.1", lambda: True, lambda: None).startswith(
        b"HTTP/1.1 404")
