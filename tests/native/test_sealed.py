"""The tenant cannot change its limits: not with env vars, not with its own limits directory,
not by pointing at another region, not by editing the region."""

from __future__ import annotations

import ctypes
import subprocess
import sys

from tessera import region

from .conftest import LIBVGPU_DIR, Cuctl, MiB

LIMIT = 1000 * MiB
CHUNK = 300 * MiB


def test_sealed_limits_win_over_everything_the_tenant_sets(native, cluster, tmp_path):
    sealed = tmp_path / "sealed"
    build = tmp_path / "build"
    # a libvgpu whose sealed directory is ours (the real one is /run/tessera/limits)
    out = subprocess.run(
        ["make", "-s", "-j4", "-C", str(LIBVGPU_DIR), f"BUILD={build}", f"SAN={native.san}",
         f"PYTHON={sys.executable}", f'CFLAGS=-O2 -DTSR_SEALED_LIMITS_DIR=\\"{sealed}\\"'],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    k = cluster.container()
    region.prepare_region_file(k.region_path)
    region.seal_limits(
        sealed,
        region.ContainerLimits(
            devices=(region.DeviceLimit("", LIMIT),), region_path=str(k.region_path)
        ),
    )
    tenant_dir = tmp_path / "tenant-limits"
    region.seal_limits(
        tenant_dir,
        region.ContainerLimits(
            devices=(region.DeviceLimit("", 100 << 30),),
            region_path=str(tmp_path / "tenant-region"),
        ),
    )
    env = k.env()
    env["LD_PRELOAD"] = native.preload.replace(str(native.lib), str(build / "libvgpu.so"))
    env.update(
        TESSERA_LIMITS_DIR=str(tenant_dir),
        CUDA_DEVICE_MEMORY_LIMIT_0="100g",
        CUDA_DEVICE_MEMORY_LIMIT="100g",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "tenant-region-2"),
    )
    c = Cuctl(native.bin / "cuctl", env, tmp_path / "cuctl.stderr")
    try:
        assert c("init")["ok"]
        assert c("info")["total"] == LIMIT
        assert [c(f"alloc plain {CHUNK}")["ok"] for _ in range(4)] == [True, True, True, False]
        assert k.used() == 3 * CHUNK  # accounted in the region the agent named
        assert not (tmp_path / "tenant-region").exists()
        assert not (tmp_path / "tenant-region-2").exists()
    finally:
        c.close()


def test_editing_the_region_does_not_raise_the_limit(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl()
    c("init")
    assert c(f"alloc plain {3 * CHUNK}")["ok"]
    # the tenant writes a huge limit and zero usage into the (writable) region
    off = region.RegionC.dev.offset
    with open(container.region_path, "r+b") as f:
        f.seek(off + region.RegionDeviceC.limit_bytes.offset)
        f.write(ctypes.c_uint64(1 << 50))
    assert not c(f"alloc plain {CHUNK}")["ok"]
    c.close()
