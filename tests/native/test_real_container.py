"""libvgpu in a real OCI container (runc, through podman), mounted the way the node agent's
Allocate asks kubelet and containerd to: /etc/ld.so.preload a read-only file bind naming
/usr/local/vgpu/libvgpu.so, the library read-only, the sealed limits directory read-only, the
region read-write; a non-root user (65534), no capabilities, no new privileges, no network. The
fake driver stands in for the GPU (mounted as a host's driver libraries are). The same tenant as
test_tenant.py's unshare simulation, in a container: its slice is enforced, and it can neither
see past nor raise its limits.

Needs the container engine (scripts/container-engine.sh, root and apt) and an image: the one
`make image` builds (tests/compose builds it) or its Debian base; skipped, saying which, without.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, SAN
from .tenant_rig import CHUNK, LIMIT, Tenant

# Decided before the fixtures: under ASan, the tenant's build and the engine's setup were made
# (~20 s on a busy host) for two tests that then skipped.
pytestmark = pytest.mark.skipif(bool(SAN), reason="the sanitizer runtime is not mounted into "
                                "the container")  # fmt: skip

IMAGES = ("ghcr.io/tessera/tessera:0.1.0", "localhost/tessera-python-base:3.11-bookworm")
LIBVGPU_IN_CONTAINER = "/usr/local/vgpu/libvgpu.so"  # charts' libvgpu.containerPath
ENV_KEYS = ("LD_LIBRARY_PATH", "FAKE_CUDA_STATE", "TV_TEST_MODE", "LIBCUDA_LOG_LEVEL",
            "CUDA_DEVICE_MEMORY_LIMIT", "TESSERA_LIMITS_DIR", "CUDA_DEVICE_MEMORY_SHARED_CACHE")


@pytest.fixture(scope="module")
def engine_image() -> str:
    setup = subprocess.run([str(ROOT / "scripts/container-engine.sh"), "setup"],
                           capture_output=True, text=True, timeout=600)
    if setup.returncode == 3:
        pytest.skip(f"no container engine here: {setup.stderr.strip()}")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    for image in IMAGES:
        if subprocess.run(["podman", "image", "exists", image]).returncode == 0:
            return image
    pytest.skip(f"no image to run: `make image` builds {IMAGES[0]}")


def container(t: Tenant, image: str, tmp: Path) -> tuple[str, ...]:
    """`podman run` of the tenant's container, as kubelet would start it after Allocate."""
    preload = tmp / "ld.so.preload"
    if not preload.exists():
        preload.write_text(LIBVGPU_IN_CONTAINER + "\n")
        preload.chmod(0o444)
    env = t.env()
    mounts = [f"{preload}:/etc/ld.so.preload:ro", f"{t.lib}:{LIBVGPU_IN_CONTAINER}:ro",
              f"{t.base}/sealed:{t.base}/sealed:ro",
              f"{t.base}/region:{t.base}/region",
              f"{t.base}/gpu:{t.base}/gpu",
              f"{t.native.fake}:{t.native.fake}:ro",
              f"{t.native.bin}:{t.native.bin}:ro"]
    return ("podman", "run", "--rm", "-i", "--user", "65534:65534", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--network", "none",
            *(a for m in mounts for a in ("-v", m)),
            *(a for k in ENV_KEYS if k in env for a in ("-e", f"{k}={env[k]}")),
            image)


def test_the_slice_is_enforced_in_a_real_container(tenant, engine_image, tmp_path):
    c = tenant.cuctl(prefix=container(tenant, engine_image, tmp_path))
    assert c("init", timeout=60)["ok"]
    assert c("info")["total"] == LIMIT  # the sealed limit, not CUDA_DEVICE_MEMORY_LIMIT=100g
    assert [c(f"alloc plain {CHUNK}")["ok"] for _ in range(4)] == [True, True, True, False]
    assert tenant.used() == 3 * CHUNK  # charged in the region the node agent reads
    c.close()


def test_a_process_in_the_container_cannot_see_past_or_raise_its_limits(
    tenant, engine_image, tmp_path,
) -> None:
    code = (
        "import os\n"
        "print('uid', os.getuid())\n"
        f"for p in ('/etc/ld.so.preload', '{LIBVGPU_IN_CONTAINER}',\n"
        f"          '{tenant.base}/sealed/limits'):\n"
        "    try:\n        open(p, 'r+b')\n        print('writable', p)\n"
        "    except OSError:\n        pass\n"
        f"for p in ('/etc/ld.so.preload', '{tenant.base}/sealed/x'):\n"
        "    try:\n        open(p + '.new', 'w')\n        print('created beside', p)\n"
        "    except OSError:\n        pass\n"
        "print('maps libvgpu', 'libvgpu.so' in open('/proc/self/maps').read())\n"
    )
    result = subprocess.run([*container(tenant, engine_image, tmp_path), "python3", "-c", code],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["uid 65534", "maps libvgpu True"], result.stdout
