"""Running a pod's containers as OCI containers (runc, through podman): what containerd does for
kubelet, opt-in with `TESSERA_KUBE_SIM_CONTAINER_RUNTIME=podman`.

Each container with a `command` becomes one `podman run`, given exactly what the device plugin's
Allocate returned for it:

- its mounts, each a bind of the host path at the container path, read-only as Allocate says
  (`/etc/ld.so.preload` a file bind, libvgpu, the sealed limits directory, the region);
- its env, under the container's own `env` values (as kubelet passes both to the runtime);
- its device nodes (DeviceSpec) as `--device host:container:permissions`;
- the driver, for a container that got GPU devices, as the NVIDIA container toolkit would bring
  it: the driver's user-space libraries (`container_driver_dir`: libcuda.so.1, libnvidia-ml.so.1
  — the fake driver in tests) read-only at `/usr/local/nvidia/lib64` on `LD_LIBRARY_PATH`, and
  the device nodes (`container_devices`: character devices as `--device`; a directory, such as
  the fake driver's shared state, bound read-write at its own path).

Pod fields applied: `command`/`args`, `workingDir`, `env` (plain values), `hostPath` volumes
through `volumeMounts` (`readOnly`), `securityContext.runAsUser`/`runAsGroup` (the container's
over the pod's), `readOnlyRootFilesystem`, `hostNetwork`. Departures, on purpose: no image is
pulled (there is no registry): the pod's image runs when the engine has it, else
`container_image`; a container that names no user runs as `container_user` (65534 by default),
never as the image's root; every container drops all capabilities and gets no new privileges; a
pod without `hostNetwork` has no network (kube-sim has no pod network).

Init containers run to completion first, in order; the pod then Succeeds or Fails by the
containers' exit codes. Deleting the pod stops its containers (SIGTERM, SIGKILL after the grace
period) and removes them. Output goes to `<log_dir>/<pod>_<container>.log` (`kubectl logs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.kube_sim.kubelet import ContainerAdmission, PodAdmission
from tessera.kube_sim.processes import OnExit
from tessera.kube_sim.store import KubeObject, now_rfc3339

log = logging.getLogger("tessera.kube_sim.oci")

DRIVER_CONTAINER_DIR = "/usr/local/nvidia/lib64"
LABEL_UID = "io.kubernetes.pod.uid"
LABEL_KUBELET = "io.tessera.kube-sim.kubelet"  # <kubelet root>/<node>: whose container it is
PODMAN_TIMEOUT_S = 60.0
# podman's own failures (the container never ran): 125 podman, 126 not executable, 127 not found
ENGINE_ERRORS = {125: "StartError", 126: "ContainerCannotRun", 127: "ContainerCannotRun"}


@dataclass(frozen=True)
class OciSettings:
    podman: str = "podman"
    image: str = "localhost/tessera-python-base:3.11-bookworm"
    user: str = "65534:65534"
    driver_dir: str = ""
    devices: tuple[str, ...] = ()


@dataclass
class ContainerRun:
    """The `podman run` arguments of one container (pure: built from the pod and Allocate)."""

    name: str
    args: list[str] = field(default_factory=list)


def container_name(pod: KubeObject, container: dict[str, Any]) -> str:
    """Unique per pod and container, in the dockershim's k8s_<container>_<pod>_<ns>_<uid> form."""
    meta = pod["metadata"]
    raw = (f"k8s_{container.get('name', 'c')}_{meta.get('name', '')}_"
           f"{meta.get('namespace', 'default')}_{meta.get('uid', '')[:8]}")
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", raw)


def _user(pod: KubeObject, container: dict[str, Any], default: str) -> str:
    pod_ctx = (pod.get("spec") or {}).get("securityContext") or {}
    ctx = container.get("securityContext") or {}
    uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
    gid = ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
    if uid is None:
        return default if gid is None else f"{default.split(':')[0]}:{int(gid)}"
    return f"{int(uid)}:{int(gid if gid is not None else uid)}"


def _host_paths(pod: KubeObject) -> dict[str, str]:
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return {v["name"]: v["hostPath"]["path"] for v in volumes
            if isinstance(v, dict) and isinstance(v.get("hostPath"), dict)
            and v["hostPath"].get("path")}


def _device_args(paths: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for path in paths:
        try:
            mode = Path(path).stat().st_mode
        except OSError:
            continue  # not on this node: the container gets what there is, as the toolkit does
        if stat.S_ISCHR(mode):
            out += ["--device", path]
        else:
            out += ["-v", f"{path}:{path}:rw"]
    return out


def run_args(
    pod: KubeObject, container: dict[str, Any], entry: ContainerAdmission | None,
    settings: OciSettings, image: str,
) -> ContainerRun:
    """`podman run` for one container, as containerd would create it from the CRI config."""
    meta = pod["metadata"]
    spec = pod.get("spec") or {}
    ctx = container.get("securityContext") or {}
    name = container_name(pod, container)
    args = [
        "run", "--rm", "--name", name, "--pull", "never",
        "--label", f"{LABEL_UID}={meta.get('uid', '')}",
        "--label", f"io.kubernetes.pod.name={meta.get('name', '')}",
        "--label", f"io.kubernetes.pod.namespace={meta.get('namespace', 'default')}",
        "--label", f"io.kubernetes.container.name={container.get('name', '')}",
        "--user", _user(pod, container, settings.user),
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--network", "host" if spec.get("hostNetwork") else "none",
    ]
    if ctx.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if container.get("workingDir"):
        args += ["--workdir", str(container["workingDir"])]
    env: dict[str, str] = {}
    gpu = entry is not None and bool(entry.device_ids)
    if entry is not None:
        for mount in entry.mounts:
            args += ["-v", f"{mount.host_path}:{mount.container_path}:"
                     f"{'ro' if mount.read_only else 'rw'}"]
        env.update(entry.envs)
        for device in entry.devices:
            args += ["--device", f"{device.host_path}:{device.container_path}:"
                     f"{device.permissions or 'rwm'}"]
    if gpu and settings.driver_dir:
        args += ["-v", f"{settings.driver_dir}:{DRIVER_CONTAINER_DIR}:ro"]
        env["LD_LIBRARY_PATH"] = DRIVER_CONTAINER_DIR
    if gpu:
        args += _device_args(settings.devices)
    volumes = _host_paths(pod)
    for mount in container.get("volumeMounts") or []:
        host = volumes.get(mount.get("name", ""))
        if host and mount.get("mountPath"):
            args += ["-v", f"{host}:{mount['mountPath']}:{'ro' if mount.get('readOnly') else 'rw'}"]
    for item in container.get("env") or []:
        if isinstance(item, dict) and "value" in item:
            env[str(item["name"])] = str(item["value"])
    for key, value in env.items():
        args += ["--env", f"{key}={value}"]
    command = [str(a) for a in container.get("command") or []]
    if command:
        args += ["--entrypoint", command[0]]
    args.append(image)
    args += command[1:] + [str(a) for a in container.get("args") or []]
    return ContainerRun(name, args)


class OciContainers:
    """The container runtime of one simulated node (the interface of `ContainerProcesses`)."""

    def __init__(self, log_dir: Path, node: str, settings: OciSettings, kubelet: str = "") -> None:
        self.log_dir = log_dir
        self.node = node
        self.kubelet = kubelet or node
        self.settings = settings
        self._names: dict[str, list[str]] = {}  # pod uid -> its containers
        self._runs: dict[str, list[asyncio.subprocess.Process]] = {}
        self._waiters: dict[str, asyncio.Task[None]] = {}

    async def _podman(self, *args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            self.settings.podman, *args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), PODMAN_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return 124, f"podman {args[0]} did not answer within {PODMAN_TIMEOUT_S} s"
        return proc.returncode or 0, out.decode(errors="replace")

    async def _image(self, wanted: str) -> str:
        """The pod's image when the engine has it (nothing is pulled), else the configured one."""
        if wanted:
            code, _ = await self._podman("image", "exists", wanted)
            if code == 0:
                return wanted
        return self.settings.image

    async def _run(self, uid: str, pod: KubeObject, container: dict[str, Any],
                   entry: ContainerAdmission | None) -> asyncio.subprocess.Process:
        image = await self._image(str(container.get("image") or ""))
        run = run_args(pod, container, entry, self.settings, image)
        run.args[1:1] = ["--label", f"{LABEL_KUBELET}={self.kubelet}"]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{pod['metadata'].get('name', '')}_{container.get('name')}.log"
        self._names.setdefault(uid, []).append(run.name)
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                self.settings.podman, *run.args, stdout=out, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
            )
        self._runs.setdefault(uid, []).append(proc)
        log.info("container started", extra={"node": self.node, "container": run.name,
                                             "image": image})
        return proc

    async def start_pod(self, pod: KubeObject, admission: PodAdmission, on_exit: OnExit) -> None:
        spec = pod.get("spec") or {}
        uid = pod["metadata"].get("uid", "")
        by_name = {c.name: c for c in admission.containers}
        inits = [c for c in spec.get("initContainers") or [] if c.get("command")]
        runnable = [c for c in spec.get("containers") or [] if c.get("command")]
        if not inits and not runnable:
            return
        for container in inits:
            proc = await self._run(uid, pod, container, by_name.get(container.get("name", "")))
            if await proc.wait() != 0:
                on_exit(pod, "Failed", [])
                return
        procs = [(c, await self._run(uid, pod, c, by_name.get(c.get("name", ""))))
                 for c in runnable]
        self._waiters[uid] = asyncio.create_task(self._wait(pod, procs, on_exit))

    async def _wait(self, pod: KubeObject,
                    procs: list[tuple[dict[str, Any], asyncio.subprocess.Process]],
                    on_exit: OnExit) -> None:
        codes = [await proc.wait() for _, proc in procs]
        finished = now_rfc3339()
        statuses = [{
            "name": c.get("name", ""), "ready": False, "restartCount": 0,
            "state": {"terminated": {
                "exitCode": code, "finishedAt": finished,
                "reason": "Completed" if code == 0 else ENGINE_ERRORS.get(code, "Error"),
            }},
        } for (c, _), code in zip(procs, codes, strict=True)]
        on_exit(pod, "Succeeded" if all(code == 0 for code in codes) else "Failed", statuses)

    def running(self, uid: str) -> bool:
        return any(proc.returncode is None for proc in self._runs.get(uid, []))

    async def stop_pod(self, uid: str, grace_s: float = 5.0) -> None:
        """Stop (SIGTERM, SIGKILL after `grace_s`) and remove the pod's containers."""
        waiter = self._waiters.pop(uid, None)
        if waiter is not None:
            waiter.cancel()
        names = self._names.pop(uid, [])
        runs = self._runs.pop(uid, [])
        if names:
            code, out = await self._podman("rm", "--force", "--ignore", "--time",
                                           str(max(0, round(grace_s))), *names)
            if code != 0:
                log.warning("containers not removed", extra={"node": self.node,
                                                             "containers": names, "err": out})
        for proc in runs:
            if proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), PODMAN_TIMEOUT_S)

    async def remove_leftovers(self) -> None:
        """At start: containers this kubelet left when its kube-sim was killed belong to pods of
        a cluster that is gone (kube-sim keeps no state across restarts): removed."""
        code, out = await self._podman("ps", "--all", "--quiet", "--filter",
                                       f"label={LABEL_KUBELET}={self.kubelet}")
        ids = out.split() if code == 0 else []
        if ids:
            log.info("removing containers of an earlier kube-sim",
                     extra={"node": self.node, "containers": len(ids)})
            await self._podman("rm", "--force", "--ignore", "--time", "1", *ids)

    async def stop_all(self) -> None:
        for uid in list(self._names):
            await self.stop_pod(uid, grace_s=1.0)
