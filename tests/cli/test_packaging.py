"""The project builds without packaging warnings (what `make demo` shows on a fresh clone),
and the wheel holds the CLI package, its console script and the data the services read."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def test_the_wheel_builds_quietly_and_holds_the_cli(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the tracked files")
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    source = tmp_path / "src"
    for name in tracked:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path / "out"
    out.mkdir()
    build = subprocess.run(
        [sys.executable, "-W", "always", "-c",
         "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))",
         str(out)],
        cwd=source, capture_output=True, text=True, timeout=200,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    warnings = [line for line in (build.stdout + build.stderr).splitlines()
                if re.search(r"\w+Warning\b|is absent from the `packages`", line)]
    assert warnings == [], "\n".join(warnings)
    wheel = next(out.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names
                            if n.endswith("entry_points.txt"))
    assert "tessera_cli/app.py" in names and "tessera_cli/stack.py" in names
    assert not any(n.startswith(("tessera/cli/", "tessera/stack")) for n in names)
    assert "tessera/kubeapi/protos/deviceplugin/v1beta1/api.proto" in names
    assert "tessera/metrics/static/app.js" in names
    assert "tessera = tessera_cli.app:main" in entry_points
