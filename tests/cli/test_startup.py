"""Start-up: a command imports only what it runs (speed figures: bench/cli.py, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera_cli.app import COMMANDS, build_app
from tessera_cli.group import LazyGroup

PROBE = """
import json, sys
sys.argv = ["tessera", *json.loads(sys.argv[1])]
from tessera_cli.app import main
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""
HEAVY = ("nats", "pydantic", "httpx", "rich", "cryptography", "kubernetes", "matplotlib")


def loaded(*args: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)],
                            capture_output=True, text=True, timeout=60)
    return set(json.loads(result.stderr.strip().splitlines()[-1]))


def test_help_imports_no_command_module() -> None:
    modules = loaded("--help")
    assert sorted(m for m in modules if m.startswith("tessera_cli.")) == ["tessera_cli.app"]
    assert not [m for m in modules if m.split(".")[0] in (*HEAVY, "typer")]


def test_the_quick_help_is_what_the_framework_prints() -> None:
    from typer.testing import CliRunner

    from tessera_cli.app import top_level_help

    shown = CliRunner().invoke(build_app(), ["--help"], terminal_width=80)
    assert shown.exit_code == 0
    assert shown.output == top_level_help() + "\n"


def test_get_pods_imports_its_module_and_no_heavy_library(tmp_path) -> None:
    from tessera.kube_sim.kubeconfig import write_kubeconfig

    from tessera_cli.nats_embedded import free_port

    # The stack's kubeconfig as kube-sim writes it, its API away: read, then asked.
    write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}")
    modules = loaded("get", "pods", "--state-dir", str(tmp_path))
    assert "tessera_cli.kube" in modules
    commands = {m for m in modules if m.startswith("tessera_cli.")}
    assert "tessera_cli.get" in commands
    assert not commands & {"tessera_cli.up", "tessera_cli.events", "tessera_cli.quota",
                           "tessera_cli.sim", "tessera_cli.certs", "tessera_cli.stack",
                           "tessera_cli.pods"}
    # Read without the CLI framework, the YAML parser or the HTTP/TLS modules (kube-sim's
    # kubeconfig is JSON; a plain-HTTP GET is one socket exchange): bench/get_pods_vs_kubectl.py
    assert not [m for m in modules
                if m.split(".")[0] in (*HEAVY, "typer", "click", "yaml", "ssl")], \
        "heavy imports in get pods"  # fmt: skip


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_help_summary_is_the_commands_own(name: str) -> None:
    """`tessera --help` shows the table's line without importing; it must say what the
    command itself says."""
    import typer

    group = typer.main.get_group(build_app())
    assert isinstance(group, LazyGroup)
    command = group.get_command(None, name)
    assert command is not None, f"{COMMANDS[name].module} registers no {name!r}"
    assert command.get_short_help_str(limit=1000) == COMMANDS[name].help
