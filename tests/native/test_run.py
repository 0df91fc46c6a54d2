"""`tessera run`: a local command under libvgpu, no Kubernetes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from .conftest import CpuStarvation, MiB, base_env
from .windows import SEC, Shares, assert_near


def run_env(native, tmp_path, **env) -> dict[str, str]:
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
    return e


def run(native, tmp_path, args, stdin="", **env):
    return subprocess.run(
        [sys.executable, "-m", "tessera_cli", "run", *args],
        input=stdin,
        env=run_env(native, tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def spawn(native, tmp_path, args, **env) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tessera_cli", "run", *args],
        env=run_env(native, tmp_path, **env),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_tessera_run_limits_a_command(native, tmp_path):
    script = "init\ninfo\nalloc plain 1048576000\nalloc plain 1048576000\nburn 1 k_1000us\n"
    proc = spawn(
        native,
        tmp_path,
        ["--gpumem", "1500", "--gpucores", "30", "--", str(native.bin / "cuctl")],
    )
    # The launcher (tessera run's child) is watched for CPU waits like every launcher: on a
    # loaded host its queue may run dry, which no limiter can help (tests/native/windows.py).
    cpu = CpuStarvation()
    deadline = time.monotonic() + 60
    while not (launchers := children(proc.pid)) and proc.poll() is None:
        assert time.monotonic() < deadline, "tessera run started no command"
        time.sleep(0.005)
    for pid in launchers:
        cpu.watch(pid)
    try:
        stdout, stderr = proc.communicate(script, timeout=60)
    finally:
        cpu.stop()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
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
        starved = cpu.fractions(launchers, r["t0"], r["t1"], SEC // 2)
        assert_near(Shares([float(x) * 100 for x in shares], starved), 30)
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
