"""Pods as real OCI containers (issue 30): kube-sim's kubelet with
`TESSERA_KUBE_SIM_CONTAINER_RUNTIME=podman` runs a pod's container with runc, through podman,
given what the node agent's Allocate returned — /etc/ld.so.preload as a read-only file bind,
libvgpu, the sealed limits directory (with the lease socket) read-only, the region — and the
driver as the NVIDIA container toolkit would bring it: here the FAKE driver's libraries
(tests/native/fakes) mounted read-only, its shared state as the "device".

A pod asking `nvidia.com/gpumem: 1000` runs cuctl (a driver-API program, tests/native/progs) as
uid 65534 with an environment that asks for 100 GiB: its fourth 300 MiB allocation fails inside
the container, refused by the node agent's lease service, and the region on the host shows what
it holds. A process in it can write neither its limits directory, the limits, the preload file nor
the library. The container's exit is the pod's phase; deleting a pod stops and removes its
container.

Needs the container engine (scripts/container-engine.sh: root, apt, podman + runc) and an image
(`make image`'s or its Debian base); skipped, saying which, without.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tessera.node_agent.containers import REGION_CONTAINER_PATH

from tessera import region
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, start_stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGES = (f"ghcr.io/tessera/tessera:{VERSION}", "localhost/tessera-python-base:3.11-bookworm")
LIBVGPU = ROOT / "native" / "libvgpu" / "build" / "libvgpu.so"
NODE = "oci-a"
NODES = [SimNode(name=NODE, gpus=1, gpu_memory_mib=16384, gpu_model="NVIDIA A10")]
MiB = 1 << 20
LIMIT_MIB = 1000
CHUNK = 300 * MiB


@pytest.fixture(scope="module")
def engine_image() -> str:
    """podman configured (scripts/container-engine.sh, as tests/compose and tests/native set it
    up) and an image to run, or the module skipped saying which is missing."""
    if os.geteuid() != 0:
        pytest.skip("the container engine is set up and run as root (scripts/container-engine.sh)")
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get: scripts/container-engine.sh installs podman from Debian packages")
    setup = subprocess.run([str(ROOT / "scripts/container-engine.sh"), "setup"],
                           capture_output=True, text=True, timeout=600)
    if setup.returncode == 3:
        pytest.skip(f"no container engine here: {setup.stderr.strip()}")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    for image in IMAGES:
        if subprocess.run(["podman", "image", "exists", image]).returncode == 0:
            return image
    pytest.skip(f"no image to run: `make image` builds {IMAGES[0]}")


@pytest.fixture(scope="module")
def host() -> Iterator[Path]:
    """The node's side: cuctl and the fake driver (tests/native/Makefile), the fake GPU's
    state directory; readable by the container's uid, as a host's driver files are."""
    if not LIBVGPU.is_file():
        pytest.skip(f"libvgpu is not built ({LIBVGPU}): `make native`")
    base = Path(tempfile.mkdtemp(prefix="tsr-oci-e2e-"))
    build = base / "build"
    done = subprocess.run(
        ["make", "-s", "-C", str(ROOT / "tests" / "native"), f"BUILD={build}",
         f"PYTHON={sys.executable}", f"{build}/fake/libcuda.so.1",
         f"{build}/fake/libnvidia-ml.so.1", f"{build}/cuctl"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"the fake driver does not build here: {done.stderr[-400:]}")
    (base / "gpu").mkdir()
    (base / "hold").mkdir()
    for path, mode in ((base, 0o755), (build, 0o755), (build / "fake", 0o755),
                       (base / "gpu", 0o1777), (base / "hold", 0o1777)):
        path.chmod(mode)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def sim(engine_image: str, host: Path) -> Iterator[RunningStack]:
    stack = start_stack(NODES, env={
        "TESSERA_KUBE_SIM_CONTAINER_RUNTIME": "podman",
        "TESSERA_KUBE_SIM_CONTAINER_IMAGE": engine_image,
        "TESSERA_KUBE_SIM_CONTAINER_DRIVER_DIR": str(host / "build" / "fake"),
        "TESSERA_KUBE_SIM_CONTAINER_DEVICES": str(host / "gpu"),
    })
    yield next(stack)
    for _ in stack:
        pass


PROBE = (
    "import os\n"
    "print('probe uid', os.getuid())\n"
    "for p in ('/etc/ld.so.preload', '/usr/local/vgpu/libvgpu.so',\n"
    "          '/run/tessera/limits/limits'):\n"
    "    try:\n        open(p, 'r+b')\n        print('probe writable', p)\n"
    "    except OSError:\n        pass\n"
    "for p in ('/run/tessera/limits/limits.new', '/run/tessera/limits/lease.sock'):\n"
    "    try:\n        open(p + '.x', 'w')\n        print('probe created beside', p)\n"
    "    except OSError:\n        pass\n"
    "for p in ('/run/tessera/limits/lease.sock', '/run/tessera/limits/limits'):\n"
    "    try:\n        os.rename(p, p + '.moved')\n        print('probe moved', p)\n"
    "    except OSError:\n        pass\n"
    "print('probe maps libvgpu', 'libvgpu.so' in open('/proc/self/maps').read())\n"
)


def cuda_pod(name: str, host: Path) -> dict[str, Any]:
    """cuctl: init, info, four 300 MiB allocations; it holds them until /hold/<name> exists."""
    pod = gpu_pod(name, mem=LIMIT_MIB)
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["volumes"] = [
        {"name": "progs", "hostPath": {"path": str(host / "build")}},
        {"name": "hold", "hostPath": {"path": str(host / "hold")}},
    ]
    steps = "init\\ninfo\\n" + f"alloc plain {CHUNK}\\n" * 4
    script = (
        f"python3 -c \"$PROBE\" && "
        f"(printf '{steps}'; while [ ! -e /hold/{name} ]; do sleep 0.1; done; echo exit) "
        "| /opt/progs/cuctl"
    )
    container = pod["spec"]["containers"][0]
    container["command"] = ["/bin/sh", "-c", script]
    container["volumeMounts"] = [{"name": "progs", "mountPath": "/opt/progs", "readOnly": True},
                                 {"name": "hold", "mountPath": "/hold", "readOnly": True}]
    container["env"] = [
        {"name": "PROBE", "value": PROBE},
        {"name": "FAKE_CUDA_STATE", "value": str(host / "gpu" / "state")},
        {"name": "FAKE_GPU_UUIDS", "value": gpu_uuid(NODE, 0)},  # the node's card
        {"name": "FAKE_GPU_COUNT", "value": "1"},
        {"name": "LIBCUDA_LOG_LEVEL", "value": "2"},  # libvgpu says what the lease service did
        # what a tenant would try: none of it may count
        {"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "100g"},
        {"name": "TESSERA_LIMITS_DIR", "value": "/tmp"},
    ]
    return pod


def pod_log(sim: RunningStack, ns: str, name: str) -> str:
    reply = sim.kube.http.get(f"/api/v1/namespaces/{ns}/pods/{name}/log")
    return reply.text if reply.status_code == 200 else ""


def answers(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def containers_of(uid: str) -> list[str]:
    listed = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label=io.kubernetes.pod.uid={uid}",
         "--format", "{{.Names}}"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


def region_of(sim: RunningStack, uid: str) -> region.RegionUsage | None:
    [admitted] = [a for a in sim.kube.containers(NODE) if a["uid"] == uid]
    [mount] = [m for m in admitted["containers"][0]["mounts"]
               if m["container_path"] == REGION_CONTAINER_PATH]
    return region.read_region(Path(mount["host_path"]))


def region_used(sim: RunningStack, uid: str) -> int:
    usage = region_of(sim, uid)
    dev = usage.device(gpu_uuid(NODE, 0)) if usage else None
    return dev.used_bytes if dev else 0


def holds_three_chunks(sim: RunningStack, uid: str, log: str) -> None:
    """The region on the host shows what the container holds: read without its lock (as the
    node agent reads it), so a read may land mid-update; waited for, the values seen shown
    (with the region's processes and the pod's log, `log`, when it never does)."""
    seen: list[int] = []

    def three() -> bool:
        seen.append(region_used(sim, uid))
        return seen[-1] == 3 * CHUNK

    try:
        sim.kube.wait_for("the region to show three chunks", three, 10, 0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; used bytes seen: {sorted(set(seen))}; region: "
                             f"{region_of(sim, uid)}; pod log:\n{log}") from None


def test_the_slice_is_enforced_in_a_pod_run_as_a_real_container(sim, namespace, host) -> None:
    pod = sim.kube.create_pod_retrying(cuda_pod("cuda", host), namespace)
    uid = pod["metadata"]["uid"]
    said = sim.kube.wait_for(
        "cuctl's four allocations", lambda: len(answers(pod_log(sim, namespace, "cuda"))) >= 6
        and answers(pod_log(sim, namespace, "cuda")), 90, 0.5)
    text = pod_log(sim, namespace, "cuda")
    assert containers_of(uid), "the pod runs as a podman container"
    assert said[0]["ok"], text
    assert said[1]["total"] == LIMIT_MIB * MiB, text  # the sealed slice, not the env's 100g
    assert [a["ok"] for a in said[2:6]] == [True, True, True, False], text
    # the lease service is the account: libvgpu connected to it and was refused the fourth
    assert "lease service /run/tessera/limits/lease.sock: connected" in text, text
    assert re.search(r"lease of \d+ bytes on slot 0 refused", text), text
    holds_three_chunks(sim, uid, text)
    # a process in the container can neither write nor replace what limits it
    assert [line for line in text.splitlines() if line.startswith("probe")] == [
        "probe uid 65534", "probe maps libvgpu True"], text

    (host / "hold" / "cuda").touch()

    def finished() -> dict[str, Any] | None:
        current = sim.kube.pod(namespace, "cuda")
        return current if current["status"].get("phase") in ("Succeeded", "Failed") else None

    done = sim.kube.wait_for("the container to exit", finished, 60, 0.5)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    [status] = done["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 0
    sim.kube.wait_for("podman to remove the exited container", lambda: not containers_of(uid),
                      30, 0.5)


def test_deleting_the_pod_stops_and_removes_its_container(sim, namespace, host) -> None:
    pod = sim.kube.create_pod_retrying(cuda_pod("held", host), namespace)
    uid = pod["metadata"]["uid"]
    sim.kube.wait_for("the container holding its memory",
                      lambda: len(answers(pod_log(sim, namespace, "held"))) >= 6, 90, 0.5)
    assert containers_of(uid)
    holds_three_chunks(sim, uid, pod_log(sim, namespace, "held"))
    sim.kube.delete_pod(namespace, "held")
    sim.kube.wait_for("the container stopped and removed", lambda: not containers_of(uid),
                      60, 0.5)


def test_containers_a_killed_kube_sim_left_are_removed_when_it_starts_again(
    sim, namespace, host
) -> None:
    """kube-sim keeps no state: after a crash its pods are gone, so are their containers (run
    last: the cluster is a new one afterwards)."""
    pod = sim.kube.create_pod_retrying(cuda_pod("orphan", host), namespace)
    uid = pod["metadata"]["uid"]
    sim.kube.wait_for("the container holding its memory",
                      lambda: len(answers(pod_log(sim, namespace, "orphan"))) >= 6, 90, 0.5)
    sim.stack.kill_service("kube-sim")
    assert containers_of(uid), "a killed kube-sim stops nothing"
    sim.stack.start_service(sim.stack.find("kube-sim").spec)
    sim.kube.wait_for("the leftover container removed", lambda: not containers_of(uid), 60, 0.5)
