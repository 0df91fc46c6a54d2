"""`make demo`'s content: every example in examples/ applied to a stack shaped like `tessera up`'s
default (2 nodes × 4 A10), with the outcome each file promises."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from tessera_cli.stack import make_nodes
from tessera_cli.up import apply_directory

from .conftest import RunningStack, grants, start_stack

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUNNING = ["share-1", "share-2", "share-3", "whole-gpu", "half-a-gpu", "four-gpus", "with-init",
           "a10-only", "spread-1", "spread-2"]
SPREAD = "08-spread.yaml"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(make_nodes(2, 4, 24576, "NVIDIA A10", prefix="sim-node"))


def test_every_example_does_what_it_says(sim: RunningStack, tmp_path: Path) -> None:
    # Spread puts each pod on the emptiest card *when it is placed*: while with-init's init
    # container runs, its card counts both containers' room, and spread-2 may then rightly join
    # spread-1's card (seen once on a loaded machine). So 08 is applied once the earlier examples
    # are Running (init finished); then two cards are emptier than spread-1's and the pods differ.
    first, spread = tmp_path / "first", tmp_path / "spread"
    first.mkdir()
    spread.mkdir()
    for example in EXAMPLES.glob("*.yaml"):
        target = spread if example.name == SPREAD else first
        shutil.copy(example, target / example.name)
    out = io.StringIO()
    apply_directory(sim.stack, first, Console(file=out, width=200))
    kube = sim.kube
    settled = [kube.wait_running("default", n) for n in RUNNING if not n.startswith("spread-")]
    apply_directory(sim.stack, spread, Console(file=out, width=200))
    output = out.getvalue()
    assert "06-quota-denied.yaml" in output and "quota" in output.split("06-quota-denied")[1]
    pods = {p["metadata"]["name"]: p
            for p in settled + [kube.wait_running("default", n) for n in RUNNING[-2:]]}
    assert kube.pods("team-a") == [], "the over-quota pod must have been refused"

    shared = {grants(pods[f"share-{i}"])[0][0].uuid for i in (1, 2, 3)}
    assert len(shared) == 1
    [[whole]] = grants(pods["whole-gpu"])
    assert (whole.memory_mib, whole.cores) == (24576, 100)
    assert grants(pods["half-a-gpu"])[0][0].memory_mib == 12288
    assert len({g.uuid for g in grants(pods["four-gpus"])[0]}) == 4
    assert [len(c) for c in grants(pods["with-init"])] == [1, 1]
    assert "A10" in grants(pods["a10-only"])[0][0].type
    assert grants(pods["spread-1"])[0][0].uuid != grants(pods["spread-2"])[0][0].uuid

    def pending_reason() -> str | None:
        pod = kube.pod("default", "too-big")
        conditions = pod["status"].get("conditions") or []
        message = next((c.get("message", "") for c in conditions
                        if c.get("type") == "PodScheduled" and c.get("status") == "False"), "")
        return message if "CardInsufficientMemory" in message else None

    kube.wait_for("too-big's reason", pending_reason, 15)
