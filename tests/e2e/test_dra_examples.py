"""The seed examples (examples/, HAMi's resources and annotations) unchanged in DRA mode, applied
with the real kubectl: the webhook turns each GPU container into a ResourceClaim, kube-sim's
structured allocator places it, Tessera's DRA driver seals it. Same stack shape as `tessera up
--dra` (2 nodes × 4 A10).

What DRA cannot promise is not asserted: HAMi's GPU policies (binpack, spread,
topology-aware) have no DRA counterpart (the allocator takes the first fit, docs/dra.md), and a
pod that cannot fit is refused with the allocator's reason, not HAMi's reason codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tessera_cli.dra import device_class
from tessera_cli.stack import make_nodes

from .conftest import RunningStack, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KUBECTL = os.environ.get("KUBECTL") or str(Path(sys.executable).parent / "kubectl")
RUNNING = [
    "share-1",
    "share-2",
    "share-3",
    "whole-gpu",
    "half-a-gpu",
    "four-gpus",
    "with-init",
    "a10-only",
    "spread-1",
    "spread-2",
]


def kubectl(sim: RunningStack, *args: str, stdin: str | None = None,
            ok: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    result = subprocess.run([KUBECTL, "--kubeconfig", str(sim.stack.kubeconfig), *args],
                            input=stdin, capture_output=True, text=True, timeout=60)  # fmt: skip
    if ok and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result


def get(sim: RunningStack, *args: str) -> Any:
    return json.loads(kubectl(sim, "get", *args, "-o", "json").stdout)


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    nodes = [n.model_copy(update={"dra": True})
             for n in make_nodes(2, 4, 24576, "NVIDIA A10", prefix="sim-node")]  # fmt: skip
    yield from start_stack(nodes)


def slices_of(sim: RunningStack, pod: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per container (init first): (node, device, memory, cores, device type) of its claims."""
    ns = pod["metadata"]["namespace"]
    statuses = {s["name"]: s["resourceClaimName"]
                for s in pod["status"].get("resourceClaimStatuses") or []}  # fmt: skip
    slices = {s["spec"]["nodeName"]: {d["name"]: d for d in s["spec"]["devices"]}
              for s in get(sim, "resourceslices")["items"]}  # fmt: skip
    out = []
    for container in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
        mine = []
        for ref in (container.get("resources") or {}).get("claims") or []:
            claim = get(sim, "resourceclaim", statuses[ref["name"]], "-n", ns)
            for r in claim["status"]["allocation"]["devices"]["results"]:
                device = slices[r["pool"]][r["device"]]
                mine.append({"node": r["pool"], "device": r["device"],
                             "memory": r["consumedCapacity"]["memory"],
                             "cores": r["consumedCapacity"]["cores"],
                             "type": device["attributes"]["type"]["string"]})  # fmt: skip
        out.append(mine)
    return out


def test_the_seed_examples_run_unchanged_in_dra_mode(sim: RunningStack) -> None:
    kubectl(sim, "apply", "-f", "-", stdin=json.dumps(device_class()))
    sim.kube.wait_for("both nodes' ResourceSlices",
                      lambda: len(get(sim, "resourceslices")["items"]) == 2, 40)  # fmt: skip
    outputs = {}
    for example in sorted(EXAMPLES.glob("*.yaml")):
        result = kubectl(sim, "apply", "-f", str(example), ok=False)
        outputs[example.name] = result.stdout + result.stderr
        if example.name.startswith("00-"):  # the quota service learns it from its watch
            sim.kube.wait_for(
                "team-a's quota known",
                lambda: (
                    'namespace="team-a"'
                    in httpx.get(f"{sim.stack.dashboard_url}metrics", timeout=10).text
                ),
                30,
            )
    denied = outputs["06-quota-denied.yaml"]
    assert "denied the request: exceeding resource quota" in denied, denied
    pods = {n: sim.kube.wait_running("default", n, 60) for n in RUNNING}
    assert sim.kube.pods("team-a") == [], "the over-quota pod must have been refused"

    for pod in pods.values():  # no HAMi resource left, the default scheduler placed it
        assert pod["spec"].get("schedulerName", "default-scheduler") == "default-scheduler"
        for c in pod["spec"]["containers"]:
            assert not any(k.startswith("nvidia.com/") for k in
                           (c.get("resources") or {}).get("limits") or {})  # fmt: skip
    got = {name: slices_of(sim, pod) for name, pod in pods.items()}
    shared = {(s[0][0]["node"], s[0][0]["device"]) for s in
              (got["share-1"], got["share-2"], got["share-3"])}  # fmt: skip
    assert len(shared) == 1, got
    assert all(got[f"share-{i}"][0][0]["memory"] == "3000Mi" for i in (1, 2, 3))
    [[whole]] = got["whole-gpu"]
    assert (whole["memory"], whole["cores"]) == ("24Gi", "100")
    assert got["half-a-gpu"][0][0]["memory"] == "12Gi"
    assert len({d["device"] for d in got["four-gpus"][0]}) == 4
    assert [len(c) for c in got["with-init"]] == [1, 1]
    assert "A10" in got["a10-only"][0][0]["type"]

    def pending_reason() -> str | None:
        pod = sim.kube.pod("default", "too-big")
        message = next(
            (
                c.get("message", "")
                for c in pod["status"].get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "False"
            ),
            "",
        )
        return message if "cannot allocate all claims" in message else None

    sim.kube.wait_for("too-big's allocator reason", pending_reason, 30)
