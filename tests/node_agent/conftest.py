"""Fixtures of the node agent tests: the fake NVML, short socket dirs, a kubelet stand-in."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def fake_nvml_lib() -> Iterator[Path]:
    """libnvidia-ml.so.1 built from fake_nvml.c (see its header for the config format)."""
    if not shutil.which("gcc"):
        pytest.skip("gcc is needed to build the fake NVML")
    out = Path(tempfile.mkdtemp(prefix="tsr-nvml-"))
    lib = out / "libnvidia-ml.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1",
         "-Wl,-Bsymbolic", "-o", str(lib), str(HERE / "fake_nvml.c")],
        check=True,
    )
    try:
        yield lib
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def region_writer() -> Iterator[Path]:
    """A C program that writes a usage region through tessera_region.h (as libvgpu would)."""
    if not shutil.which("gcc"):
        pytest.skip("gcc is needed to build the region writer")
    out = Path(tempfile.mkdtemp(prefix="tsr-rw-"))
    exe = out / "region_writer"
    include = HERE.parent.parent / "native" / "libvgpu" / "include"
    subprocess.run(
        ["gcc", "-Wall", "-Werror", f"-I{include}", "-o", str(exe), str(HERE / "region_writer.c")],
        check=True,
    )
    try:
        yield exe
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="tsr-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
