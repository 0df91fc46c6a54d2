"""The layout shows the architecture (DESIGN §6): services import only the shared package."""

from __future__ import annotations

import ast
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    "admission": "tessera.admission", "scheduler": "tessera.scheduler",
    "quota": "tessera.quota", "node-agent": "tessera.node_agent",
    "metrics": "tessera.metrics", "kube-sim": "tessera.kube_sim",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder, package", SERVICES.items())
def test_service_folder_is_its_package(folder: str, package: str) -> None:
    module = importlib.import_module(package)
    assert Path(module.__file__).parent == ROOT / "services" / folder


@pytest.mark.parametrize("folder", SERVICES)
def test_a_service_never_imports_another_service(folder: str) -> None:
    own = SERVICES[folder]
    others = [p for f, p in SERVICES.items() if f != folder]
    for path in (ROOT / "services" / folder).rglob("*.py"):
        for name in imported_modules(path):
            assert not any(name == o or name.startswith(o + ".") for o in others), (
                f"{path.relative_to(ROOT)} imports {name}: services talk over NATS, not imports"
            )
            assert not name.startswith("services"), f"{path} imports {name}"
        assert own  # the folder maps to a package


def test_shared_package_imports_no_service() -> None:
    for path in (ROOT / "tessera").rglob("*.py"):
        for name in imported_modules(path):
            assert not any(name == p or name.startswith(p + ".") for p in SERVICES.values()), (
                f"{path.relative_to(ROOT)} imports service {name}"
            )


@pytest.mark.parametrize("package", SERVICES.values())
def test_every_service_lists_its_settings(package: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", package, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "TESSERA_" in result.stdout
    # kube-sim plays Kubernetes and never touches the bus; every Tessera service does.
    if package != "tessera.kube_sim":
        assert "NATS_URL" in result.stdout


def test_a_service_stops_cleanly_on_sigterm(nats_url: str) -> None:
    env = {**os.environ, "NATS_URL": nats_url, "TESSERA_CLUSTER": "none"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera.quota"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if '"started"' in line or not line:
                break
        assert '"started"' in line, "the service logs a JSON 'started' line"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


# The `tessera` command and the local-stack runner: installed with the project, but no part of
# the contract. Nothing a service runs may need them (nor their heavy imports).
CLI_PACKAGE = "tessera_cli"


def test_cli_package_is_separate_from_the_contract() -> None:
    assert (ROOT / CLI_PACKAGE / "app.py").is_file()
    assert not (ROOT / "tessera" / "cli").exists()
    assert not (ROOT / "tessera" / "stack.py").exists()


@pytest.mark.parametrize("folder", ["tessera", *(f"services/{s}" for s in SERVICES)])
def test_no_service_and_no_contract_module_imports_the_cli(folder: str) -> None:
    for path in (ROOT / folder).rglob("*.py"):
        for name in imported_modules(path):
            assert name != CLI_PACKAGE and not name.startswith(CLI_PACKAGE + "."), (
                f"{path.relative_to(ROOT)} imports {name}: services and the shared contract "
                f"must not depend on the CLI package"
            )


def test_importing_every_service_loads_no_cli_module() -> None:
    """Also through the back door: a contract module that imports it indirectly."""
    code = (
        "import sys, importlib, pkgutil\n"
        f"for name in {sorted(SERVICES.values())!r}:\n"
        "    pkg = importlib.import_module(name)\n"
        "    for m in pkgutil.iter_modules(pkg.__path__, name + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        f"print(','.join(sorted(n for n in sys.modules if n.split('.')[0] == {CLI_PACKAGE!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"a service loads {result.stdout.strip()}"
