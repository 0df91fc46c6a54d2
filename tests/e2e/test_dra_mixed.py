"""One cluster, both modes on different nodes (docs/dra.md): an extender node and a DRA node.

A HAMi pod goes through the extender and never lands on the DRA node (the extender refuses it:
`NodeInDRAMode`); the same pod annotated `tessera.io/allocation-mode: dra` becomes a claim the
allocator places on the DRA node. Both appear alike in HAMi's metrics and `tessera describe`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tessera_cli.dra import device_class
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, grants, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

KUBECTL = os.environ.get("KUBECTL") or str(Path(sys.executable).parent / "kubectl")
EXTENDER_NODE, DRA_NODE = "ext-node-0", "dra-node-1"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    nodes = [
        SimNode(name=EXTENDER_NODE, gpus=1, gpu_memory_mib=24576),
        SimNode(name=DRA_NODE, gpus=1, gpu_memory_mib=24576, dra=True),
    ]
    yield from start_stack(nodes)


def kubectl(sim: RunningStack, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run([KUBECTL, "--kubeconfig", str(sim.stack.kubeconfig), *args],
                            input=stdin, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def describe(sim: RunningStack, namespace: str, name: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "describe", "pod", name, "-n", namespace,
         "--kubeconfig", str(sim.stack.kubeconfig)],
        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_extender_and_dra_pods_side_by_side(sim: RunningStack, namespace: str) -> None:
    kubectl(sim, "apply", "-f", "-", stdin=json.dumps(device_class()))
    kubectl(sim, "create", "namespace", namespace)
    sim.kube.wait_for(
        "the DRA node's slice",
        lambda: json.loads(kubectl(sim, "get", "resourceslices", "-o", "json"))["items"],
        40,
    )
    # Two extender pods of 20 GiB: the extender node holds one; the DRA node has room, but the
    # extender never places there.
    sim.kube.create_pod_retrying(gpu_pod("ext-1", mem=20000, cores=10), namespace)
    ext = sim.kube.wait_running(namespace, "ext-1", 60)
    assert ext["spec"]["nodeName"] == EXTENDER_NODE
    [[grant]] = grants(ext)
    assert (grant.uuid, grant.memory_mib) == (gpu_uuid(EXTENDER_NODE, 0), 20000)
    sim.kube.create_pod_retrying(gpu_pod("ext-2", mem=20000, cores=10), namespace)

    def refusal() -> str | None:
        pod = sim.kube.pod(namespace, "ext-2")
        return next(
            (
                c.get("message", "")
                for c in pod["status"].get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "False"
            ),
            None,
        )

    message = sim.kube.wait_for("ext-2 refused", refusal, 30)
    assert "CardInsufficientMemory" in message and "NodeInDRAMode" in message, message
    assert sim.kube.pod(namespace, "ext-2")["spec"].get("nodeName") is None

    # the same HAMi pod, annotated for DRA: a claim the allocator places on the DRA node
    dra = gpu_pod("dra-1", mem=20000, cores=10, annotations={"tessera.io/allocation-mode": "dra"})
    sim.kube.create_pod_retrying(dra, namespace)
    placed = sim.kube.wait_running(namespace, "dra-1", 60)
    assert placed["spec"]["nodeName"] == DRA_NODE
    assert placed["spec"]["resourceClaims"], "the webhook did not convert the annotated pod"

    listing = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "get", "pods", "-n", namespace,
         "--kubeconfig", str(sim.stack.kubeconfig)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    row = next(line for line in listing.stdout.splitlines() if line.startswith("dra-1"))
    assert "20000MiB/10%" in row, listing.stdout

    text = describe(sim, namespace, "dra-1")
    assert "20000 MiB, 10% compute" in text, text
    assert f"{DRA_NODE}/gpu-0" in text, text

    metrics = httpx.get(f"{sim.stack.dashboard_url}metrics", timeout=10).text
    mine = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("hami_vgpu_memory_allocated_bytes{") and namespace in ln
    ]
    assert {n for ln in mine for n in (EXTENDER_NODE, DRA_NODE) if f'node="{n}"' in ln} == {
        EXTENDER_NODE,
        DRA_NODE,
    }, mine
