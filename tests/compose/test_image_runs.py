"""The one image, built here by `make image` and run by podman (runc): every console script
starts in it as its non-root user, it carries no compiler, and the node agent chart's
install-libvgpu step, run in it as the chart runs it, installs the image's libvgpu on the
"host" (a directory here) the way the node agent then mounts it into GPU containers."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from container_engine import ROOT, podman

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
NODE_AGENT = yaml.safe_load((ROOT / "charts/tessera-node-agent/values.yaml").read_text())
INSTALL_SCRIPT = ROOT / "charts/tessera-node-agent/files/install-libvgpu.sh"

pytestmark = pytest.mark.timeout(1500)


def test_every_console_script_starts_as_the_non_root_user(image: str) -> None:
    names = " ".join(sorted(SCRIPTS)) + " nats-server"
    result = podman("run", "--rm", image, "sh", "-c",
                    f'id -u; for s in {names}; do "$s" --help >/dev/null 2>&1 '
                    '|| echo "FAILED $s"; done; command -v gcc cc make || true', timeout=300)
    lines = result.stdout.split()
    assert lines[0] == "65532"
    assert "FAILED" not in result.stdout, result.stdout
    assert lines[1:] == [], f"compilers in the image: {lines[1:]}"


def test_the_chart_install_step_installs_the_images_libvgpu(image: str, tmp_path: Path) -> None:
    values = NODE_AGENT
    source, vgpu = values["libvgpu"]["sourcePath"], values["hostPaths"]["vgpu"]
    container_path = values["libvgpu"]["containerPath"]
    host = tmp_path / "vgpu"
    host.mkdir()
    security = values["securityContext"]
    args = ["run", "--rm", "--user", str(security["runAsUser"]), "--cap-drop", "ALL",
            "--read-only", "--security-opt", "no-new-privileges",
            "-v", f"{INSTALL_SCRIPT.parent}:/opt/tessera/install:ro", "-v", f"{host}:{vgpu}",
            "-e", f"LIBVGPU_SOURCE={source}", "-e", f"VGPU_DIR={vgpu}",
            "-e", f"LIBVGPU_CONTAINER_PATH={container_path}",
            image, "sh", "/opt/tessera/install/install-libvgpu.sh"]
    first = podman(*args)
    assert "install-libvgpu:" in first.stdout
    link = host / "libvgpu.so"
    assert link.is_symlink()
    installed = (host / link.readlink()).read_bytes()
    shipped = subprocess.run(["podman", "run", "--rm", image, "cat", source],
                             capture_output=True, timeout=120, check=True).stdout
    assert shipped and installed == shipped
    assert link.readlink().name == f"libvgpu.so.{hashlib.sha256(installed).hexdigest()[:16]}"
    assert (host / "ld.so.preload").read_text() == container_path + "\n"
    # Idempotent: a second run (a restarted pod) keeps the same file and link.
    podman(*args)
    assert sorted(p.name for p in host.iterdir()) == sorted(
        ["libvgpu.so", link.readlink().name, "ld.so.preload"])
    # The library exports the driver API libvgpu interposes, as the one built from this tree.
    nm = shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, "-D", "--defined-only", str(host / link.readlink())],
                                 capture_output=True, text=True, check=True).stdout
        assert " cuMemAlloc_v2" in symbols and " cuGetProcAddress" in symbols, symbols[:400]


def test_the_scheduler_in_the_image_resolves_names_natively(image: str) -> None:
    """The image's scheduler loads its native name resolver (without it kube-scheduler's node
    lists are resolved in numpy: exact, but about twice the CPU per call)."""
    probe = ("from tessera.scheduler.native_names import library, library_path; "
             "print(library_path(), library() is not None)")
    result = podman("run", "--rm", image, "python", "-c", probe, timeout=120)
    assert result.stdout.split() == ["/usr/local/lib/tessera/libtessera_names.so", "True"], (
        result.stdout + result.stderr)


def test_the_scheduler_in_the_image_has_its_native_refusal_steps(image: str) -> None:
    """The image's scheduler loads its native refusal steps (without them a refused pod's
    steps and groups are computed in numpy: exact, but more CPU per first refusal)."""
    probe = ("from tessera.scheduler.native_steps import NativeSteps, library_path; "
             "print(library_path(), NativeSteps.load() is not None)")
    result = podman("run", "--rm", image, "python", "-c", probe, timeout=120)
    assert result.stdout.split() == ["/usr/local/lib/tessera/libtessera_refusals.so", "True"], (
        result.stdout + result.stderr)
