"""The build: -Werror with either header source, one symbol table, and the whole native suite
again under AddressSanitizer and (one program) under valgrind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from .conftest import LIBVGPU_DIR, ROOT, TESTS_DIR

HOOKS_DEF = LIBVGPU_DIR / "src" / "hooks.def"


def hooked_names() -> set[str]:
    text = HOOKS_DEF.read_text()
    return set(re.findall(r"^TV_(?:CU|NVML)\((\w+),", text, re.M))


def exported(lib) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}


def test_exports_are_exactly_the_table(native):
    assert exported(native.lib) == hooked_names() | {"dlsym", "dlvsym", "dlmopen"}


@pytest.mark.skipif(bool(os.environ.get("LIBVGPU_TEST_SAN")),
                    reason="a plain build, the same as in the plain suite")
def test_builds_with_pip_headers_only(tmp_path):
    """A fresh machine has no CUDA toolkit: the pip packages' headers are enough."""
    out = subprocess.run(
        [
            "make",
            "-s",
            "-j4",
            "-C",
            str(LIBVGPU_DIR),
            f"BUILD={tmp_path}",
            "CUDA_HOME=/nonexistent",
            f"PYTHON={sys.executable}",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert exported(tmp_path / "libvgpu.so") == hooked_names() | {"dlsym", "dlvsym", "dlmopen"}


@pytest.mark.timeout(1800)
@pytest.mark.skipif(bool(os.environ.get("LIBVGPU_TEST_SAN")), reason="already the ASan run")
def test_native_suite_under_asan():
    """Every native test but the timing ones, against ASan builds of libvgpu, fakes and programs
    (leaks included: LeakSanitizer fails a program that leaks)."""
    env = dict(os.environ, LIBVGPU_TEST_SAN="address")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not timing and not valgrind",
            str(TESTS_DIR),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout


VALGRIND_SCRIPT = """init
alloc plain 314572800
alloc pitch 314572800
alloc plain 314572800
info
forkinfo
nvml
nvml2
free 0
alloc async 1048576
free 3
pool_create
alloc pool 1048576
free 4
pool_trim 0
pool_destroy
alloc vmm 2097152
map 5 2097152
free 6
free 5
alloc array 1048576
free 7
alloc mipmap 1048576
free 8
alloc graphnode 1048576
free 9
alloc ctx 0
free 10
burn 0.3 k_1000us kernel
burn 0.2 k_1000us graph
"""


@pytest.mark.valgrind
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="no valgrind")
@pytest.mark.skipif(bool(os.environ.get("LIBVGPU_TEST_SAN")), reason="not with ASan")
def test_valgrind_memcheck_clean(container, native):
    from tessera import region

    from .conftest import MiB

    container.seal(
        region.DeviceLimit("", 1000 * MiB, 30), scrub_on_free=True, ctx_charge_bytes=64 * MiB
    )
    env = container.env()
    preload = env.pop("LD_PRELOAD")
    env["LD_PRELOAD"] = preload
    out = subprocess.run(
        [
            "valgrind",
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            "--show-leak-kinds=definite",
            "-q",
            str(native.bin / "cuctl"),
        ],
        input=VALGRIND_SCRIPT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    lines = out.stdout.splitlines()
    assert len(lines) == VALGRIND_SCRIPT.count("\n")
    assert '"ok": false' not in "\n".join(lines[:-2]), out.stdout
