"""The real container engine for the tests that run containers: podman with runc, set up by the
project's own scripts (scripts/container-engine.sh installs it as root from Debian packages),
and the one image, built by `make image` (layers and the Debian base are kept by tag between
runs, so a second run only rebuilds what changed). Where the engine cannot exist (not root, no
apt-get), the tests that need it are skipped and say why."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"ghcr.io/tessera/tessera:{VERSION}"
PODMAN_SOCKET = "unix:///run/podman/podman.sock"
CANNOT = 3  # scripts/container-engine.sh: the engine cannot be set up on this machine


def engine_or_skip() -> None:
    """podman configured and its Docker API served, or the test skipped with the reason."""
    if os.geteuid() != 0:
        pytest.skip("the container engine is set up and run as root (scripts/container-engine.sh)")
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get: scripts/container-engine.sh installs podman from Debian packages")
    result = subprocess.run([str(ROOT / "scripts/container-engine.sh"), "service"],
                            capture_output=True, text=True, timeout=600)
    if result.returncode == CANNOT:
        pytest.skip(f"no container engine here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stdout + result.stderr


def build_image() -> float:
    """`make image` (seconds it took): the image the tests run is the one this tree builds. One
    build at a time on the machine (another worker's waits, then finds every layer built)."""
    started = time.monotonic()
    with open(Path(tempfile.gettempdir()) / "tessera-make-image.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(["make", "-s", "image", f"IMAGE={IMAGE}", "BUILDER=podman"],
                                cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return time.monotonic() - started


def podman(*args: str, timeout: float = 120,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr}"
    return result


def remove_projects_of_dead_runs(prefix: str) -> list[str]:
    """Compose projects named `<prefix><pid>` whose test process is gone: a run killed before its
    `compose down` (a timeout, a SIGKILL) leaves a whole stack running, which then takes CPU from
    every later test and benchmark on the machine. Removes their containers, networks and volumes;
    returns the projects removed. A live run's project (its pid exists) is left alone."""
    project_of = '{{ index .Labels "com.docker.compose.project" }}'
    listed = [*podman("ps", "-a", "--format", project_of, check=False).stdout.split(),
              *podman("volume", "ls", "--format", project_of, check=False).stdout.split()]
    removed = []
    for project in sorted(set(listed)):
        pid = project.removeprefix(prefix)
        if not project.startswith(prefix) or not pid.isascii() or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (or the pid was reused: leave it, never guess)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        label = f"label=com.docker.compose.project={project}"
        for kind, every in (("container", ["-a"]), ("network", []), ("volume", [])):
            ids = podman(kind, "ls", *every, "-q", "--filter", label, check=False).stdout.split()
            if ids:
                podman(kind, "rm", "-f", *ids, check=False)
        removed.append(project)
    return removed

