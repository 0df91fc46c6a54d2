"""Python programs reach the driver through cuda-bindings (dlsym + cuGetProcAddress) and pynvml
(ctypes dlsym): both see and obey the container's limits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tessera import region

from .conftest import MiB
from .windows import SEC, assert_near, shares

pytest.importorskip("cuda.bindings.driver")
pytest.importorskip("pynvml")

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from cuda.bindings import driver as cu
    import pynvml

    def ok(r):
        assert r[0] == cu.CUresult.CUDA_SUCCESS, r
        return r[1] if len(r) == 2 else r[1:]

    out = {}
    ok(cu.cuInit(0) + (None,))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx) + (None,))
    out["info"] = [int(x) for x in ok(cu.cuMemGetInfo())]
    out["total_mem"] = int(ok(cu.cuDeviceTotalMem(dev)))
    err, p1 = cu.cuMemAlloc(600 << 20)
    err2, p2 = cu.cuMemAlloc(600 << 20)
    out["alloc"] = [int(err), int(err2)]
    stream = ok(cu.cuStreamCreate(0))
    err3, p3 = cu.cuMemAllocAsync(600 << 20, stream)
    out["alloc_async"] = int(err3)
    pynvml.nvmlInit()
    m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    out["nvml"] = [m.total, m.used, m.free]
    mod = ok(cu.cuModuleLoadData(b"fake"))
    fn = ok(cu.cuModuleGetFunction(mod, b"k_1000us"))
    out["t0"] = time.monotonic_ns()
    n = 0
    while time.monotonic_ns() - out["t0"] < float(sys.argv[1]) * 1e9:
        r = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0)
        assert r[0] == cu.CUresult.CUDA_SUCCESS, r
        n += 1
        if n % 8 == 0:
            ok(cu.cuStreamSynchronize(stream) + (None,))
    ok(cu.cuCtxSynchronize() + (None,))
    out["t1"] = time.monotonic_ns()
    out["launches"] = n
    print(json.dumps(out))
    """
)


def test_cuda_bindings_and_pynvml_obey_the_limits(cluster, request):
    k = cluster.container()
    k.seal(region.DeviceLimit("", 1000 * MiB, 30))
    script = k.dir / "prog.py"
    script.write_text(SCRIPT)
    seconds = "0.3" if k.native.san else "2"
    extra = {"ASAN_OPTIONS": "detect_leaks=0"} if k.native.san else {}
    # Watched for CPU waits like every launcher: on a loaded host the Python loop may wait for a
    # CPU long enough for the fake GPU to idle, which no limiter can help.
    proc = subprocess.Popen(
        [sys.executable, str(script), seconds], env=k.env(**extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    cluster.cpu.watch(proc.pid)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    r = json.loads(stdout.splitlines()[-1])
    assert r["info"] == [1000 * MiB, 1000 * MiB]
    assert r["total_mem"] == 1000 * MiB
    assert r["alloc"] == [0, 2]  # the second 600 MiB is refused
    assert r["alloc_async"] == 2
    assert r["nvml"] == [1000 * MiB, 600 * MiB, 400 * MiB]
    if not k.native.san:
        assert_near(shares(cluster, 0, r["t0"], r["t1"], SEC // 2, [proc.pid]), 30)
