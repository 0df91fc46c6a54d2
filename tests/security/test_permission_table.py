"""The permission table itself: derived from tessera.bus, rendered into a config nats-server
accepts, the same in docs/security.md, and least privilege in its shape."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera import bus
from tessera import bus_permissions as bp
from tessera.security_doc import splice
from tessera_cli.app import build_app
from tessera_cli.nats_config import env_reference_config
from tessera_cli.nats_embedded import find_nats_server
from tessera_cli.stack_auth import StackAuth

ROOT = Path(__file__).resolve().parents[2]
NODES = ["gpu-1", "gpu.zone-b.2"]


def nats_server_accepts(config: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    path = tmp_path / "auth.conf"
    path.write_text(config)
    done = subprocess.run(
        [find_nats_server(), "-c", str(path), "-t"], capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=30,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout + done.stderr


def test_generated_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    assert "is valid" in nats_server_accepts(StackAuth.generate(NODES).server_config(), tmp_path)


def test_env_reference_config_needs_every_password_and_holds_none(tmp_path: Path) -> None:
    config = env_reference_config(NODES)
    users = [p.user for p in bp.identities(NODES)]
    env = {bp.password_env_var(u): f"pw-{i}" for i, u in enumerate(users)}
    nats_server_accepts(config, tmp_path, env)
    assert "pw-" not in config
    missing = dict(env)
    missing.pop(bp.password_env_var(bp.user_name(bp.NODE_AGENT, "gpu-1")))
    path = tmp_path / "missing.conf"
    path.write_text(config)
    done = subprocess.run([find_nats_server(), "-c", str(path), "-t"], capture_output=True,
                          text=True, env={**os.environ, **missing}, timeout=30)
    assert done.returncode != 0


def test_docs_security_md_has_the_current_table() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    assert splice(text) == text, "run `make docs`"


def writers_of(subject: str) -> set[str]:
    """Identities whose publish allow-list covers `subject` (token-wise match, as NATS does)."""
    def covers(pattern: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        for i, token in enumerate(p):
            if token == ">":
                return len(s) > i
            if i >= len(s) or (token != "*" and token != s[i]):
                return False
        return len(p) == len(s)

    return {p.user for p in bp.identities(NODES)
            if any(covers(x) for x in p.publish) and not any(covers(x) for x in p.publish_deny)}


def test_only_the_rightful_identities_may_write() -> None:
    scheduler, quota = bp.user_name(bp.SCHEDULER), bp.user_name(bp.QUOTA)
    gpu1 = bp.user_name(bp.NODE_AGENT, "gpu-1")
    assert writers_of(bp.kv_subject(bus.LEDGER_BUCKET, "gpu-1")) == {scheduler, gpu1}
    assert writers_of(bp.kv_subject(bus.NODES_BUCKET, "gpu-1")) == {gpu1}
    assert writers_of(bp.kv_subject(bus.QUOTA_BUCKET, "team-a")) == {quota}
    assert writers_of(bus.QUOTA_SET) == {bp.user_name(bp.ADMIN)}
    assert writers_of(bus.alloc_event_subject("gpu-1", "released")) == {scheduler}
    assert writers_of(bus.node_limits_subject("gpu-1")) == {bp.user_name(bp.ADMIN)}
    assert writers_of(bus.compute_event_subject("gpu-1", "reclaimed")) == {gpu1}
    assert writers_of(bus.usage_subject("gpu.zone-b.2")) == {
        bp.user_name(bp.NODE_AGENT, "gpu.zone-b.2")
    }


@pytest.mark.parametrize("verb", ["STREAM.DELETE", "STREAM.PURGE", "STREAM.MSG.DELETE",
                                  "CONSUMER.DELETE"])
def test_nobody_may_destroy_state(verb: str) -> None:
    for stream in bp.STREAMS:
        subject = f"$JS.API.{verb}.{stream}" + (".x" if verb == "CONSUMER.DELETE" else "")
        assert writers_of(subject) == set(), subject


def test_event_readers_only_read() -> None:
    reader = bp.permissions(bp.EVENTS_READER)
    assert not [s for s in reader.publish if not s.startswith(("$JS.API.", "$JS.ACK.", "$JS.FC."))]
    assert not reader.allow_responses


@pytest.mark.parametrize("node", [None, "", ">", "*", "a.>", "a b", "A", "-a", "a" * 254])
def test_a_node_agent_needs_a_real_node_name(node: str | None) -> None:
    """A wildcard or odd node name never becomes a permission (it would grant every node)."""
    with pytest.raises(ValueError):
        bp.permissions(bp.NODE_AGENT, node)


def test_cli_bundle_keeps_passwords_and_adds_nodes(tmp_path: Path) -> None:
    runner = CliRunner()
    first = runner.invoke(build_app(), ["nats-config", "--node", "gpu-1", "--out", str(tmp_path)])
    assert first.exit_code == 0, first.output
    before = json.loads((tmp_path / "passwords.json").read_text())
    again = runner.invoke(build_app(), ["nats-config", "--node", "gpu-1", "--node", "gpu-2",
                                        "--out", str(tmp_path)])
    assert again.exit_code == 0, again.output
    after = json.loads((tmp_path / "passwords.json").read_text())
    assert {k: after[k] for k in before} == before
    assert bp.user_name(bp.NODE_AGENT, "gpu-2") in after
    for name in ("passwords.json", "auth.conf", "secrets.yaml"):
        assert (tmp_path / name).stat().st_mode & 0o077 == 0
    assert "tessera-nats-node-gpu-2" in (tmp_path / "secrets.yaml").read_text()
    nats_server_accepts((tmp_path / "auth.conf").read_text(), tmp_path)


def test_cli_prints_the_table() -> None:
    shown = CliRunner().invoke(build_app(), ["nats-config", "--table"])
    assert shown.exit_code == 0
    assert shown.output == bp.markdown_table()


def test_cli_bundle_provisions_command_keys_with_the_passwords(tmp_path: Path) -> None:
    """Issue 34: each identity's Secret carries its signing key; Secret tessera-command-trust
    holds every public key, and a key kept across runs still verifies."""
    import base64
    import json

    import yaml

    from tessera import signing

    runner = CliRunner()
    assert runner.invoke(build_app(), ["nats-config", "--node", "gpu-1", "--out",
                                       str(tmp_path)]).exit_code == 0  # fmt: skip
    first = json.loads((tmp_path / "command-keys.json").read_text())
    assert runner.invoke(build_app(), ["nats-config", "--node", "gpu-1", "--node", "gpu-2",
                                       "--out", str(tmp_path), "--password-files",
                                       str(tmp_path / "creds")]).exit_code == 0  # fmt: skip
    keys = json.loads((tmp_path / "command-keys.json").read_text())
    assert {u: keys[u] for u in first} == first and "tessera-node-gpu-2" in keys
    docs = {d["metadata"]["name"]: d for d in
            yaml.safe_load_all((tmp_path / "secrets.yaml").read_text())}  # fmt: skip
    trust = signing.TrustStore.parse(
        base64.b64decode(docs["tessera-command-trust"]["data"]["trust.json"]).decode())
    pem = base64.b64decode(docs["tessera-nats-node-gpu-2"]["data"]["command-key"])
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(pem)
    signer = signing.signer_from_files("tessera-node-gpu-2", str(key_file))
    headers = signer.headers("tessera.quota.reserve", b"{}")
    verifier = signing.Verifier(trust)
    assert verifier.verify("tessera.quota.reserve", None, headers, b"{}") == "tessera-node-gpu-2"
    on_host = tmp_path / "creds" / "tessera-node-gpu-2" / "command.key"
    assert on_host.read_bytes() == pem and oct(on_host.stat().st_mode & 0o777) == "0o400"
