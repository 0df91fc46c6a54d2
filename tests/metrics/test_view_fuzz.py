"""Whatever decodes from the bus, the view renders: odd names, dangling references, zeros."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tessera.metrics.dashboard_state import dashboard_state
from tessera.metrics.view import ClusterView
from tessera.metrics.web import build_registry

from tessera.models import (
    Allocation,
    AllocationEvent,
    ContainerUsage,
    DeviceGrant,
    DeviceInfo,
    DeviceUsage,
    HostDeviceUsage,
    NodeLedger,
    NodeRegistration,
    OomEvent,
    SchedulingFailedEvent,
    UsageSample,
)
from tessera.settings import TesseraSettings

names = st.text(min_size=0, max_size=12)  # any unicode: quotes, newlines, backslashes
uuids = st.sampled_from(["GPU-a", "GPU-b", "GPU-c", 'GPU-"x"\n', ""])
small = st.integers(min_value=0, max_value=200_000)
times = st.floats(min_value=0, max_value=2e9, allow_nan=False)

devices = st.builds(DeviceInfo, uuid=uuids, index=st.integers(0, 16), type=names,
                    memory_mib=small, physical_memory_mib=small, cores=st.integers(0, 400),
                    split_count=st.integers(1, 64), healthy=st.booleans())
grants = st.builds(DeviceGrant, uuid=uuids, type=names, memory_mib=small,
                   cores=st.integers(0, 400))
allocations = st.builds(
    Allocation, pod_uid=names, namespace=names, name=names, node=names,
    containers=st.lists(st.lists(grants, max_size=3), max_size=3),
    init_count=st.integers(0, 3), init_done=st.booleans(),
    state=st.sampled_from(["reserved", "bound", "allocated", "released", "failed"]),
    container_names=st.lists(names, max_size=4),
)
usages = st.builds(
    UsageSample, node=names, at=times,
    containers=st.lists(st.builds(
        ContainerUsage, pod_uid=names, namespace=names, pod=names, container=names,
        devices=st.lists(st.builds(DeviceUsage, uuid=uuids, used_bytes=small, limit_bytes=small,
                                   sm_util=st.floats(0, 1000), sm_limit=st.integers(0, 400),
                                   last_kernel_at=st.none() | times), max_size=2)),
        max_size=3),
    devices=st.lists(st.builds(HostDeviceUsage, uuid=uuids, used_bytes=small,
                               total_bytes=small, utilization=st.floats(0, 1000)), max_size=3),
)
events = st.one_of(
    st.builds(AllocationEvent, action=st.sampled_from(["reserved", "bound", "allocated",
                                                       "released", "failed", "mismatch"]),
              node=names, pod_uid=names, namespace=names, name=names, at=times,
              containers=st.lists(st.lists(grants, max_size=2), max_size=2)),
    st.builds(SchedulingFailedEvent, namespace=names, name=names, pod_uid=names, at=times,
              node_reasons=st.dictionaries(names, names, max_size=4)),
    st.builds(OomEvent, node=names, namespace=names, pod=names, container=names, at=times),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(st.tuples(names, st.lists(devices, max_size=3)), max_size=3),
    ledgers=st.lists(st.tuples(names, st.lists(allocations, max_size=4)), max_size=3),
    samples=st.lists(usages, max_size=3),
    stream=st.lists(events, max_size=12),
)
def test_any_decodable_input_renders(nodes, ledgers, samples, stream) -> None:  # type: ignore[no-untyped-def]
    view = ClusterView()
    view.latency.usage_since = 0.0
    for name, devs in nodes:
        view.put_node(name, NodeRegistration(node=name, devices=devs))
    for name, allocs in ledgers:
        view.put_ledger(name, NodeLedger(node=name, allocations={a.pod_uid: a for a in allocs}))
    for seq, event in enumerate(stream, start=1):
        view.apply_event(event, seq)
    for sample in samples:
        view.put_usage(sample, received_at=1e9)
    now = 1e9 + 1
    text = generate_latest(build_registry(view, TesseraSettings(), lambda: now)).decode()
    families = {f.name for f in text_string_to_metric_families(text)}
    assert "hami_gpu_memory_allocated_bytes" in families
    json.dumps(dashboard_state(view, now))
    json.dumps(dashboard_state(view.snapshot(), now))
