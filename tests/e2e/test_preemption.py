"""GPU-aware priority preemption, end to end: PriorityClasses and PodDisruptionBudgets in
kube-sim, pods evicted through the Eviction API with their grace periods, the scheduler placing
the high-priority pod only once the victims' GPU memory is reported free by the node agent.

One stack; each test has its own node (one 24 GiB GPU) and namespace.
"""

from __future__ import annotations

import asyncio
import calendar
import ctypes
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tessera.node_agent.containers import REGION_CONTAINER_DIR, REGION_CONTAINER_PATH
from tessera.scheduler.cards import ledger_cards, over_capacity
from typer.testing import CliRunner

from tessera import bus
from tessera.bus import connect
from tessera.codec import decode
from tessera.models import NodeLedger, NodeRegistration, PreemptionEvent
from tessera.region import MAX_PROCS, REGION_MAGIC, VERSION_MAJOR, VERSION_MINOR, RegionC
from tessera_cli.app import build_app
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, grants, start_stack, stored_events

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.serial]

GPU_MIB = 24576
NODES = [SimNode(name=f"pre-{x}", gpus=1, gpu_memory_mib=GPU_MIB, gpu_model="NVIDIA A10")
         for x in "abcde"]  # fmt: skip
CLASSES = {"low": 10, "mid": 50, "team": 500, "urgent": 1000}
IGNORE_SIGTERM = {"kube-sim.tessera.io/on-sigterm": "ignore"}


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    env = {"TESSERA_PREEMPTION_MARGIN_S": "20", "TESSERA_PREEMPTION_RETRY_S": "1"}
    for running in start_stack(NODES, env=env):
        http = running.kube.http
        for name, value in CLASSES.items():
            reply = http.post("/apis/scheduling.k8s.io/v1/priorityclasses", json={
                "metadata": {"name": name}, "value": value})  # fmt: skip
            assert reply.status_code == 201, reply.text
        reply = http.post("/apis/scheduling.k8s.io/v1/priorityclasses", json={
            "metadata": {"name": "polite"}, "value": 1000, "preemptionPolicy": "Never"})
        assert reply.status_code == 201, reply.text
        yield running


@pytest.fixture
def ns(sim: RunningStack, namespace: str) -> Iterator[str]:
    yield namespace
    sim.kube.delete_namespace_pods(namespace)


def pod(name: str, node: str, mem: int, priority_class: str, *, grace: int = 2,
        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
        ) -> dict[str, Any]:  # fmt: skip
    spec = gpu_pod(name, mem=mem, cores=10, node=node, annotations=annotations)
    spec["spec"]["priorityClassName"] = priority_class
    spec["spec"]["terminationGracePeriodSeconds"] = grace
    spec["metadata"]["labels"] = labels or {}
    return spec


def create(sim: RunningStack, ns: str, *pods: dict[str, Any]) -> None:
    for p in pods:
        reply = sim.kube.create_pod(p, ns)
        assert reply.status_code == 201, reply.text


def running(sim: RunningStack, ns: str, *names: str) -> dict[str, dict[str, Any]]:
    return {n: sim.kube.wait_running(ns, n, timeout_s=60) for n in names}


def exists(sim: RunningStack, ns: str, name: str) -> bool:
    return sim.kube.http.get(f"/api/v1/namespaces/{ns}/pods/{name}").status_code == 200


def gone(sim: RunningStack, ns: str, name: str, timeout_s: float = 60) -> None:
    sim.kube.wait_for(f"{ns}/{name} deleted", lambda: not exists(sim, ns, name), timeout_s)


def still_pending(sim: RunningStack, ns: str, name: str, for_s: float) -> None:
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        current = sim.kube.pod(ns, name)
        assert not current["spec"].get("nodeName"), f"{name} was placed"
        time.sleep(0.3)


def describe(sim: RunningStack, ns: str, name: str) -> str:
    result = CliRunner().invoke(build_app(), ["describe", "pod", name, "-n", ns,
                                              "--state-dir", str(sim.stack.state_dir)])
    assert result.exit_code == 0, result.output
    return result.output


async def _ledger(sim: RunningStack, node: str) -> tuple[NodeLedger | None, NodeRegistration]:
    nc = await connect(sim.stack.nats_settings(), name="e2e-preemption", initial_attempts=5)
    try:
        js = nc.jetstream()
        ledger = await bus.read(await js.key_value(bus.LEDGER_BUCKET), node, NodeLedger)
        reg = await bus.read(await js.key_value(bus.NODES_BUCKET), node, NodeRegistration)
        assert reg is not None
        return (ledger.value if ledger else None), reg.value
    finally:
        await nc.close()


def ledger_problems(sim: RunningStack, node: str) -> tuple[NodeLedger | None, list[str]]:
    ledger, reg = asyncio.run(_ledger(sim, node))
    return ledger, over_capacity(ledger_cards(reg, ledger, time.time()))


async def _events(sim: RunningStack, namespace: str) -> list[PreemptionEvent]:
    nc = await connect(sim.stack.nats_settings(), name="e2e-preemption-ev", initial_attempts=5)
    try:
        js = nc.jetstream()
        subject = bus.preemption_event_subject(namespace, "*")
        return [decode(data, PreemptionEvent) for data in await stored_events(js, subject)]
    finally:
        await nc.close()


def region_of(sim: RunningStack, ns: str, name: str) -> Path:
    current = sim.kube.pod(ns, name)
    for entry in sim.kube.containers(current["spec"]["nodeName"]):
        if entry["uid"] == current["metadata"]["uid"]:
            mounts = entry["containers"][0]["mounts"]
            host = next(m["host_path"] for m in mounts
                        if m["container_path"] == REGION_CONTAINER_DIR)  # fmt: skip
            return Path(host) / Path(REGION_CONTAINER_PATH).name
    raise AssertionError(f"{name} not admitted")


def hold_gpu_memory(region: Path, uuid: str, used_bytes: int) -> None:
    """What libvgpu in a live process writes: this container holds `used_bytes` on the GPU (the
    node agent's simulated NVML sums the containers' regions)."""
    r = RegionC()
    r.major, r.minor, r.size, r.num_devices, r.max_procs = (
        VERSION_MAJOR, VERSION_MINOR, ctypes.sizeof(RegionC), 1, MAX_PROCS)
    r.dev[0].uuid = uuid.encode()
    r.dev[0].used_bytes = r.dev[0].peak_bytes = used_bytes
    r.procs[0].pid = 4242
    r.procs[0].used[0] = used_bytes
    r.magic = REGION_MAGIC
    region.write_bytes(bytes(r))


# --- the tests -------------------------------------------------------------------------------


def test_high_priority_pod_evicts_the_minimal_lower_priority_set(
    sim: RunningStack, ns: str
) -> None:
    node = "pre-a"
    create(sim, ns,
           pod("low-1", node, 8000, "low", annotations=IGNORE_SIGTERM, grace=4),
           pod("low-2", node, 8000, "low"), pod("mid", node, 8000, "mid"))  # fmt: skip
    before = running(sim, ns, "low-1", "low-2", "mid")
    assert before["low-1"]["spec"]["priority"] == 10  # resolved from the PriorityClass
    # 10,000 MiB needs two 8,000 MiB pods gone; the cheapest pair is both priority-10 pods.
    create(sim, ns, pod("urgent", node, 10000, "urgent"))

    def nominated() -> bool:
        return sim.kube.pod(ns, "urgent")["status"].get("nominatedNodeName") == node

    sim.kube.wait_for("urgent nominated", nominated, 30)
    # low-1 ignores SIGTERM for its 4 s grace period: meanwhile the pod says what it waits for.
    text = sim.kube.wait_for(
        "describe shows the wait",
        lambda: (out := describe(sim, ns, "urgent")) and "waiting for preemption of" in out and out,
        20,
    )
    line = next(x for x in text.splitlines() if "waiting for preemption of" in x)
    # low-2 stopped at SIGTERM (and its memory came back): only low-1 is still awaited.
    assert f"{ns}/low-1" in line and f"{ns}/mid" not in line
    _ledger_now, problems = ledger_problems(sim, node)
    assert problems == []  # the nominee's reservation replaces the victims'; never both
    placed = sim.kube.wait_running(ns, "urgent", timeout_s=60)
    assert placed["spec"]["nodeName"] == node and grants(placed)[0][0].memory_mib == 10000
    assert not exists(sim, ns, "low-1") and not exists(sim, ns, "low-2")
    assert sim.kube.pod(ns, "mid")["metadata"]["uid"] == before["mid"]["metadata"]["uid"]
    events = asyncio.run(_events(sim, ns))
    started = [e for e in events if e.action == "started" and e.name == "urgent"]
    assert started and sorted(started[0].victims) == [f"{ns}/low-1", f"{ns}/low-2"]
    sim.kube.wait_for("preemption.done", lambda: any(
        e.action == "done" and e.outcome == "placed" for e in asyncio.run(_events(sim, ns))), 20)
    assert ledger_problems(sim, node)[1] == []
    # Each victim has kube-scheduler's `Preempted` event (what `kubectl get events` shows).
    urgent_uid = placed["metadata"]["uid"]

    def preempted() -> set[str]:
        items = sim.kube.http.get(f"/api/v1/namespaces/{ns}/events").json()["items"]
        return {e["involvedObject"]["name"] for e in items if e.get("reason") == "Preempted"
                and f"Preempted by pod {urgent_uid} on node {node}" in e.get("message", "")}

    assert sim.kube.wait_for("Preempted events", lambda: preempted() >= {"low-1", "low-2"}, 20)


def test_equal_or_higher_priority_never_evicted_and_never_policy_pends(
    sim: RunningStack, ns: str
) -> None:
    node = "pre-b"
    # The Priority admission step: an unknown class, or a spec.priority that contradicts the
    # class, is refused as kube-apiserver does.
    unknown = sim.kube.create_pod(pod("ghost", node, 1000, "no-such-class"), ns)
    assert unknown.status_code == 403 and "no PriorityClass" in unknown.text
    forged = pod("forged", node, 1000, "team")
    forged["spec"]["priority"] = 2_000_000_000
    refused = sim.kube.create_pod(forged, ns)
    assert refused.status_code == 403 and "must not be provided" in refused.text
    create(sim, ns, pod("peer", node, 12000, "team"), pod("boss", node, 12000, "urgent"))
    before = running(sim, ns, "peer", "boss")
    # Same priority as `peer`, lower than `boss`: nobody may go.
    create(sim, ns, pod("same", node, 10000, "team"))
    # Higher than `peer` but preemptionPolicy Never (from its PriorityClass): it waits.
    create(sim, ns, pod("polite", node, 10000, "polite"))
    assert sim.kube.pod(ns, "polite")["spec"]["preemptionPolicy"] == "Never"
    still_pending(sim, ns, "same", 6)
    still_pending(sim, ns, "polite", 1)
    for name in ("peer", "boss"):
        now = sim.kube.pod(ns, name)
        assert now["metadata"]["uid"] == before[name]["metadata"]["uid"]
        assert not now["metadata"].get("deletionTimestamp")
    assert not sim.kube.pod(ns, "polite")["status"].get("nominatedNodeName")
    assert not [e for e in asyncio.run(_events(sim, ns)) if e.action == "started"]


def test_a_pod_disruption_budget_is_honoured(sim: RunningStack, ns: str) -> None:
    node = "pre-c"
    guarded = {"app": "guarded"}
    create(sim, ns, pod("guarded-1", node, 8000, "low", labels=guarded),
           pod("free-1", node, 8000, "mid"), pod("guarded-2", node, 8000, "low", labels=guarded))
    running(sim, ns, "guarded-1", "free-1", "guarded-2")
    reply = sim.kube.http.post(f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", json={
        "metadata": {"name": "keep-guarded"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": guarded}},
    })  # fmt: skip
    assert reply.status_code == 201, reply.text
    assert reply.json()["status"]["disruptionsAllowed"] == 0
    # The Eviction API itself refuses (429) what the budget forbids.
    refused = sim.kube.http.post(f"/api/v1/namespaces/{ns}/pods/guarded-1/eviction", json={
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "guarded-1"}})
    assert refused.status_code == 429, refused.text
    # A priority-10 victim would be cheaper, but the budget protects both: free-1 (50) goes.
    create(sim, ns, pod("urgent", node, 8000, "urgent"))
    sim.kube.wait_running(ns, "urgent", timeout_s=60)
    assert not exists(sim, ns, "free-1")
    assert exists(sim, ns, "guarded-1") and exists(sim, ns, "guarded-2")


def test_memory_held_past_sigterm_delays_placement_and_never_overallocates(
    sim: RunningStack, ns: str
) -> None:
    node = "pre-d"
    create(sim, ns, pod("stubborn", node, 20000, "low", annotations=IGNORE_SIGTERM, grace=3))
    victim = running(sim, ns, "stubborn")["stubborn"]
    uuid = grants(victim)[0][0].uuid
    region = region_of(sim, ns, "stubborn")
    hold_gpu_memory(region, uuid, 20000 << 20)  # its process holds its memory
    create(sim, ns, pod("urgent", node, 20000, "urgent"))
    sim.kube.wait_for("stubborn terminating", lambda: sim.kube.pod(ns, "stubborn")["metadata"]
                      .get("deletionTimestamp"), 30)  # fmt: skip
    gone(sim, ns, "stubborn")  # SIGKILL at the end of its grace period: the object goes
    # NVML (the agent's view) still shows the memory held: the pod must not be placed.
    still_pending(sim, ns, "urgent", 4)
    ledger, problems = ledger_problems(sim, node)
    assert problems == []
    assert ledger is not None
    held = [a for a in ledger.allocations.values() if a.name == "stubborn"]
    assert held and held[0].preempted_by  # kept (counted as the nominee's) until memory is back
    assert "waiting for preemption of" in describe(sim, ns, "urgent")
    metrics_url = f"http://127.0.0.1:{sim.stack.ports.metrics}"

    def dashboard_says() -> bool:
        state = httpx.get(f"{metrics_url}/api/state", timeout=10).json()
        return any(p["name"] == "urgent" and p["namespace"] == ns
                   and "waiting for preemption of" in p["summary"] for p in state["pending"])

    sim.kube.wait_for("the dashboard shows the wait", dashboard_says, 20, 0.5)
    assert not sim.kube.pod(ns, "urgent")["spec"].get("nodeName")
    freed_at = int(time.time())
    hold_gpu_memory(region, uuid, 0)  # the process is finally gone: NVML shows it free
    placed = sim.kube.wait_running(ns, "urgent", timeout_s=60)
    scheduled = next(c for c in placed["status"]["conditions"] if c["type"] == "PodScheduled")
    at = calendar.timegm(time.strptime(scheduled["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ"))
    assert at >= freed_at  # bound only after the memory was reported free
    assert ledger_problems(sim, node)[1] == []


def test_two_preemptors_never_count_the_same_freed_capacity(sim: RunningStack, ns: str) -> None:
    node = "pre-e"
    create(sim, ns, pod("v1", node, 12000, "low"), pod("v2", node, 12000, "low"))
    running(sim, ns, "v1", "v2")
    # Three pods that each need one victim's room; only two can ever fit on the card.
    create(sim, ns, *(pod(f"hp-{i}", node, 12000, "urgent") for i in range(3)))
    sim.kube.wait_for("two preemptors placed", lambda: sum(
        1 for i in range(3) if sim.kube.pod(ns, f"hp-{i}")["status"].get("phase") == "Running"
    ) == 2, 90)  # fmt: skip
    still_pending(sim, ns, next(f"hp-{i}" for i in range(3)
                                if not sim.kube.pod(ns, f"hp-{i}")["spec"].get("nodeName")), 3)
    placed = [sim.kube.pod(ns, f"hp-{i}") for i in range(3)]
    total = sum(g.memory_mib for p in placed if p["spec"].get("nodeName")
                for gs in grants(p) for g in gs)  # fmt: skip
    assert total == 24000 <= GPU_MIB
    assert ledger_problems(sim, node)[1] == []
