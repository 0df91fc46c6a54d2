"""The user-visible scenarios, end to end through the real protocols.

One stack for the module: four simulated nodes, each test pinned to its own node (or GPU) and
namespace so the tests stay independent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tessera.region import read_limits
from tessera_cli.app import build_app
from tessera_cli.stack import SimNode

from .conftest import RunningStack, gpu_pod, gpu_uuid, grants, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE_A = "e2e-a"  # 2 × A10 24 GiB: sharing, binpack
NODE_B = "e2e-b"  # 2 × A100 40 GiB: exclusive, percentage
NODE_C = "e2e-c"  # 8 × H100 80 GiB on 2 NUMA nodes: topology, init containers
NODE_D = "e2e-d"  # 2 × A10 24 GiB: spread
NODES = [
    SimNode(name=NODE_A, gpus=2, gpu_memory_mib=24576, gpu_model="NVIDIA A10"),
    SimNode(name=NODE_B, gpus=2, gpu_memory_mib=40960, gpu_model="NVIDIA A100-SXM4-40GB"),
    SimNode(name=NODE_C, gpus=8, gpu_memory_mib=81920, gpu_model="NVIDIA H100 80GB HBM3",
            numa_nodes=2),
    SimNode(name=NODE_D, gpus=2, gpu_memory_mib=24576, gpu_model="NVIDIA A10"),
]
BINPACK = {"hami.io/gpu-scheduler-policy": "binpack"}
SPREAD = {"hami.io/gpu-scheduler-policy": "spread"}


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack(NODES, run_containers=True)


@pytest.fixture
def ns(sim: RunningStack, namespace: str) -> Iterator[str]:
    yield namespace
    sim.kube.delete_namespace_pods(namespace)


def admitted(sim: RunningStack, ns: str, name: str) -> dict[str, Any]:
    """What the node's kubelet gave the pod's containers (env, mounts), by container name."""
    pod = sim.kube.pod(ns, name)
    for entry in sim.kube.containers(pod["spec"]["nodeName"]):
        if entry["uid"] == pod["metadata"]["uid"]:
            return {c["name"]: c for c in entry["containers"]}
    raise AssertionError(f"{ns}/{name} not admitted by its kubelet")


def sealed_memory_mib(container: dict[str, Any]) -> list[int]:
    mount = next(m for m in container["mounts"] if m["container_path"] == "/run/tessera/limits")
    limits = read_limits(mount["host_path"])
    assert limits is not None, "PreStartContainer sealed no limits"
    return [d.mem_limit_bytes >> 20 for d in limits.devices]


def create_all(sim: RunningStack, ns: str, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for pod in pods:
        reply = sim.kube.create_pod(pod, ns)
        assert reply.status_code == 201, reply.text
    return [sim.kube.wait_running(ns, p["metadata"]["name"]) for p in pods]


def test_three_pods_share_one_gpu(sim: RunningStack, ns: str) -> None:
    pods = create_all(sim, ns, [
        gpu_pod(f"share-{i}", mem=3000, cores=30, annotations=BINPACK, node=NODE_A)
        for i in range(3)
    ])
    devices = [grants(p) for p in pods]
    assert all(len(d) == 1 and len(d[0]) == 1 for d in devices)
    assert len({d[0][0].uuid for d in devices}) == 1, "binpack keeps the three on one GPU"
    assert all((d[0][0].memory_mib, d[0][0].cores) == (3000, 30) for d in devices)
    for pod in pods:
        main = admitted(sim, ns, pod["metadata"]["name"])["main"]
        assert main["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m"
        assert main["envs"]["NVIDIA_VISIBLE_DEVICES"] == devices[0][0][0].uuid
        assert sealed_memory_mib(main) == [3000]


def test_exclusive_gpu_blocks_sharing_until_deleted(sim: RunningStack, ns: str) -> None:
    card = gpu_uuid(NODE_B, 0)
    pin = {"nvidia.com/use-gpuuuid": card}
    [whole] = create_all(sim, ns, [gpu_pod("whole", count=1, annotations=pin, node=NODE_B)])
    [[grant]] = grants(whole)
    assert (grant.uuid, grant.memory_mib, grant.cores) == (card, 40960, 100)

    reply = sim.kube.create_pod(gpu_pod("waiting", mem=1000, cores=10, annotations=pin,
                                        node=NODE_B), ns)
    assert reply.status_code == 201, reply.text

    def reason() -> str:
        result = CliRunner().invoke(
            build_app(), ["get", "pods", "-n", ns, "-o", "json",
                          "--kubeconfig", str(sim.stack.kubeconfig)],
        )
        assert result.exit_code == 0, result.output
        pods = {p["name"]: p for p in json.loads(result.output)}
        assert pods["waiting"]["phase"] == "Pending"
        return pods["waiting"]["reason"]

    why = sim.kube.wait_for("a reason on the pending pod", reason, 15)
    assert "0/" in why and "nodes are available" in why
    assert "Exclusive" in why or "Insufficient" in why or "Exhausted" in why, why

    sim.kube.delete_pod(ns, "whole")
    freed = sim.kube.wait_running(ns, "waiting", timeout_s=15)
    assert grants(freed)[0][0].uuid == card


def test_percentage_memory(sim: RunningStack, ns: str) -> None:
    pin = {"nvidia.com/use-gpuuuid": gpu_uuid(NODE_B, 1)}
    [pod] = create_all(sim, ns, [gpu_pod("half", percentage=50, cores=20, annotations=pin,
                                         node=NODE_B)])
    [[grant]] = grants(pod)
    assert grant.memory_mib == 40960 // 2
    assert admitted(sim, ns, "half")["main"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m"


def test_four_gpus_topology_aware(sim: RunningStack, ns: str) -> None:
    policy = {"hami.io/gpu-scheduler-policy": "topology-aware"}
    [pod] = create_all(sim, ns, [gpu_pod("quad", count=4, mem=1000, cores=10,
                                         annotations=policy, node=NODE_C)])
    [devices] = grants(pod)
    index = {gpu_uuid(NODE_C, i): i for i in range(8)}
    chosen = sorted(index[d.uuid] for d in devices)
    assert len(set(chosen)) == 4
    # Links within a NUMA node score higher than across: the best set is one NUMA half.
    assert chosen in ([0, 1, 2, 3], [4, 5, 6, 7]), chosen
    envs = admitted(sim, ns, "quad")["main"]["envs"]
    assert sorted(envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(d.uuid for d in devices)


def test_init_containers_get_their_own_slices(sim: RunningStack, ns: str) -> None:
    pod = gpu_pod("with-init", mem=1000, cores=10, node=NODE_C,
                  init={"gpu": 1, "gpumem": 2000, "gpucores": 20})
    [running] = create_all(sim, ns, [pod])
    init_grants, app_grants = grants(running)
    assert [g.memory_mib for g in init_grants] == [2000]
    assert [g.memory_mib for g in app_grants] == [1000]
    containers = admitted(sim, ns, "with-init")
    assert containers["warmup"]["init"] is True
    assert containers["warmup"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert containers["main"]["envs"]["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
    assert sealed_memory_mib(containers["warmup"]) == [2000]
    assert sealed_memory_mib(containers["main"]) == [1000]


def test_quota_denied_at_admission(sim: RunningStack, ns: str, tmp_path: Path) -> None:
    quota = tmp_path / "quota.yaml"
    quota.write_text(json.dumps({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu"},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "4000"}},
    }))
    result = CliRunner().invoke(build_app(), ["apply", "-f", str(quota), "-n", ns,
                                              "--kubeconfig", str(sim.stack.kubeconfig)])
    assert result.exit_code == 0, result.output

    def denied() -> str | None:
        reply = sim.kube.create_pod(gpu_pod("too-big", mem=5000, cores=10, node=NODE_C), ns)
        if reply.status_code == 201:  # the quota service has not seen the quota yet
            sim.kube.delete_pod(ns, "too-big")
            return None
        assert 400 <= reply.status_code < 500, reply.text
        return str(reply.json()["message"])

    message = sim.kube.wait_for("the quota to deny", denied, 15, 0.3)
    assert "quota" in message.lower(), message
    create_all(sim, ns, [gpu_pod("fits", mem=3000, cores=10, node=NODE_C)])


def test_type_and_uuid_filters(sim: RunningStack, ns: str) -> None:
    target = gpu_uuid(NODE_C, 5)
    pods = create_all(sim, ns, [
        gpu_pod("wants-a100", mem=1000, cores=5, annotations={"nvidia.com/use-gputype": "A100"}),
        gpu_pod("no-a100-h100", mem=1000, cores=5,
                annotations={"nvidia.com/nouse-gputype": "a100,h100"}),
        gpu_pod("wants-uuid", mem=1000, cores=5, annotations={"nvidia.com/use-gpuuuid": target}),
    ])
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert by_name["wants-a100"]["spec"]["nodeName"] == NODE_B
    assert "A100" in grants(by_name["wants-a100"])[0][0].type
    assert by_name["no-a100-h100"]["spec"]["nodeName"] in (NODE_A, NODE_D)
    assert grants(by_name["wants-uuid"])[0][0].uuid == target


def test_binpack_vs_spread(sim: RunningStack, ns: str) -> None:
    packed = create_all(sim, ns, [
        gpu_pod(f"pack-{i}", mem=1000, cores=5, annotations=BINPACK, node=NODE_A)
        for i in range(2)
    ])
    spread = create_all(sim, ns, [
        gpu_pod(f"spread-{i}", mem=1000, cores=5, annotations=SPREAD, node=NODE_D)
        for i in range(2)
    ])
    assert len({grants(p)[0][0].uuid for p in packed}) == 1
    assert len({grants(p)[0][0].uuid for p in spread}) == 2


def test_cli_apply_get_delete(sim: RunningStack, ns: str, tmp_path: Path) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: from-yaml\nspec:\n  containers:\n"
        "  - name: cuda\n    image: cuda:12\n    resources:\n      limits:\n"
        "        nvidia.com/gpu: 1\n        nvidia.com/gpumem: 100000\n"
    )
    cli = ["--kubeconfig", str(sim.stack.kubeconfig)]
    runner = CliRunner()
    result = runner.invoke(build_app(), ["apply", "-f", str(manifest), "-n", ns, *cli])
    assert result.exit_code == 0 and "created" in result.output, result.output

    def table() -> str | None:
        out = runner.invoke(build_app(), ["get", "pods", "-n", ns, *cli]).output
        return out if "CardInsufficientMemory" in out else None

    listing = sim.kube.wait_for("the pending reason in `tessera get pods`", table, 15)
    assert "from-yaml" in listing and "Pending" in listing
    result = runner.invoke(build_app(), ["delete", "pod", "from-yaml", "-n", ns, *cli])
    assert result.exit_code == 0 and "deleted" in result.output
    assert sim.kube.pods(ns) == []


def test_container_command_runs_with_its_slice(sim: RunningStack, ns: str, tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    pod = gpu_pod("runs", mem=1500, cores=15, node=NODE_C)
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["containers"][0]["command"] = [
        "/bin/sh", "-c",
        f"env | grep -E '^(CUDA_DEVICE_MEMORY_LIMIT_0|NVIDIA_VISIBLE_DEVICES|TESSERA_LIMITS_DIR"
        f"|LD_PRELOAD|GREETING)=' | sort > {out}",
    ]
    pod["spec"]["containers"][0]["env"] = [{"name": "GREETING", "value": "hello"}]
    assert sim.kube.create_pod(pod, ns).status_code == 201

    def finished() -> dict[str, Any] | None:
        current = sim.kube.pod(ns, "runs")
        return current if current["status"].get("phase") in ("Succeeded", "Failed") else None

    done = sim.kube.wait_for("the container's process to exit", finished, 20)
    assert done["status"]["phase"] == "Succeeded"
    env = dict(line.split("=", 1) for line in out.read_text().splitlines())
    [[grant]] = grants(done)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1500m"
    assert env["NVIDIA_VISIBLE_DEVICES"] == grant.uuid
    assert env["GREETING"] == "hello"
    libvgpu = Path(__file__).resolve().parents[2] / "native/libvgpu/build/libvgpu.so"
    if libvgpu.is_file():  # `make native` built it: the process ran with it preloaded
        assert env["LD_PRELOAD"] == str(libvgpu)
    # The sealed limits directory is the host side of the container's read-only mount.
    limits = read_limits(env["TESSERA_LIMITS_DIR"])
    assert limits is not None and [d.mem_limit_bytes >> 20 for d in limits.devices] == [1500]
