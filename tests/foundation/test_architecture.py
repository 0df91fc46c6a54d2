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
