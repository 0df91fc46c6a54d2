"""docker-compose.yml runs NATS with the per-service identities of tessera/bus_permissions.py:
the `nats-auth` job generates the server's authorization block and one password volume per
identity; each service mounts only its own. The job's command is also run here, against a real
nats-server, to show the generated files let each service in as itself and nobody else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError
from test_compose import run_compose

from tessera import bus_permissions as bp
from tessera.settings import NatsSettings
from tessera_cli.nats_embedded import EmbeddedNats

BUS_SERVICES = {
    "admission": (bp.ADMISSION, None),
    "scheduler": (bp.SCHEDULER, None),
    "quota": (bp.QUOTA, None),
    "metrics": (bp.METRICS, None),
    "node-agent-0": (bp.NODE_AGENT, "sim-node-0"),
    "node-agent-1": (bp.NODE_AGENT, "sim-node-1"),
}


@pytest.fixture(scope="module")
def resolved() -> dict:
    result = run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (volume source, read-only) of a service's named volumes."""
    return {v["target"]: (v.get("source", ""), bool(v.get("read_only")))
            for v in service.get("volumes", []) if v["type"] == "volume"}


def job_volumes(resolved: dict) -> dict[str, str]:
    job = resolved["services"]["nats-auth"]
    return {target: source for target, (source, _) in mounts(job).items()}


def test_nats_loads_the_generated_authorization(resolved: dict) -> None:
    nats_service = resolved["services"]["nats"]
    command = nats_service["command"]
    conf = command[command.index("-c") + 1]
    auth_dir = str(Path(conf).parent)
    source, read_only = mounts(nats_service)[auth_dir]
    assert read_only
    assert job_volumes(resolved)[auth_dir] == source, "nats reads what the job wrote"
    assert nats_service["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    job = resolved["services"]["nats-auth"]["entrypoint"]
    assert job[:2] == ["tessera", "nats-config"]
    assert job[job.index("--out") + 1] == auth_dir
    # Every simulated node agent has its identity in the block.
    nodes = {job[i + 1] for i, arg in enumerate(job) if arg == "--node"}
    agents = {s["environment"]["TESSERA_NODE_NAME"] for n, s in resolved["services"].items()
              if n.startswith("node-agent")}
    assert nodes == agents


def test_each_service_gets_only_its_own_credential(resolved: dict) -> None:
    services = resolved["services"]
    job = job_volumes(resolved)
    cred_root = Path(services["nats-auth"]["entrypoint"][
        services["nats-auth"]["entrypoint"].index("--password-files") + 1])
    secret_volumes = {source for target, source in job.items()}
    for name, (role, node) in BUS_SERVICES.items():
        env = services[name]["environment"]
        user = bp.user_name(role, node)
        assert env["NATS_USER"] == user, name
        assert "NATS_PASSWORD" not in env, f"{name}: the password belongs in a file"
        password_dir = str(Path(env["NATS_PASSWORD_FILE"]).parent)
        own = mounts(services[name])
        source, read_only = own[password_dir]
        assert read_only, name
        assert source == job[str(cred_root / user)], f"{name} mounts another identity's password"
        others = {s for s, _ in own.values()} & secret_volumes
        assert others == {source}, f"{name} also mounts {others - {source}}"
    # Nothing else (kube-sim, certs) sees a credential.
    for name, service in services.items():
        if name in BUS_SERVICES or name in ("nats", "nats-auth"):
            continue
        assert not ({s for s, _ in mounts(service).values()} & secret_volumes), name
        assert "NATS_PASSWORD" not in service.get("environment", {}), name


def run_job(resolved: dict, root: Path) -> dict[str, Path]:
    """Run the nats-auth job's command here, its volumes as directories under root."""
    job = job_volumes(resolved)
    args = list(resolved["services"]["nats-auth"]["entrypoint"][1:])
    owner = args.index("--owner")
    del args[owner:owner + 2]  # not root here; ownership is the container's business
    args = [str(root) + a if a.startswith(("/nats-auth", "/nats-cred")) else a for a in args]
    result = subprocess.run([sys.executable, "-m", "tessera_cli", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return {target: root / target.lstrip("/") for target in job}


async def test_the_job_output_lets_each_service_in_as_itself(resolved: dict,
                                                             tmp_path: Path) -> None:
    paths = run_job(resolved, tmp_path)
    services = resolved["services"]
    conf = services["nats"]["command"][services["nats"]["command"].index("-c") + 1]
    server = EmbeddedNats(auth_config=(tmp_path / conf.lstrip("/")).read_text())
    server.start()
    try:
        for name in BUS_SERVICES:
            env = services[name]["environment"]
            target = str(Path(env["NATS_PASSWORD_FILE"]).parent)
            source = mounts(services[name])[target][0]
            host_dir = next(paths[t] for t, s in job_volumes(resolved).items() if s == source)
            password_file = host_dir / Path(env["NATS_PASSWORD_FILE"]).name
            assert oct(password_file.stat().st_mode & 0o777) == "0o400"
            creds = NatsSettings(NATS_URL=server.url, NATS_USER=env["NATS_USER"],
                                 NATS_PASSWORD_FILE=str(password_file))
            client = await nats.connect(server.url, user=creds.user,
                                        password=creds.resolved_password(),
                                        allow_reconnect=False, connect_timeout=5)
            await client.close()
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(server.url, allow_reconnect=False, connect_timeout=5,
                               max_reconnect_attempts=0)
    finally:
        server.cleanup()
