"""Per-node device configuration as a HAMi operator uses it: the ConfigMap tessera-node-config
(HAMi's `nodeconfig` fields) and `tessera node-config set` on the bus, against a real NATS and
a running node agent with kubelet's stand-in on real unix-socket gRPC.

A node's entry wins over the defaults, which win over the chart's settings; a live change
re-registers the node (KV registration, HAMi's node annotation, kubelet's device list); a
change that would offer less than is allocated is refused with a message (node event, Warning
event on the Node, the status `get` shows) and nothing changes; bad config is rejected with a
message naming the field; a restarted agent keeps what it applied."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from node_agent_rig import grants, make_pod, running_rig
from tessera.node_agent.devices import PhysicalGpu, advertise
from tessera.node_agent.node_config_rules import (
    NodeConfigError,
    layer,
    node_problem,
    parse_config_map,
    parse_entry,
    resolve,
)

from tessera import bus, hami
from tessera.codec import decode, encode
from tessera.events import decode_event
from tessera.models import (
    NODE_CONFIG_MAP,
    AllocationState,
    NodeConfigSetRequest,
    NodeConfigStatus,
    NodeEvent,
    NodeLedger,
    NodeRegistration,
)
from tessera.region import SEALED_LIMITS_DIR, read_limits
from tessera.settings import TesseraSettings
from tessera.validation import Bounds, registration_problem

NS = "default"


def config_map(defaults: dict[str, Any] | None = None, nodes: list[dict[str, Any]] = ()) -> dict:
    body = {"defaults": defaults or {}, "nodeconfig": list(nodes)}
    return {"metadata": {"name": NODE_CONFIG_MAP, "namespace": NS},
            "data": {"config.json": json.dumps(body)}}


async def until(check, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await check()
        if result:
            return result
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def registration(rig) -> NodeRegistration | None:
    current = await bus.read(rig.buckets.nodes, rig.node, NodeRegistration)
    return current.value if current else None


def replicas(rig) -> list[str]:
    plugin = rig.kubelet.plugins.get(rig.settings.resource_name)
    return sorted(plugin.devices) if plugin else []


async def request(rig, subject: str, body: bytes) -> NodeConfigStatus:
    msg = await rig.nc.request(subject, body, timeout=10)
    return decode(msg.data, NodeConfigStatus)


async def set_local(rig, **config: Any) -> NodeConfigStatus:
    reset = config.pop("reset", False)
    body = encode(NodeConfigSetRequest(config=config, reset=reset))
    return await request(rig, bus.node_config_set_subject(rig.node), body)


async def node_events(rig, action: str) -> list[NodeEvent]:
    js = rig.nc.jetstream()
    sub = await js.subscribe(bus.node_event_subject(rig.node, action), ordered_consumer=True)
    found = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:
                return found
            found.append(decode_event(msg.data))
    finally:
        await sub.unsubscribe()


# --- the format: layering and validation (pure) -------------------------------------------------


def test_node_entry_wins_then_defaults_then_settings() -> None:
    settings = TesseraSettings(device_split_count=10, device_memory_scaling=1.0)
    parsed = parse_config_map(config_map(
        {"devicesplitcount": 6, "devicememoryscaling": 1.5},
        [{"name": "gpu-a", "devicesplitcount": 2, "filterdevices": {"index": [1]}},
         {"name": "gpu-b", "operatingmode": "mps"}],
    ))  # fmt: skip
    a = resolve(layer(settings, parsed, "gpu-a", None).merged, settings)
    assert (a.split_count, a.memory_scaling, a.core_scaling) == (2, 1.5, 1.0)
    assert a.exclude_indices == {1} and a.mode is None
    other = resolve(layer(settings, parsed, "gpu-z", None).merged, settings)
    assert (other.split_count, other.memory_scaling) == (6, 1.5)  # no entry: the defaults
    bare = resolve(layer(settings, None, "gpu-a", None).merged, settings)
    assert (bare.split_count, bare.memory_scaling) == (10, 1.0)  # no ConfigMap: the chart's
    local = parse_entry({"devicesplitcount": 3})
    over = resolve(layer(settings, parsed, "gpu-a", local).merged, settings)
    assert over.split_count == 3 and over.exclude_indices == {1}  # the bus entry on top


def test_mig_strategy_is_a_node_setting_layered_over_the_chart() -> None:
    """HAMi's `migstrategy`: the chart's value (TESSERA_MIG_STRATEGY) unless the node says."""
    settings = TesseraSettings(mig_strategy="single")
    parsed = parse_config_map(config_map(nodes=[{"name": "gpu-a", "migstrategy": "mixed"}]))
    assert resolve(layer(settings, parsed, "gpu-a", None).merged, settings).mig_strategy == "mixed"
    assert resolve(layer(settings, parsed, "gpu-b", None).merged, settings).mig_strategy == "single"
    local = parse_entry({"migstrategy": "dynamic"})
    assert resolve(layer(settings, parsed, "gpu-a", local).merged,
                   settings).mig_strategy == "dynamic"


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"devicesplitcount": -2}, "devicesplitcount"),
        ({"devicesplitcount": 0}, "greater than or equal to 1"),
        ({"devicesplitcount": 5000}, "less than or equal to 1024"),
        ({"devicememoryscaling": 0}, "devicememoryscaling"),
        ({"devicecorescaling": -1}, "devicecorescaling"),
        ({"devicememoryscaling": 1000}, "less than or equal to 100"),
        ({"operatingmode": "timeslice"}, "operatingmode"),
        ({"devicesplitcount": "ten"}, "devicesplitcount"),
        ({"migstrategy": "sometimes"}, "migstrategy"),
        ({"migStrategy": "mixed"}, "migStrategy: unknown key"),
        ({"filterdevices": {"index": [-1]}}, "a GPU index is 0-63"),
        ({"filterdevices": {"uuid": ["GPU-1,GPU-2"]}}, "not a GPU UUID"),
        ({"filterdevices": {"names": ["x"]}}, "filterdevices.names: unknown key"),
    ],
)
def test_bad_entries_are_rejected_with_the_field(entry: dict[str, Any], says: str) -> None:
    with pytest.raises(NodeConfigError, match="node config") as bad:
        parse_entry(entry)
    assert says in str(bad.value)
    with pytest.raises(NodeConfigError, match=NODE_CONFIG_MAP) as in_map:
        parse_config_map(config_map(nodes=[{"name": "gpu-a", **entry}]))
    assert says in str(in_map.value)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({}, "no key 'config.json'"),
        ({"config.json": "{not json"}, "config.json"),
        ({"config.json": json.dumps({"nodeconfig": [{"devicesplitcount": 2}]})}, "name"),
        ({"config.json": json.dumps({"nodeconfig": [{"name": "a"}, {"name": "a"}]})},
         "more than one entry"),
        ({"config.json": json.dumps({"nodes": []})}, "nodes: unknown key"),
    ],
)
def test_bad_config_maps_are_rejected_with_a_message(data: dict[str, str], says: str) -> None:
    with pytest.raises(NodeConfigError) as bad:
        parse_config_map({"metadata": {"name": NODE_CONFIG_MAP}, "data": data})
    assert says in str(bad.value)


# --- a running agent: the ConfigMap ------------------------------------------------------------


async def test_configmap_entry_applies_at_start_and_live(short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0, gpu1 = rig.gpus
        assert len(replicas(rig)) == 2 * 4  # the chart's split count (rig: 4)
        # Another node's entry does nothing here; the defaults do.
        rig.cluster.put_config_map(config_map(
            {"devicememoryscaling": 1.0, "devicesplitcount": 5},
            [{"name": "some-other-node", "devicesplitcount": 1}]))  # fmt: skip

        async def split(n: int):
            reg = await registration(rig)
            return reg if reg and {d.split_count for d in reg.devices} == {n} else None

        await until(lambda: split(5))
        await rig.kubelet.wait_for(lambda: len(replicas(rig)) == 2 * 5)
        # This node's entry wins: 3 slots, GPU index 1 left out, live.
        rig.cluster.put_config_map(config_map(
            {"devicesplitcount": 5},
            [{"name": rig.node, "devicesplitcount": 3, "filterdevices": {"index": [1]}}]))
        reg = await until(lambda: split(3))
        assert [d.uuid for d in reg.devices] == [gpu0]
        await rig.kubelet.wait_for(lambda: replicas(rig) == [f"{gpu0}-{i}" for i in range(3)])
        # HAMi's node annotation carries the new capacity for HAMi's tools and scheduler.
        annotation = json.loads(rig.cluster.node_annotations[rig.node][hami.ANN_NODE_REGISTER])
        assert [(d["id"], d["count"]) for d in annotation] == [(gpu0, 3)]
        # Said on the bus and as a Kubernetes event on the Node (both recorded after the new
        # registration is written, in the background: waited for, not assumed).
        async def applied_event():
            applied = [e for e in rig.cluster.events if e["reason"] == "NodeConfigApplied"]
            return applied[-1] if applied and "split 3" in applied[-1]["message"] else None

        assert (await until(applied_event, timeout=30))["involved"]["kind"] == "Node"

        async def configured_on_the_bus():
            return any("split 3" in e.reason for e in await node_events(rig, "configured"))

        await until(configured_on_the_bus, timeout=30)
        # Deleting the ConfigMap falls back to the chart's settings.
        rig.cluster.delete_config_map(NS, NODE_CONFIG_MAP)
        reg = await until(lambda: split(4))
        assert len(reg.devices) == 2 and gpu1 in {d.uuid for d in reg.devices}


async def test_shrink_below_allocated_is_refused_with_a_message(short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0, _gpu1 = rig.gpus
        # Two pods on GPU 0: 12000 MiB and 60 % compute in all, two slots.
        for name, mem, cores in (("big", 10000, 30), ("small", 2000, 30)):
            pod = make_pod(name, [("main", 1)])
            await rig.bind(pod, [grants((gpu0, mem, cores))])
            admitted = await rig.kubelet.admit_pod(pod)
            assert admitted.ok, admitted.error
        before = await registration(rig)
        cases = [
            ({"devicememoryscaling": 0.5}, "12000 MiB allocated, the new configuration offers "
                                           "8000 MiB"),
            ({"devicecorescaling": 0.5}, "60% compute allocated"),
            ({"devicesplitcount": 1}, "2 containers hold slots, the new split count is 1"),
            ({"filterdevices": {"uuid": [gpu0]}}, "holds 2 pod(s) and would no longer be offered"),
        ]
        for config, says in cases:
            status = await set_local(rig, **config)
            assert not status.ok and says in status.reason, status.reason
            assert "Nothing changed" in status.reason
            # The same through the ConfigMap: refused, with a Warning on the Node.
            rig.cluster.put_config_map(config_map(nodes=[{"name": rig.node, **config}]))

            async def refused_event(says=says):
                return [e for e in rig.cluster.events if e["reason"] == "NodeConfigRefused"
                        and e["message"].startswith(NODE_CONFIG_MAP) and says in e["message"]]

            warning = (await until(refused_event))[-1]
            assert warning["type"] == "Warning" and warning["involved"]["name"] == rig.node
            shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
            assert says in shown.refused and shown.refused.startswith(NODE_CONFIG_MAP)
            rig.cluster.delete_config_map(NS, NODE_CONFIG_MAP)

            async def cleared():  # the ConfigMap gone: nothing pending, nothing refused
                shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
                return not shown.refused

            await until(cleared)
        # Nothing moved: same devices, same capacity, kubelet still sees every replica.
        after = await registration(rig)
        assert [d.model_dump(exclude={"healthy"}) for d in after.devices] == [
            d.model_dump(exclude={"healthy"}) for d in before.devices]
        assert len(replicas(rig)) == 2 * 4
        assert await node_events(rig, "config_refused")
        # Growing is always fine, and so is a shrink that still holds the pods.
        status = await set_local(rig, devicesplitcount=2, devicememoryscaling=0.75)
        assert status.ok, status.reason
        assert status.effective["devicesplitcount"] == 2 and status.refused == ""
        reg = await registration(rig)
        assert {(d.split_count, d.memory_mib) for d in reg.devices} == {(2, 12000)}


async def test_bad_config_is_refused_and_the_node_keeps_its_own(short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets) as rig:
        for hostile in ({"devicesplitcount": -3}, {"devicememoryscaling": 2.5},
                        {"filterdevices": {"uuid": ["GPU-not-here"]}}, {"colour": "red"}):
            status = await set_local(rig, **hostile)
            assert not status.ok, hostile
        assert "above the cluster's ceiling 1" in (
            await set_local(rig, devicememoryscaling=2.5)).reason
        assert "this node has no GPU GPU-not-here" in (
            await set_local(rig, filterdevices={"uuid": ["GPU-not-here"]})).reason
        assert "colour: unknown key" in (await set_local(rig, colour="red")).reason
        garbage = await request(rig, bus.node_config_set_subject(rig.node), b"\xff\x00junk")
        assert not garbage.ok and "bad NodeConfigSetRequest" in garbage.reason
        rig.cluster.put_config_map({"metadata": {"name": NODE_CONFIG_MAP, "namespace": NS},
                                    "data": {"config.json": "[1, 2"}})

        async def refused():
            shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
            return shown if "ConfigMap tessera-node-config" in shown.refused else None

        shown = await until(refused)
        assert shown.effective["devicesplitcount"] == 4  # still the chart's
        reg = await registration(rig)
        assert {d.split_count for d in reg.devices} == {4} and len(reg.devices) == 2


async def test_restarted_agent_keeps_its_config(short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets, node_heartbeat_s=0.2) as rig:
        status = await set_local(rig, devicesplitcount=7, filterdevices={"index": [0]})
        assert status.ok, status.reason
        await rig.stop_agent()
        await rig.buckets.nodes.delete(rig.node)  # whatever it registered before is gone
        registrations = rig.kubelet.registration_count(rig.settings.resource_name)
        await rig.start_agent()
        await rig.kubelet.wait_registered(rig.settings.resource_name, after=registrations)
        first = await until(lambda: registration(rig))
        assert [(d.index, d.split_count) for d in first.devices] == [(1, 7)]
        gpu1 = rig.gpus[1]
        await rig.kubelet.wait_for(lambda: replicas(rig) == [f"{gpu1}-{i}" for i in range(7)])
        shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
        assert shown.local == {"devicesplitcount": 7, "filterdevices": {"uuid": [], "index": [0]}}
        # A ConfigMap that turned refusable while the agent was down does not shrink it either.
        pod = make_pod("held", [("main", 1)])
        await rig.bind(pod, [grants((gpu1, 9000, 10))])
        assert (await rig.kubelet.admit_pod(pod)).ok
        await rig.stop_agent()
        rig.cluster.put_config_map(config_map({"devicememoryscaling": 0.25}))
        registrations = rig.kubelet.registration_count(rig.settings.resource_name)
        await rig.start_agent()
        await rig.kubelet.wait_registered(rig.settings.resource_name, after=registrations)
        reg = await until(lambda: registration(rig))
        assert [(d.split_count, d.memory_mib) for d in reg.devices] == [(7, 16000)]
        shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
        assert "9000 MiB allocated" in shown.refused
        # A ConfigMap the pods fit in clears the refusal; the local entry still wins over it
        # until it is reset.
        rig.cluster.put_config_map(config_map({"devicesplitcount": 6}))

        async def cleared():
            shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
            return shown if not shown.refused else None

        assert (await until(cleared)).effective["devicesplitcount"] == 7
        status = await set_local(rig, reset=True)
        assert status.ok and status.effective["devicesplitcount"] == 6 and not status.local


async def test_per_node_memory_overcommit_reaches_the_container(short_dir, nc, buckets) -> None:
    """A node set to memory scaling 1.5 (under the cluster's ceiling of 2) advertises 1.5 × its
    memory, and its containers get oversubscription: CUDA_OVERSUBSCRIBE and the sealed flag."""
    async with running_rig(short_dir, nc, buckets, max_device_memory_scaling=2.0) as rig:
        plain = make_pod("plain", [("main", 1)])
        await rig.bind(plain, [grants((rig.gpus[1], 1000, 10))])
        admitted = await rig.kubelet.admit_pod(plain)
        assert "CUDA_OVERSUBSCRIBE" not in admitted.containers[0].envs
        status = await set_local(rig, devicememoryscaling=1.5)
        assert status.ok, status.reason
        reg = await registration(rig)
        assert {(d.memory_mib, d.physical_memory_mib) for d in reg.devices} == {(24000, 16000)}
        pod = make_pod("over", [("main", 1)])
        await rig.bind(pod, [grants((rig.gpus[0], 20000, 50))])
        admitted = await rig.kubelet.admit_pod(pod)
        assert admitted.ok, admitted.error
        container = admitted.containers[0]
        assert container.envs["CUDA_OVERSUBSCRIBE"] == "true"
        sealed = read_limits(container.mount(SEALED_LIMITS_DIR).host_path)
        assert sealed.oversubscribe and sealed.devices[0].mem_limit_bytes == 20000 << 20


def test_the_clusters_ceiling_bounds_what_a_node_may_be_configured_with() -> None:
    """What the agent refuses is what the scheduler would refuse: one ceiling for both."""
    gpus = [PhysicalGpu("GPU-a", 0, "NVIDIA A10", 24576)]
    parsed = parse_config_map(config_map(nodes=[{"name": "n", "devicememoryscaling": 1.5}]))
    for settings, allowed in ((TesseraSettings(), False),
                              (TesseraSettings(max_device_memory_scaling=2.0), True)):
        layered = layer(settings, parsed, "n", None)
        config = resolve(layered.merged, settings)
        problem = node_problem(layered, config, gpus, Bounds.of(settings))
        registered = NodeRegistration(node="n", devices=advertise(gpus, settings, config=config))
        scheduler_says = registration_problem("n", registered, Bounds.of(settings))
        assert (problem is None) is allowed and (scheduler_says is None) is allowed
        if not allowed:
            assert "TESSERA_MAX_DEVICE_MEMORY_SCALING" in problem


async def test_a_refused_configmap_is_applied_once_the_pods_leave(short_dir, nc, buckets) -> None:
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu0 = rig.gpus[0]
        pod = make_pod("blocker", [("main", 1)])
        allocation = await rig.bind(pod, [grants((gpu0, 10000, 30))])
        assert (await rig.kubelet.admit_pod(pod)).ok
        rig.cluster.put_config_map(config_map({"devicememoryscaling": 0.5}))

        async def pending():
            shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
            return shown if shown.pending and "10000 MiB allocated" in shown.refused else None

        await until(pending)
        assert {d.memory_mib for d in (await registration(rig)).devices} == {16000}

        def release(ledger):
            ledger = ledger.model_copy(deep=True)
            ledger.allocations[allocation.pod_uid].state = AllocationState.RELEASED
            return ledger

        await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, release)

        async def halved():
            reg = await registration(rig)
            return reg if reg and {d.memory_mib for d in reg.devices} == {8000} else None

        await until(halved)

        # The registration is re-put first; the status and the event follow in the same step.
        async def applied():
            shown = await request(rig, bus.node_config_get_subject(rig.node), b"{}")
            return shown if not shown.pending else None

        shown = await until(applied)
        assert not shown.refused
        assert any(e["reason"] == "NodeConfigApplied" for e in rig.cluster.events)
