"""The local stack with NATS authorization on (its default): every service does its job with its
own identity, the CLI works as admin, an anonymous client gets nothing, and the broker logged no
permission violation along the way (so the table grants everything the services really use)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from e2e.conftest import RunningStack, gpu_pod, grants, start_stack

from tessera import bus_permissions as bp
from tessera_cli.stack import SimNode
from tessera_cli.stack_auth import ADMIN_ENV_NAME, identity_of

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

DOTTED = "gpu.auth-b"  # a node name that is several subject tokens
NODES = [
    SimNode(name="auth-a", gpus=2, gpu_memory_mib=24576, gpu_model="NVIDIA A10"),
    SimNode(name=DOTTED, gpus=2, gpu_memory_mib=24576, gpu_model="NVIDIA A10"),
]


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES)


@pytest.fixture
def namespace() -> str:
    return f"auth-{uuid.uuid4().hex[:8]}"


def cli(sim: RunningStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "TESSERA_"))}
    env["TESSERA_ENV_FILE"] = str(sim.stack.state_dir / ADMIN_ENV_NAME)
    return subprocess.run(
        [sys.executable, "-m", "tessera_cli", *args], env=env, capture_output=True,
        text=True, timeout=60,
    )


def violations(sim: RunningStack) -> list[str]:
    assert sim.stack.nats is not None
    log = sim.stack.nats.log_path.read_text(errors="replace")
    return [line for line in log.splitlines() if "Violation" in line]


def test_each_child_runs_as_its_own_identity(sim: RunningStack) -> None:
    users = {}
    for running in sim.stack.running:
        env = sim.stack.service_env(running.spec)
        identity = identity_of(running.spec.module, running.spec.env)
        if identity is None:  # kube-sim does not use the bus
            assert "NATS_USER" not in env
            continue
        users[running.spec.name] = env["NATS_USER"]
    assert users == {
        "quota": "tessera-quota", "scheduler": "tessera-scheduler",
        "admission": "tessera-admission", "metrics": "tessera-metrics",
        "node-agent/auth-a": bp.user_name(bp.NODE_AGENT, "auth-a"),
        f"node-agent/{DOTTED}": bp.user_name(bp.NODE_AGENT, DOTTED),
    }
    assert sim.stack.auth is not None
    assert len(set(sim.stack.auth.passwords.values())) == len(sim.stack.auth.passwords)


def test_an_anonymous_client_is_refused_by_the_stacks_nats(sim: RunningStack) -> None:
    async def attempt() -> None:
        await nats.connect(sim.stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0)

    with pytest.raises(Exception) as refused:
        asyncio.run(attempt())
    assert "authorization" in str(refused.value).lower()


def test_a_pod_is_placed_and_the_cli_works_with_auth_on(sim: RunningStack, namespace: str) -> None:
    set_quota = cli(sim, "quota", "set", namespace, "--memory", "8000")
    assert set_quota.returncode == 0, set_quota.stdout + set_quota.stderr

    for node in (n.name for n in NODES):
        name = f"p-{node.replace('.', '-')}"
        sim.kube.create_pod_retrying(gpu_pod(name, mem=1000, node=node), namespace)
        pod = sim.kube.wait_running(namespace, name, timeout_s=60)
        assert pod["spec"]["nodeName"] == node
        assert [g.memory_mib for g in grants(pod)[0]] == [1000]

    # The admin's limits change reaches the dotted node's agent (its own endpoint) ...
    changed = cli(sim, "limits", "set", DOTTED, f"{namespace}/p-gpu-auth-b", "main",
                  "--memory", "900")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "900 MiB" in changed.stdout
    # ... and the quota service charged both pods (its release consumer and watches work), the
    # second at its changed limit (limits.set resizes the pod's quota charge too).
    usage = cli(sim, "quota", "get", namespace)
    assert usage.returncode == 0, usage.stdout + usage.stderr
    assert "1,900 MiB" in usage.stdout and "p-gpu-auth-b" in usage.stdout, usage.stdout

    sim.kube.delete_namespace_pods(namespace)

    def released() -> bool:
        shown = cli(sim, "quota", "get", namespace)
        return shown.returncode == 0 and "p-auth-a" not in shown.stdout and "8,000" in shown.stdout

    sim.kube.wait_for("quota released (release events through the quota consumer)", released,
                      30, 0.5)
    assert violations(sim) == []


def test_services_reconnect_with_their_identities_after_nats_restarts(
    sim: RunningStack, namespace: str
) -> None:
    """Watches, the quota consumer and micro endpoints come back under the same permissions."""
    assert sim.stack.nats is not None
    sim.stack.nats.kill()
    sim.stack.nats.start()
    sim.kube.create_pod_retrying(gpu_pod("after-restart", mem=2000, node="auth-a"), namespace)
    pod = sim.kube.wait_running(namespace, "after-restart", timeout_s=90)
    assert [g.memory_mib for g in grants(pod)[0]] == [2000]
    changed = cli(sim, "limits", "set", "auth-a", f"{namespace}/after-restart", "main",
                  "--memory", "1500")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    sim.kube.delete_namespace_pods(namespace)
    assert violations(sim) == []


def test_stack_info_names_the_admin_env_file(sim: RunningStack) -> None:
    info = json.loads((sim.stack.state_dir / "stack.json").read_text())
    path = info["nats_admin_env"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert "NATS_USER=tessera-admin" in Path(path).read_text()
