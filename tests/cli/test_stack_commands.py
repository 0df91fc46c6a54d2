"""The CLI against a whole local stack started as a user does: `tessera up --wait` returns once
every service is ready (a pod applied at once goes through the webhook and is placed), every
command finds the stack from --state-dir alone, `get pods` shows what `limits set` changed
(the ledger, recorded on the pod), `describe` explains, and Ctrl-C stops every child cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.gpuid import short_uuid
from tessera_cli.nats_embedded import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NODE = "sim-node-0"
POD = """apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  containers:
  - name: main
    image: cuda:12
    resources:
      limits:
        nvidia.com/gpu: 1
        nvidia.com/gpumem: {mem}
        nvidia.com/gpucores: 30
"""


def tessera(state: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NATS_", "TESSERA_")) and k != "KUBECONFIG"}
    return subprocess.run([sys.executable, "-m", "tessera_cli", *args, "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def wait_for(what: str, check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("stack") / "state"
    started = time.monotonic()
    up = tessera(state, "up", "--wait", "--free-ports", "--nodes", "1", "--gpus-per-node", "2",
                 "--gpu-memory", "8000", timeout=240)
    info = json.loads((state / "stack.json").read_text()) if (state / "stack.json").exists() \
        else {}  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "ready in" in up.stdout and info.get("ready") is True
        print(f"tessera up --wait returned after {time.monotonic() - started:.1f} s")
        yield state
    finally:
        if int(info.get("pid") or 0):  # a test failed before Ctrl-C: stop it gently
            tessera(state, "down", timeout=90)


def test_a_pod_applied_right_after_up_wait_is_admitted_and_placed(state: Path) -> None:
    manifest = state.parent / "first.yaml"
    manifest.write_text(POD.format(name="first", mem=3000))
    applied = tessera(state, "apply", "-f", str(manifest))
    assert applied.returncode == 0 and "pod/first created" in applied.stdout, applied.stderr

    def running() -> str | None:
        listing = tessera(state, "get", "pods").stdout
        line = next((row for row in listing.splitlines() if row.startswith("first ")), "")
        return line if "Running" in line else None

    line = wait_for("the pod to run", running)
    assert ":3000MiB/30%" in line and "GPU-" in line


def test_get_nodes_shows_the_gpus_and_what_pods_hold(state: Path) -> None:
    def shown() -> str | None:
        line = next((row for row in tessera(state, "get", "nodes").stdout.splitlines()
                     if row.startswith(f"{NODE} ")), "")  # fmt: skip
        return line if "3000/16000" in line else None

    # first (3000 MiB, 30 %) runs on one of the node's two 8000 MiB cards.
    assert wait_for("get nodes to count the pod", shown).split() == [
        NODE, "Ready", "2", "3000/16000", "30/200%", "hami-core", "healthy"]
    as_json = json.loads(tessera(state, "get", "nodes", "-o", "json").stdout)
    [node] = [n for n in as_json if n["name"] == NODE]
    assert sorted(g["memory_used_mib"] for g in node["gpus"]) == [0, 3000]
    wide = tessera(state, "get", "nodes", "-o", "wide").stdout.splitlines()
    assert "TYPE" in wide[0] and "GPU PODS" in wide[0]


def test_node_config_finds_the_stack_from_the_state_dir_or_its_variable(state: Path) -> None:
    got = tessera(state, "node-config", "get", NODE)
    assert got.returncode == 0 and got.stdout.startswith(f"node {NODE}: "), got.stderr
    # Off a terminal a long line stays one line (rich wrapped it at 80 columns).
    effective = json.loads(got.stdout.splitlines()[0].removeprefix(f"node {NODE}: "))
    assert effective["devicesplitcount"] >= 1
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NATS_", "TESSERA_")) and k != "KUBECONFIG"}
    by_variable = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "node-config", "get", NODE], capture_output=True,
        text=True, timeout=60, env={**env, "TESSERA_STATE_DIR": str(state)})  # fmt: skip
    assert by_variable.returncode == 0, by_variable.stderr
    assert by_variable.stdout == got.stdout
    nowhere = subprocess.run(  # a NATS URL where nothing listens
        [sys.executable, "-m", "tessera_cli", "node-config", "get", NODE], capture_output=True,
        text=True, timeout=60, env={**env, "NATS_URL": f"nats://127.0.0.1:{free_port()}"})
    assert nowhere.returncode == 1 and "Traceback" not in nowhere.stderr
    assert nowhere.stderr.startswith("error: cannot reach NATS") and \
        len(nowhere.stderr.strip().splitlines()) == 1  # fmt: skip


def test_get_pods_shows_what_limits_set_changed(state: Path) -> None:
    as_json = json.loads(tessera(state, "get", "pods", "first", "-o", "json").stdout)
    [[grant]] = as_json[0]["gpus"]
    changed = tessera(state, "limits", "set", NODE, "default/first", "main", "--memory", "2000")
    assert changed.returncode == 0, changed.stdout + changed.stderr

    def shown() -> str | None:
        listing = tessera(state, "get", "pods").stdout
        cell = f"{short_uuid(grant['uuid'])}:2000MiB/30%"
        return listing if cell in listing else None

    wait_for("`tessera get pods` to show the new limit", shown, 30)


def test_describe_explains_a_pod_that_cannot_fit(state: Path) -> None:
    manifest = state.parent / "big.yaml"
    manifest.write_text(POD.format(name="too-big", mem=7000))  # 2 × 8000 MiB, one holds 3000
    assert tessera(state, "apply", "-f", str(manifest)).returncode == 0
    manifest.write_text(POD.format(name="never", mem=9000))
    assert tessera(state, "apply", "-f", str(manifest)).returncode == 0

    def explained() -> str | None:
        out = tessera(state, "describe", "pod", "never").stdout
        return out if "FilteringFailed" in out and "Scheduling:" in out else None

    out = wait_for("the scheduler's explanation", explained)
    # In words, with the figures (the bigger GPU has 8000 - 2000 MiB left) and HAMi's code.
    assert "2 of 2 GPUs: not enough memory (needs 9000 MiB, best has 6000; " \
           "CardInsufficientMemory)" in out, out
    assert f"{NODE}:" in out


def test_events_and_quota_find_nats_from_the_state_dir(state: Path) -> None:
    events = tessera(state, "events", "--no-follow", "--json")
    assert events.returncode == 0, events.stderr
    lines = [json.loads(line) for line in events.stdout.splitlines()]
    assert any(e.get("name") == "first" and e.get("action") == "bound" for e in lines)
    quotas = tessera(state, "quota", "list")
    assert quotas.returncode == 0, quotas.stderr


def test_a_second_stack_on_the_same_state_dir_is_refused(state: Path) -> None:
    for args in (["up"], ["up", "--wait"]):
        again = tessera(state, *args, "--free-ports")
        assert again.returncode == 1 and "already running" in again.stderr, again.stderr


def _stuck(state: Path, pid: int) -> str:
    """What a stack that did not stop was doing: its process state, its log, its children's."""
    def read(path: Path, tail: int = 1500) -> str:
        try:
            return path.read_text(errors="replace")[-tail:]
        except OSError as error:
            return str(error)

    proc = Path(f"/proc/{pid}")
    lines = [f"state: {read(proc / 'status', 4000).split('State:')[-1].splitlines()[0].strip()}",
             f"wchan: {read(proc / 'wchan')}", f"up.log: {read(state / 'logs' / 'up.log')}"]
    lines += [f"{log.name}: {read(log, 600)}" for log in sorted((state / "logs").glob("*.log"))
              if log.name != "up.log"]
    return "\n".join(lines)


def test_ctrl_c_stops_every_child_cleanly(state: Path) -> None:
    info = json.loads((state / "stack.json").read_text())
    pid = int(info["pid"])
    os.killpg(pid, signal.SIGINT)  # what a terminal sends the foreground process group
    deadline = time.monotonic() + 60
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"tessera up did not stop: {_stuck(state, pid)}"
        time.sleep(0.2)
    log = (state / "logs" / "up.log").read_text()
    assert "tessera: stopped" in log, log[-2000:]
    statuses = [line.strip() for line in log.split("tessera: stopping")[-1].splitlines()
                if line.startswith("  ")]
    assert statuses and all(s.endswith("exited (0)") for s in statuses), statuses
    assert not (state / "stack.json").exists()
    for path in (state / "logs").glob("*.log"):
        assert "Traceback" not in path.read_text(errors="replace"), path
    assert tessera(state, "down").stdout.strip().endswith("nothing to stop")
