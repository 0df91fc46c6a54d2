"""Migrating from HAMi node by node, on a running stack (docs/migrating-from-hami.md).

The test plays HAMi, which cannot run here: it creates a pod routed to `hami-scheduler`, annotates
and binds it as HAMi's scheduler does, and marks it Running as a pod started before its node
switched to Tessera's node agent would be (kube-sim's kubelet then leaves it alone, as kubelet
leaves a running pod). It also registers a node the way HAMi's device plugin does. Everything else
is the real stack: kube-sim's API server and kube-scheduler calling the extender over mutual TLS,
the scheduler's pod and node watches, NATS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from tessera_cli.app import build_app
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE = "mg-t"  # migrated: Tessera's node agent serves it, a HAMi pod still runs there
HAMI_NODE = "mg-h"  # not migrated yet: only HAMi's device plugin registered it
CARD = 24576
MERGE = {"content-type": "application/merge-patch+json"}


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack([SimNode(name=NODE, gpus=1, gpu_memory_mib=CARD)])


def place_as_hami(sim: RunningStack, ns: str, name: str, node: str, uuid: str, mem: int) -> None:
    """What HAMi's webhook, scheduler and (earlier) kubelet did for one pod."""
    pod = gpu_pod(name, mem=mem, cores=50)
    pod["spec"]["schedulerName"] = "hami-scheduler"
    sim.kube.create_pod_retrying(pod, ns)
    http = sim.kube.http
    path = f"/api/v1/namespaces/{ns}/pods/{name}"
    annotations = {
        "hami.io/vgpu-devices-allocated": f"{uuid},NVIDIA-NVIDIA A10,{mem},50:;",
        "hami.io/vgpu-devices-to-allocate": ";",
        "hami.io/vgpu-node": node, "hami.io/vgpu-time": "1700000000",
        "hami.io/bind-time": "1700000000", "hami.io/bind-phase": "success",
    }  # fmt: skip
    body = {"metadata": {"annotations": annotations, "labels": {"hami.io/vgpu-node": node}}}
    assert http.patch(path, content=json.dumps(body), headers=MERGE).status_code == 200
    status = {"status": {"phase": "Running"}}
    assert http.patch(f"{path}/status", content=json.dumps(status),
                      headers=MERGE).status_code == 200  # fmt: skip
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
    assert http.post(f"{path}/binding", json=binding).status_code == 201


def refusal(sim: RunningStack, ns: str, name: str) -> str:
    """The pod's FilteringFailed message (the scheduler's Event), or ''."""
    events = sim.kube.http.get(f"/api/v1/namespaces/{ns}/events").json()["items"]
    messages = [e["message"] for e in events if e.get("reason") == "FilteringFailed"
                and e["involvedObject"]["name"] == name]  # fmt: skip
    return messages[-1] if messages else ""


def bound_node(sim: RunningStack, ns: str, name: str) -> str:
    return sim.kube.pod(ns, name)["spec"].get("nodeName") or ""


def test_tessera_never_places_on_what_hami_holds(sim: RunningStack, namespace: str) -> None:
    ns = namespace
    register = json.dumps([{"id": "GPU-hami-0", "index": 0, "count": 10, "devmem": CARD,
                            "devcore": 100, "type": "NVIDIA-NVIDIA A10", "numa": 0,
                            "mode": "hami-core", "health": True}])  # fmt: skip
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": HAMI_NODE, "annotations": {
                "hami.io/node-nvidia-register": register}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                       "allocatable": {"nvidia.com/gpu": "10"}}}  # fmt: skip
    assert sim.kube.http.post("/api/v1/nodes", json=node).status_code == 201
    place_as_hami(sim, ns, "trainer", NODE, gpu_uuid(NODE, 0), 20000)
    place_as_hami(sim, ns, "legacy-job", HAMI_NODE, "GPU-hami-0", 8000)

    sim.kube.create_pod_retrying(gpu_pod("big", mem=10000), ns)
    why = sim.kube.wait_for("big refused", lambda: refusal(sim, ns, "big"), 30, 0.3)
    assert f"{NODE}: 1/1 CardInsufficientMemory" in why
    assert f"used by HAMi pod {ns}/trainer" in why
    assert f"{HAMI_NODE}: NodeUnregistered" in why and "read-only to Tessera" in why
    assert f"GPU-hami-0: 8000 MiB and 50 cores used by HAMi pod {ns}/legacy-job" in why
    assert bound_node(sim, ns, "big") == ""
    result = CliRunner().invoke(build_app(), ["describe", "pod", "big", "-n", ns,
                                              "--kubeconfig", str(sim.stack.kubeconfig)])
    assert result.exit_code == 0 and "used by HAMi pod" in result.output

    # A restart rebuilds HAMi's holdings from the cluster before the scheduler serves again.
    sim.stack.restart_service("scheduler")
    sim.stack.wait_ready(60)
    sim.kube.create_pod_retrying(gpu_pod("big-after-restart", mem=10000), ns)
    why = sim.kube.wait_for("refused after the restart",
                            lambda: refusal(sim, ns, "big-after-restart"), 40, 0.3)  # fmt: skip
    assert f"used by HAMi pod {ns}/trainer" in why
    assert bound_node(sim, ns, "big") == "" and bound_node(sim, ns, "big-after-restart") == ""

    # HAMi's pod ends: its memory is Tessera's to give (both 10000 MiB pods fit the 24 GiB card).
    sim.kube.delete_pod(ns, "trainer")
    for name in ("big", "big-after-restart"):
        placed = sim.kube.wait_running(ns, name, 60)
        assert placed["spec"]["nodeName"] == NODE
    assert sim.kube.pod(ns, "legacy-job")["spec"]["nodeName"] == HAMI_NODE  # never touched
    hami_node = next(n for n in sim.kube.nodes() if n["metadata"]["name"] == HAMI_NODE)
    assert hami_node["metadata"]["annotations"]["hami.io/node-nvidia-register"] == register

