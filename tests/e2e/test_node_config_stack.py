"""Per-node device configuration on the local stack, as an operator does it: a ConfigMap
`tessera-node-config` applied through the Kubernetes API changes what the node offers (kubelet's
allocatable, HAMi's node annotation) without restarting anything; `tessera node-config set`
(the admin identity on the bus) refuses to shrink below a running pod and says why, in its
output, in `get` and as a Warning event on the Node."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from tessera_cli.app import build_app
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE = "nc-a"
NODES = [SimNode(name=NODE, gpus=2, gpu_memory_mib=16384, gpu_model="NVIDIA A10")]


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


def cli(sim: RunningStack, *args: str):
    nats = sim.stack.nats_settings("admin")
    env = {"NATS_URL": nats.url, "NATS_USER": nats.user, "NATS_PASSWORD": nats.resolved_password(),
           "NATS_TLS_CA": nats.tls_ca,
           **(sim.stack.auth.command_env(nats.user or "") if sim.stack.auth else {})}
    return CliRunner().invoke(build_app(), list(args), env={k: v for k, v in env.items() if v})


def register_counts(sim: RunningStack) -> set[int]:
    """The slot counts HAMi's `hami.io/node-nvidia-register` annotation gives the node's GPUs."""
    text = node(sim)["metadata"].get("annotations", {}).get("hami.io/node-nvidia-register")
    return {d["count"] for d in json.loads(text)} if text else set()


def node(sim: RunningStack) -> dict:
    reply = sim.kube.http.get(f"/api/v1/nodes/{NODE}")
    reply.raise_for_status()
    return reply.json()


def allocatable(sim: RunningStack) -> int:
    return int((node(sim)["status"].get("allocatable") or {}).get("nvidia.com/gpu", "0"))


def test_configmap_and_cli_change_a_node_live_and_refuse_to_shrink(sim, namespace) -> None:
    kube = sim.kube
    assert allocatable(sim) == 2 * 10  # HAMi's default split count
    body = {"defaults": {"devicesplitcount": 5},
            "nodeconfig": [{"name": NODE, "devicesplitcount": 3}]}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "tessera-node-config"},
                  "data": {"config.json": json.dumps(body)}}
    assert kube.http.post("/api/v1/namespaces/default/configmaps", json=config_map
                          ).status_code == 201
    kube.wait_for("kubelet sees 3 slots per GPU", lambda: allocatable(sim) == 2 * 3)
    # HAMi's annotation is patched on its own (after the registration kubelet's view follows):
    # waited for too, not read at the instant kubelet's view changed.
    kube.wait_for("HAMi's node annotation says 3 slots per GPU",
                  lambda: register_counts(sim) == {3}, 40)

    # A pod holding 12000 MiB of one GPU.
    kube.create_pod_retrying(gpu_pod("holder", mem=12000, cores=20), namespace)
    kube.wait_running(namespace, "holder", timeout_s=40)
    refused = cli(sim, "node-config", "set", NODE, "--memory-scaling", "0.5")
    assert refused.exit_code == 1, refused.output
    assert "12000 MiB allocated" in refused.output and "8192 MiB" in refused.output
    shown = cli(sim, "node-config", "get", NODE)
    assert shown.exit_code == 0 and "REFUSED" in shown.output and "12000 MiB" in shown.output
    events = kube.http.get("/api/v1/namespaces/default/events").json()["items"]
    warnings = [e for e in events if e["reason"] == "NodeConfigRefused"
                and e["involvedObject"]["name"] == NODE]
    assert warnings and warnings[-1]["type"] == "Warning"
    assert allocatable(sim) == 2 * 3  # nothing changed

    # A change the pod fits in is applied at once; the local entry wins over the ConfigMap.
    applied = cli(sim, "node-config", "set", NODE, "--split-count", "4")
    assert applied.exit_code == 0, applied.output
    assert '"devicesplitcount": 4' in applied.output
    kube.wait_for("kubelet sees 4 slots per GPU", lambda: allocatable(sim) == 2 * 4)
    assert kube.wait_running(namespace, "holder")  # the running pod is untouched
    reset = cli(sim, "node-config", "set", NODE, "--reset")
    assert reset.exit_code == 0, reset.output
    kube.wait_for("back to the ConfigMap's 3", lambda: allocatable(sim) == 2 * 3)
    bad = cli(sim, "node-config", "set", NODE, "--split-count", "-1")
    assert bad.exit_code == 1 and "devicesplitcount" in bad.output
    kube.delete_namespace_pods(namespace)
    kube.http.delete("/api/v1/namespaces/default/configmaps/tessera-node-config")
    kube.wait_for("back to the chart's 10", lambda: allocatable(sim) == 2 * 10)
