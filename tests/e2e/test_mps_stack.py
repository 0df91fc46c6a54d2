"""MPS on the local stack, as an operator and a user do it: a ConfigMap sets a node to
`operatingmode: mps`, and a pod asking `nvidia.com/vgpu-mode: mps` runs a driver-API program
(cuctl on the fake libcuda, an MPS client) through its own control daemon (the FAKE
nvidia-cuda-mps-control, tests/node_agent/fake_mps_control.py), whose server gives it its slice —
set through the daemon before the container started — and stops it there although its
environment asks for 64 GiB. Two pods of different sizes on one card, side by side, are each
stopped at their own limit. A pod asking another mode is refused on that node with HAMi's
reason."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, grants, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "node_agent" / "fake_mps_control.py"
NODE = "mps-a"
NODES = [SimNode(name=NODE, gpus=1, gpu_memory_mib=16384, gpu_model="NVIDIA H200")]
MiB = 1 << 20


@pytest.fixture(scope="module")
def programs() -> Iterator[Path]:
    """cuctl and the fake driver (tests/native/Makefile), in a build dir of this module."""
    build = Path(tempfile.mkdtemp(prefix="tsr-mps-e2e-"))
    done = subprocess.run(
        ["make", "-s", "-C", str(ROOT / "tests" / "native"), f"BUILD={build}",
         f"PYTHON={sys.executable}", f"{build}/fake/libcuda.so.1", f"{build}/cuctl"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"the fake driver does not build here: {done.stderr[-400:]}")
    yield build


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    stack = start_stack(NODES, run_containers=True,
                        env={"TESSERA_MPS_CONTROL_BINARY": str(FAKE),
                             "TESSERA_MPS_RECONCILE_S": "0.5"})
    running = next(stack)
    daemons: list[int] = []
    try:
        yield running
        for pid_file in (running.stack.state_dir / "regions").glob("*/.mps/*/pipe/*.pid"):
            daemons.append(int(pid_file.read_text().split()[0]))
    finally:
        for _ in stack:  # the stack stops; the daemons outlive their agent by design
            pass
        for pid in daemons:  # SIGTERM: the fake daemon ends its servers and itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def mps_mode(sim: RunningStack) -> None:
    body = {"nodeconfig": [{"name": NODE, "operatingmode": "mps"}]}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "tessera-node-config"},
                  "data": {"config.json": json.dumps(body)}}
    reply = sim.kube.http.post("/api/v1/namespaces/default/configmaps", json=config_map)
    assert reply.status_code in (201, 409), reply.text

    def in_mps_mode() -> bool:
        node = sim.kube.http.get(f"/api/v1/nodes/{NODE}").json()
        register = node["metadata"].get("annotations", {}).get("hami.io/node-nvidia-register")
        return bool(register) and {d["mode"] for d in json.loads(register)} == {"mps"}

    sim.kube.wait_for("the node registers its GPU in MPS mode", in_mps_mode, 30)


def control_logs(sim: RunningStack) -> list[Path]:
    return sorted((sim.stack.state_dir / "regions" / NODE / ".mps").glob("*/log/control.log"))


def finished(sim: RunningStack, ns: str, name: str):
    def check() -> dict[str, Any] | None:
        pod = sim.kube.pod(ns, name)
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None
    return check


def client_pod(name: str, mem: int, cores: int, allocs_mib: list[int], out: Path,
               programs: Path, tmp_path: Path, hold: Path | None = None) -> dict[str, Any]:
    """An MPS pod running cuctl: `allocs_mib` allocations in turn, answers in `out`; with
    `hold`, the container stays (holding its memory) until that file exists."""
    pod = gpu_pod(name, mem=mem, cores=cores, annotations={"nvidia.com/vgpu-mode": "mps"})
    pod["spec"]["restartPolicy"] = "Never"
    steps = "".join(f"alloc plain {m * MiB}\\n" for m in allocs_mib)
    wait = f"while [ ! -e {hold} ]; do sleep 0.1; done; " if hold else ""
    script = f"init\\n{steps}" + ("" if hold else "exit\\n")
    pod["spec"]["containers"][0]["command"] = [
        # kube-sim has no mount namespace: libvgpu's sealed region path (a container path) does
        # not resolve there, so the client runs without the preload — which leaves the MPS
        # server as the only thing between it and the card, as this test means to show.
        "/bin/sh", "-c", f"printf '{script}' > {out}.in; echo $$ > {out}.pid; "
        f"(cat {out}.in; {wait}echo exit) | env -u LD_PRELOAD {programs}/cuctl "
        f"> {out} 2> {out}.err",
    ]
    pod["spec"]["containers"][0]["env"] = [
        {"name": "LD_LIBRARY_PATH", "value": str(programs / "fake")},
        {"name": "FAKE_CUDA_STATE", "value": str(tmp_path / "gpu-state")},
        # the fake GPU is the node's (libvgpu, in accounting mode, matches it by UUID)
        {"name": "FAKE_GPU_UUIDS", "value": gpu_uuid(NODE, 0)},
        {"name": "FAKE_GPU_COUNT", "value": "1"},
        {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=64G"},  # hostile: asks more
        {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"},
    ]
    return pod


def answers(out: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def test_mps_pod_is_held_to_its_slice_by_the_server(sim, namespace, programs, tmp_path) -> None:
    mps_mode(sim)
    out = tmp_path / "cuctl.out"
    pod = client_pod("mps-client", 1024, 30, [768, 512], out, programs, tmp_path)
    sim.kube.create_pod_retrying(pod, namespace)
    done = sim.kube.wait_for("the client to finish", finished(sim, namespace, "mps-client"), 40)
    [[grant]] = grants(done)
    assert (grant.memory_mib, grant.cores) == (1024, 30)
    said = answers(out)
    assert [a["rc"] for a in said[:3]] == [0, 0, 2], (  # 768 MiB fit, 512 MiB more do not
        said, Path(f"{out}.err").read_text()[-3000:])
    # The server gave the container's process its slice: set through the daemon, not its env.
    text = "".join(log.read_text() for log in control_logs(sim))
    assert "Cmd: set_default_device_pinned_mem_limit 0 1024M" in text
    assert "Cmd: set_default_active_thread_percentage 30" in text
    assert (f"pinned device memory limit {1024 * MiB} bytes, active thread percentage 30.0"
            in text), text[-2000:]

    other = gpu_pod("core-pod", mem=1000, annotations={"nvidia.com/vgpu-mode": "hami-core"})
    sim.kube.create_pod_retrying(other, namespace)

    def refused() -> bool:
        events = sim.kube.http.get(f"/api/v1/namespaces/{namespace}/events").json()["items"]
        return any(e["reason"] == "FailedScheduling" and "CardTypeMismatch" in e["message"]
                   for e in events)

    sim.kube.wait_for("a hami-core pod refused on the MPS card", refused, 30)


def test_two_pods_of_different_sizes_on_one_card_are_each_held_to_their_own_limit(
    sim, namespace, programs, tmp_path
) -> None:
    """Side by side on the one card: the small pod (1 GiB, 20 %) holds its memory while the
    large one (3 GiB, 50 %) runs; each is stopped at its own limit (before, both were held to
    the smallest pod's), whatever their environments ask."""
    mps_mode(sim)
    hold = tmp_path / "release-small"
    small_out, large_out = tmp_path / "small.out", tmp_path / "large.out"
    small = client_pod("mps-small", 1024, 20, [768, 512], small_out, programs, tmp_path,
                       hold=hold)
    sim.kube.create_pod_retrying(small, namespace)
    sim.kube.wait_for("the small pod's allocations", lambda: len(answers(small_out)) >= 3, 40)

    def on_dashboard() -> list[dict[str, Any]]:  # the metrics service's view of the card
        state = httpx.get(f"http://127.0.0.1:{sim.stack.ports.metrics}/api/state",
                          timeout=10).json()
        return [c for n in state["nodes"] if n["name"] == NODE for g in n["gpus"]
                for c in g["mps_clients"] if c["pod"] == f"{namespace}/mps-small"]

    [client] = sim.kube.wait_for("the dashboard shows the small pod's MPS server",
                                 on_dashboard, 30)
    assert (client["memory_mib"], client["thread_pct"]) == (1024, 20)
    large = client_pod("mps-large", 3072, 50, [2048, 768, 512], large_out, programs, tmp_path)
    sim.kube.create_pod_retrying(large, namespace)
    done = sim.kube.wait_for("the large pod to finish", finished(sim, namespace, "mps-large"), 40)
    assert sim.kube.pod(namespace, "mps-small")["status"].get("phase") == "Running"
    hold.touch()
    sim.kube.wait_for("the small pod to finish", finished(sim, namespace, "mps-small"), 40)
    assert [g.memory_mib for [g] in grants(done)] == [3072]
    said_small, said_large = answers(small_out), answers(large_out)
    assert [a["rc"] for a in said_small[:3]] == [0, 0, 2], said_small  # 768 fit, +512 not
    assert [a["rc"] for a in said_large[:4]] == [0, 0, 0, 2], said_large  # 2816 fit, +512 not
    # two servers on one card, each with its own pod's limits, set through its own daemon
    text = "".join(log.read_text() for log in control_logs(sim))
    assert f"pinned device memory limit {1024 * MiB} bytes, active thread percentage 20.0" in text
    assert f"pinned device memory limit {3072 * MiB} bytes, active thread percentage 50.0" in text
