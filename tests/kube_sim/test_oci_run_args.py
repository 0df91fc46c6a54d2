"""What kube-sim's OCI runtime (oci.py) asks podman for, from a pod and its Allocate answer:
no engine needed (tests/e2e/test_oci_pods.py runs such containers for real)."""

from __future__ import annotations

from pathlib import Path

from tessera.kube_sim.kubelet import ContainerAdmission, DeviceNode, Mount
from tessera.kube_sim.oci import DRIVER_CONTAINER_DIR, OciSettings, run_args


def pod(container: dict, **spec) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "0123456789abcdef"},
            "spec": {"containers": [container], **spec}}


def pairs(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


GPU = ContainerAdmission(
    name="main", init=False, resource="nvidia.com/gpu", device_ids=["GPU-a-0"],
    envs={"CUDA_DEVICE_MEMORY_LIMIT_0": "1000m", "NVIDIA_VISIBLE_DEVICES": "GPU-a"},
    mounts=[Mount("/etc/ld.so.preload", "/host/ld.so.preload", True),
            Mount("/run/tessera/limits", "/host/limits", True),
            Mount("/run/tessera/region/usage", "/host/region/usage", False)],
    devices=[DeviceNode("/dev/nvidia0", "/dev/nvidia3", "rw")],
)


def test_allocate_mounts_env_and_the_driver_reach_a_gpu_container(tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    state.mkdir()
    settings = OciSettings(driver_dir="/drv", devices=(str(state), str(tmp_path / "absent")))
    container = {"name": "main", "image": "cuda:12", "command": ["/bin/sh", "-c", "run"],
                 "env": [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "100g"}]}
    run = run_args(pod(container), container, GPU, settings, "img")
    volumes = pairs(run.args, "-v")
    assert volumes[:3] == ["/host/ld.so.preload:/etc/ld.so.preload:ro",
                           "/host/limits:/run/tessera/limits:ro",
                           "/host/region/usage:/run/tessera/region/usage:rw"]
    assert f"/drv:{DRIVER_CONTAINER_DIR}:ro" in volumes
    assert f"{state}:{state}:rw" in volumes  # a directory "device"; a missing one is left out
    assert not any("absent" in v for v in volumes)
    assert "/dev/nvidia3:/dev/nvidia0:rw" in pairs(run.args, "--device")
    env = pairs(run.args, "--env")
    assert f"LD_LIBRARY_PATH={DRIVER_CONTAINER_DIR}" in env
    assert "NVIDIA_VISIBLE_DEVICES=GPU-a" in env
    assert "CUDA_DEVICE_MEMORY_LIMIT_0=100g" in env  # the container's own env last, as kubelet
    assert pairs(run.args, "--user") == ["65534:65534"]
    assert pairs(run.args, "--cap-drop") == ["ALL"]
    assert pairs(run.args, "--network") == ["none"]
    assert run.args[-5:] == ["--entrypoint", "/bin/sh", "img", "-c", "run"]
    assert run.name == "k8s_main_p_ns_01234567"


def test_a_container_without_devices_gets_no_driver_and_the_pod_fields_apply() -> None:
    container = {"name": "side", "image": "x", "command": ["sleep"], "args": ["5"],
                 "securityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": True},
                 "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True},
                                  {"name": "none", "mountPath": "/none"}]}
    spec = {"securityContext": {"runAsUser": 7, "runAsGroup": 8}, "hostNetwork": True,
            "volumes": [{"name": "data", "hostPath": {"path": "/srv/data"}},
                        {"name": "none", "emptyDir": {}}]}
    run = run_args(pod(container, **spec), container, None, OciSettings(driver_dir="/drv"), "x")
    assert pairs(run.args, "-v") == ["/srv/data:/data:ro"]
    assert pairs(run.args, "--user") == ["1000:8"]  # the container's uid over the pod's
    assert "--read-only" in run.args
    assert pairs(run.args, "--network") == ["host"]
    assert run.args[-4:] == ["--entrypoint", "sleep", "x", "5"]
