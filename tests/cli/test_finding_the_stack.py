"""Every command finds the stack the same way, and says in one line (fast) when it is away."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera_cli.locate import StackLocation
from tessera_cli.nats_embedded import free_port

KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {{server: "{server}"}}
contexts:
- name: x
  context: {{cluster: c, user: u}}
current-context: x
users:
- name: u
  user: {{token: t}}
"""


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NATS_", "TESSERA_")) and k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


def tessera(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tessera_cli", *args], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path, env=clean_env(tmp_path, **env))
    return result, time.monotonic() - started


def write_stack(state: Path, api_port: int, nats_port: int) -> None:
    state.mkdir(parents=True, exist_ok=True)
    (state / "kubeconfig").write_text(KUBECONFIG.format(server=f"http://127.0.0.1:{api_port}"))
    (state / "stack.json").write_text(json.dumps({
        "kubeconfig": str(state / "kubeconfig"), "nats_url": f"nats://127.0.0.1:{nats_port}",
    }))


def assert_one_line_error(result: subprocess.CompletedProcess, elapsed: float, *words: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    for word in words:
        assert word in lines[0], lines[0]
    assert elapsed < 15, f"took {elapsed:.1f} s to say so"


def test_the_order_of_kubeconfigs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TESSERA_KUBECONFIG", "KUBECONFIG", "TESSERA_STATE_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    state = tmp_path / "state"
    write_stack(state, 1, 2)
    explicit = tmp_path / "explicit"
    explicit.write_text("x")
    other = tmp_path / "other"
    other.write_text("x")
    location = StackLocation.find(state)
    assert location.kubeconfig(explicit) == explicit
    assert location.kubeconfig() == state / "kubeconfig"  # the running stack's
    monkeypatch.setenv("TESSERA_KUBECONFIG", str(other))
    assert location.kubeconfig() == other
    monkeypatch.delenv("TESSERA_KUBECONFIG")
    monkeypatch.setenv("KUBECONFIG", str(other))
    assert StackLocation.find(tmp_path / "no-stack").kubeconfig() == other  # a real cluster
    monkeypatch.setenv("TESSERA_STATE_DIR", str(state))
    assert StackLocation.find().state_dir == state


def test_nats_comes_from_the_stack_file_unless_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("NATS_URL", "TESSERA_ENV_FILE"):
        monkeypatch.delenv(key, raising=False)
    state = tmp_path / "state"
    write_stack(state, 1, 4999)
    assert StackLocation.find(state).nats_settings().url == "nats://127.0.0.1:4999"
    admin = state / "nats-admin.env"
    admin.write_text("NATS_URL=nats://127.0.0.1:5000\nNATS_USER=admin\nNATS_PASSWORD=pw\n")
    info = json.loads((state / "stack.json").read_text())
    (state / "stack.json").write_text(json.dumps({**info, "nats_admin_env": str(admin)}))
    settings = StackLocation.find(state).nats_settings()
    assert (settings.url, settings.user, settings.password) == ("nats://127.0.0.1:5000",
                                                                "admin", "pw")
    monkeypatch.setenv("NATS_URL", "nats://elsewhere:4222")
    assert StackLocation.find(state).nats_settings().url == "nats://elsewhere:4222"


def test_no_stack_at_all_is_one_line(tmp_path: Path) -> None:
    result, elapsed = tessera(tmp_path, "get", "pods")
    assert_one_line_error(result, elapsed, "no kubeconfig found", ".tessera/kubeconfig",
                          "tessera up")


@pytest.mark.parametrize("args", [
    ["get", "pods"], ["describe", "pod", "x"], ["apply", "-f", "pod.yaml"],
    ["delete", "pod", "x"],
])
def test_an_api_server_away_is_one_line_naming_it(tmp_path: Path, args: list[str]) -> None:
    port = free_port()
    write_stack(tmp_path / "state", port, free_port())
    (tmp_path / "pod.yaml").write_text("kind: Pod\nmetadata: {name: x}\nspec: {containers: []}\n")
    result, elapsed = tessera(tmp_path, *args, "--state-dir", "state")
    assert_one_line_error(result, elapsed, "cannot reach the API server",
                          f"http://127.0.0.1:{port}")


@pytest.mark.parametrize("args", [
    ["events"], ["quota", "list"],
    ["limits", "set", "node-1", "default/p", "main", "--memory", "1"],
    ["node-config", "get", "node-1"], ["node-config", "set", "node-1", "--split-count", "2"],
])
def test_nats_away_is_one_line_naming_it(tmp_path: Path, args: list[str]) -> None:
    port = free_port()
    write_stack(tmp_path / "state", free_port(), port)
    result, elapsed = tessera(tmp_path, *args, "--state-dir", "state")
    assert_one_line_error(result, elapsed, "cannot reach NATS", f"nats://127.0.0.1:{port}")
    # NATS_URL wins over the stack file, as for the services.
    other = free_port()
    result, elapsed = tessera(tmp_path, *args, "--state-dir", "state",
                              NATS_URL=f"nats://127.0.0.1:{other}")
    assert_one_line_error(result, elapsed, f"nats://127.0.0.1:{other}")
