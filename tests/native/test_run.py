"""`tessera run`: a local command under libvgpu, no Kubernetes."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import MiB, base_env


def run(native, tmp_path, args, stdin="", **env):
    e = base_env()
    e.update(
        TESSERA_LIBVGPU=str(native.lib),
        LD_LIBRARY_PATH=str(native.fake),
        FAKE_CUDA_STATE=str(tmp_path / "gpu"),
    )
    if native.san:
        e["LD_PRELOAD"] = native.preload.split()[0]  # the ASan runtime must come first
        e["ASAN_OPTIONS"] = "detect_leaks=0"
    e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "tessera_cli", "run", *args],
        input=stdin,
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_tessera_run_limits_a_command(native, tmp_path):
    script = "init\ninfo\nalloc plain 1048576000\nalloc plain 1048576000\nburn 1 k_1000us\n"
    out = run(
        native,
        tmp_path,
        ["--gpumem", "1500", "--gpucores", "30", "--", str(native.bin / "cuctl")],
        script,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines[1]["total"] == 1500 * MiB
    assert lines[2]["ok"] and not lines[3]["ok"]
    r = lines[4]
    if not native.san:
        shares = subprocess.run(
            [
                str(native.bin / "fkstat"),
                str(tmp_path / "gpu"),
                "0",
                str(r["t0"]),
                str(r["t1"]),
                "500000000",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert all(abs(float(s) * 100 - 30) <= 5 for s in shares), shares
    assert "peak 1000 MiB of 1500 MiB, 1 refused" in out.stderr


def test_tessera_run_shares_a_state_dir_and_keeps_exit_codes(native, tmp_path):
    state = tmp_path / "state"
    first = run(
        native,
        tmp_path,
        ["-q", "--gpumem", "1000", "--state-dir", str(state), "--", "sh", "-c", "exit 7"],
    )
    assert first.returncode == 7
    assert (state / "limits" / "limits").exists()
    missing = run(native, tmp_path, ["-q", "--", "/nonexistent/cmd"])
    assert missing.returncode == 127
